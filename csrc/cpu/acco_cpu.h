// CPU kernels: one OpenMP parallel region per call, vectorizable inner loops.
#pragma once

#include <algorithm>
#include <vector>

#include "../acco_common.h"

namespace acco {
namespace cpu {

// One pass over a flat shard: AdamW update of (master, m, v) from grad, the new
// parameters written to `out` (dtype out_dtype, may be null). commit == false
// ("peek") writes only `out` and leaves master, m and v untouched.
template <int OutDType, bool Commit>
void adam_pass(float* master, const float* grad, float* m, float* v, void* out, int64_t n, const AdamScalars s) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float p = master[i], mi = m[i], vi = v[i];
    adam_element(p, grad[i], mi, vi, s);
    if (Commit) {
      master[i] = p;
      m[i] = mi;
      v[i] = vi;
    }
    if (OutDType >= 0) store_from_float(out, i, OutDType, p);
  }
}

inline void adam_update(float* master, const float* grad, float* m, float* v, void* out, int out_dtype, int64_t n,
                        const AdamScalars& s, bool commit) {
  // Dispatch once so that the loop body is branch-free.
  if (commit) {
    switch (out_dtype) {
      case kFloat32: return adam_pass<kFloat32, true>(master, grad, m, v, out, n, s);
      case kBFloat16: return adam_pass<kBFloat16, true>(master, grad, m, v, out, n, s);
      case kFloat16: return adam_pass<kFloat16, true>(master, grad, m, v, out, n, s);
      default: return adam_pass<-1, true>(master, grad, m, v, out, n, s);
    }
  }
  switch (out_dtype) {
    case kFloat32: return adam_pass<kFloat32, false>(master, grad, m, v, out, n, s);
    case kBFloat16: return adam_pass<kBFloat16, false>(master, grad, m, v, out, n, s);
    case kFloat16: return adam_pass<kFloat16, false>(master, grad, m, v, out, n, s);
    default: return;  // a peek without output does nothing
  }
}

// Work item of the multi-tensor loops: a contiguous chunk of one tensor.
struct Chunk {
  int item;
  int64_t start, size;
};

inline std::vector<Chunk> make_chunks(const std::vector<FlatItem>& items, int64_t chunk = 1 << 16) {
  std::vector<Chunk> chunks;
  for (int t = 0; t < static_cast<int>(items.size()); ++t)
    for (int64_t s = 0; s < items[t].numel; s += chunk) chunks.push_back({t, s, std::min(chunk, items[t].numel - s)});
  return chunks;
}

template <int DType, bool Accumulate>
inline void pack_chunk(const void* src, float* dst, int64_t start, int64_t size, float scale) {
#pragma omp simd
  for (int64_t i = start; i < start + size; ++i) {
    const float x = load_as_float(src, i, DType) * scale;
    dst[i] = Accumulate ? dst[i] + x : x;
  }
}

// flat[offset_t : offset_t + numel_t] (+)= tensor_t * scale for every t, all chunks of all
// tensors in one parallel region.
inline void pack(const std::vector<FlatItem>& items, float* flat, float scale, bool accumulate) {
  const std::vector<Chunk> chunks = make_chunks(items);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c) {
    const FlatItem& it = items[chunks[c].item];
    float* dst = flat + it.offset;
    const int64_t st = chunks[c].start, sz = chunks[c].size;
    switch (it.dtype * 2 + (accumulate ? 1 : 0)) {
      case kFloat32 * 2: pack_chunk<kFloat32, false>(it.data, dst, st, sz, scale); break;
      case kFloat32 * 2 + 1: pack_chunk<kFloat32, true>(it.data, dst, st, sz, scale); break;
      case kBFloat16 * 2: pack_chunk<kBFloat16, false>(it.data, dst, st, sz, scale); break;
      case kBFloat16 * 2 + 1: pack_chunk<kBFloat16, true>(it.data, dst, st, sz, scale); break;
      case kFloat16 * 2: pack_chunk<kFloat16, false>(it.data, dst, st, sz, scale); break;
      default: pack_chunk<kFloat16, true>(it.data, dst, st, sz, scale); break;
    }
  }
}

// tensor_t = flat[offset_t : offset_t + numel_t], cast to each tensor's dtype.
inline void unpack(const float* flat, const std::vector<FlatItem>& items) {
  const std::vector<Chunk> chunks = make_chunks(items);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c) {
    const FlatItem& it = items[chunks[c].item];
    const float* src = flat + it.offset;
    for (int64_t i = chunks[c].start; i < chunks[c].start + chunks[c].size; ++i)
      store_from_float(it.data, i, it.dtype, src[i]);
  }
}

}  // namespace cpu
}  // namespace acco
