// CPU kernels of acco_ds: one OpenMP parallel region per call, inner loops
// specialised per dtype so that they vectorize (build with -fno-math-errno so
// that sqrtf does too, and -ffp-contract=off to keep torch's rounding).
#include "acco_cpu.h"

#include <algorithm>

namespace acco {
namespace cpu {
namespace {

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kMinParallel = 1 << 15;
// Work unit of the multi-tensor loops: 64K elements of one tensor.
constexpr int64_t kChunk = 1 << 16;

template <int OutDType, bool Commit>
void adam_pass(float* __restrict master, const float* __restrict grad, float* __restrict m, float* __restrict v,
               void* __restrict out, int64_t n, const AdamScalars s) {
#pragma omp parallel for simd schedule(static) if (n >= kMinParallel)
  for (int64_t i = 0; i < n; ++i) {
    float p = master[i], mi = m[i], vi = v[i];
    adam_element(p, grad[i], mi, vi, s);
    if constexpr (Commit) {
      master[i] = p;
      m[i] = mi;
      v[i] = vi;
    }
    if constexpr (OutDType >= 0) store_from_float<OutDType>(out, i, p);
  }
}

template <bool Commit>
void adam_dispatch(float* master, const float* grad, float* m, float* v, void* out, int out_dtype, int64_t n,
                   const AdamScalars& s) {
  switch (out_dtype) {
    case kFloat32: return adam_pass<kFloat32, Commit>(master, grad, m, v, out, n, s);
    case kBFloat16: return adam_pass<kBFloat16, Commit>(master, grad, m, v, out, n, s);
    case kFloat16: return adam_pass<kFloat16, Commit>(master, grad, m, v, out, n, s);
    default: if (Commit) adam_pass<-1, true>(master, grad, m, v, out, n, s);  // a peek without out: nothing to do
  }
}

struct Chunk {
  int item;
  int64_t start, size;
};

// Every tensor cut into chunks; one parallel loop then covers all of them.
std::vector<Chunk> make_chunks(const std::vector<FlatItem>& items) {
  std::vector<Chunk> chunks;
  for (int t = 0; t < static_cast<int>(items.size()); ++t)
    for (int64_t s = 0; s < items[t].numel; s += kChunk) chunks.push_back({t, s, std::min(kChunk, items[t].numel - s)});
  return chunks;
}

int64_t total_numel(const std::vector<FlatItem>& items) {
  int64_t n = 0;
  for (const auto& it : items) n += it.numel;
  return n;
}

template <int DType, bool Accumulate>
void pack_chunk(const void* __restrict src, float* __restrict dst, int64_t start, int64_t end, float scale) {
#pragma omp simd
  for (int64_t i = start; i < end; ++i) {
    const float x = load_as_float<DType>(src, i) * scale;
    dst[i] = Accumulate ? dst[i] + x : x;
  }
}

template <int DType>
void unpack_chunk(const float* __restrict src, void* __restrict dst, int64_t start, int64_t end) {
#pragma omp simd
  for (int64_t i = start; i < end; ++i) store_from_float<DType>(dst, i, src[i]);
}

}  // namespace

void adam_update(float* master, const float* grad, float* m, float* v, void* out, int out_dtype, int64_t n,
                 const AdamScalars& s, bool commit) {
  if (commit) {
    adam_dispatch<true>(master, grad, m, v, out, out_dtype, n, s);
  } else {
    adam_dispatch<false>(master, grad, m, v, out, out_dtype, n, s);
  }
}

void pack(const std::vector<FlatItem>& items, float* flat, float scale, bool accumulate) {
  const std::vector<Chunk> chunks = make_chunks(items);
  const int64_t n_chunks = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(static) if (total_numel(items) >= kMinParallel)
  for (int64_t c = 0; c < n_chunks; ++c) {
    const FlatItem& it = items[chunks[c].item];
    float* dst = flat + it.offset;
    const int64_t start = chunks[c].start, end = start + chunks[c].size;
    switch (it.dtype * 2 + (accumulate ? 1 : 0)) {
      case kFloat32 * 2: pack_chunk<kFloat32, false>(it.data, dst, start, end, scale); break;
      case kFloat32 * 2 + 1: pack_chunk<kFloat32, true>(it.data, dst, start, end, scale); break;
      case kBFloat16 * 2: pack_chunk<kBFloat16, false>(it.data, dst, start, end, scale); break;
      case kBFloat16 * 2 + 1: pack_chunk<kBFloat16, true>(it.data, dst, start, end, scale); break;
      case kFloat16 * 2: pack_chunk<kFloat16, false>(it.data, dst, start, end, scale); break;
      default: pack_chunk<kFloat16, true>(it.data, dst, start, end, scale); break;
    }
  }
}

void unpack(const float* flat, const std::vector<FlatItem>& items) {
  const std::vector<Chunk> chunks = make_chunks(items);
  const int64_t n_chunks = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(static) if (total_numel(items) >= kMinParallel)
  for (int64_t c = 0; c < n_chunks; ++c) {
    const FlatItem& it = items[chunks[c].item];
    const float* src = flat + it.offset;
    const int64_t start = chunks[c].start, end = start + chunks[c].size;
    switch (it.dtype) {
      case kFloat32: unpack_chunk<kFloat32>(src, it.data, start, end); break;
      case kBFloat16: unpack_chunk<kBFloat16>(src, it.data, start, end); break;
      default: unpack_chunk<kFloat16>(src, it.data, start, end); break;
    }
  }
}

}  // namespace cpu
}  // namespace acco
