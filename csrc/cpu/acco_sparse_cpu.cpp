// CPU kernels of sparse outer communication: chunked top-k + quantize + pack + error-feedback residual in one
// pass per chunk, and unpack + accumulate. Parallel over chunks (OpenMP, one region per call).
//
// Selection per chunk: a min-heap of the k largest keys seen so far (key: acco_sparse.h, |e| bits then the
// lower index), one read of the chunk. On gradient-like data few entries beat the heap's minimum (about
// k ln(len / k) of them), so this costs little more than the read; in the worst case (magnitudes increasing
// along the chunk) len log k. Then the kept indices are sorted ascending and quantized in that order.
#include <algorithm>
#include <vector>

#include "../acco_sparse.h"
#include "acco_cpu.h"

namespace acco {
namespace cpu {
namespace {

constexpr int64_t kMinParallel = 1 << 15;  // elements; below this a parallel region costs more than it saves
constexpr int64_t kGroup = 16;              // elements tested at once against the heap's floor

// Restore the min-heap h[0..n) after h[0] was replaced.
void sift_down(uint64_t* h, int64_t n) {
  int64_t i = 0;
  const uint64_t x = h[0];
  for (;;) {
    int64_t child = 2 * i + 1;
    if (child >= n) break;
    if (child + 1 < n && h[child + 1] < h[child]) ++child;
    if (h[child] >= x) break;
    h[i] = h[child];
    i = child;
  }
  h[i] = x;
}

// The in-chunk indices of the k largest keys of e[0..len), ascending, into `kept`; returns max |e| over them.
float select_chunk(const float* e, int64_t len, int64_t k, std::vector<uint64_t>& heap, std::vector<int32_t>& kept) {
  kept.resize(k);
  uint32_t max_bits = 0;
  if (k == len) {  // everything is kept: no selection
    for (int64_t i = 0; i < len; ++i) {
      kept[i] = static_cast<int32_t>(i);
      max_bits = std::max(max_bits, magnitude_bits(e[i]));
    }
    return bits_to_float(max_bits);
  }
  heap.resize(k);
  for (int64_t i = 0; i < k; ++i) heap[i] = selection_key(e[i], i);
  std::make_heap(heap.begin(), heap.end(), std::greater<uint64_t>());
  uint64_t floor = heap[0];
  auto offer = [&](int64_t i) {
    // Compare the magnitude bits first: the full key only matters when they are at least the floor's.
    if (static_cast<uint64_t>(magnitude_bits(e[i])) < (floor >> 16)) return;
    const uint64_t key = selection_key(e[i], i);
    if (key > floor) {
      heap[0] = key;
      sift_down(heap.data(), k);
      floor = heap[0];
    }
  };
  int64_t i = k;
  for (; i + kGroup <= len; i += kGroup) {
    // Most groups hold nothing above the floor: one vectorized max skips them (equal bits at a later index
    // lose the tie, so a group whose max is below the floor's bits cannot enter).
    uint32_t group_max = 0;
#pragma omp simd reduction(max : group_max)
    for (int64_t t = 0; t < kGroup; ++t) group_max = std::max(group_max, magnitude_bits(e[i + t]));
    if (static_cast<uint64_t>(group_max) < (floor >> 16)) continue;
    for (int64_t t = 0; t < kGroup; ++t) offer(i + t);
  }
  for (; i < len; ++i) offer(i);
  for (int64_t j = 0; j < k; ++j) {
    kept[j] = 65535 - static_cast<int32_t>(heap[j] & 0xFFFFu);
    max_bits = std::max(max_bits, static_cast<uint32_t>(heap[j] >> 16));
  }
  std::sort(kept.begin(), kept.end());
  return bits_to_float(max_bits);
}

}  // namespace

void sparse_pack(float* e, const int64_t* offsets, const int64_t* entry_starts, const int64_t* byte_starts,
                 int64_t chunks, int64_t topk, int value_bits, int16_t* indices, void* values, float* scales) {
  const bool parallel = offsets[chunks] - offsets[0] >= kMinParallel;
#pragma omp parallel if (parallel)
  {
    std::vector<uint64_t> heap;
    std::vector<int32_t> kept;
#pragma omp for schedule(dynamic, 16)
    for (int64_t c = 0; c < chunks; ++c) {
      float* chunk = e + offsets[c];
      const int64_t len = offsets[c + 1] - offsets[c];
      const int64_t k = std::min(topk, len);
      const float m = k > 0 ? select_chunk(chunk, len, k, heap, kept) : 0.0f;
      int16_t* idx = indices + entry_starts[c];
      if (value_bits == 0) {
        float* v_out = static_cast<float*>(values) + entry_starts[c];
        for (int64_t j = 0; j < k; ++j) {
          const float v = chunk[kept[j]];
          idx[j] = static_cast<int16_t>(static_cast<uint16_t>(kept[j]));
          v_out[j] = v;
          chunk[kept[j]] = sub_rn(v, v);  // q = v: the residual is v - v, as the reference computes it
        }
        continue;
      }
      uint8_t* bytes = static_cast<uint8_t*>(values) + byte_starts[c];
      scales[c] = m;
      for (int64_t j = 0; j < k; ++j) {
        const float v = chunk[kept[j]];
        const uint32_t code = sparse_code(v, m, value_bits);
        const int64_t bit = j * value_bits;
        bytes[bit / 8] = static_cast<uint8_t>(bytes[bit / 8] | (code << (bit % 8)));
        idx[j] = static_cast<int16_t>(static_cast<uint16_t>(kept[j]));
        chunk[kept[j]] = sub_rn(v, sparse_level(code, m, value_bits));
      }
    }
  }
}

int64_t sparse_unpack_accumulate(float* out, const int64_t* offsets, const int64_t* entry_starts,
                                 const int64_t* byte_starts, int64_t chunks, const int16_t* indices,
                                 const void* values, const float* scales, int value_bits, float weight) {
  int64_t bad = 0;
  const bool parallel = entry_starts[chunks] >= kMinParallel / 16;
#pragma omp parallel for schedule(static) reduction(+ : bad) if (parallel)
  for (int64_t c = 0; c < chunks; ++c) {
    float* chunk = out + offsets[c];
    const int64_t len = offsets[c + 1] - offsets[c];
    const int64_t first = entry_starts[c], k = entry_starts[c + 1] - first;
    const uint8_t* bytes = static_cast<const uint8_t*>(values) + byte_starts[c];
    const float m = value_bits ? scales[c] : 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t i = static_cast<uint16_t>(indices[first + j]);
      if (i >= len) {
        ++bad;
        continue;
      }
      const float q = value_bits ? sparse_level(unpack_code(bytes, j, value_bits), m, value_bits)
                                 : static_cast<const float*>(values)[first + j];
      chunk[i] = add_rn(chunk[i], mul_rn(q, weight));  // the product rounded to fp32, then the sum
    }
  }
  return bad;
}

}  // namespace cpu
}  // namespace acco
