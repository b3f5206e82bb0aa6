// CPU kernels of sparse outer communication: chunked top-k + quantize + pack + error-feedback residual in one
// pass per chunk, and unpack + accumulate. Parallel over chunks (OpenMP, one region per call).
//
// Selection per chunk (key: acco_sparse.h, |e| bits then the lower index): see select_chunk. Then the kept
// indices are sorted ascending and quantized in that order.
#include <algorithm>
#include <cstring>
#include <vector>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "../acco_sparse.h"
#include "acco_cpu.h"

namespace acco {
namespace cpu {
namespace {

constexpr int64_t kMinParallel = 1 << 15;  // elements; below this a parallel region costs more than it saves
constexpr int64_t kMinStream = 1 << 22;    // elements (16 MB): a smaller average stays in cache for its reader
constexpr int64_t kGroup = 16;              // elements per group of the selection's first read

struct Scratch {  // per thread, reused from chunk to chunk
  std::vector<uint32_t> group_max, order;
  std::vector<uint64_t> keys;
};

// The in-chunk indices of the k largest keys of e[0..len) (0 < k <= len), ascending, into `kept`; returns
// max |e| over them. Two reads of the chunk:
//   1. the max |e| bits of each group of 16 (vectorized), and `floor`, the k-th largest of those maxima:
//      they are k different elements, so at least k elements have bits >= floor and no element below it can
//      be kept. (On gradient-like data, chunk 4096 and k 64, floor sits near the 98th percentile.)
//   2. the groups whose max reaches the floor are scanned; their elements at or above it become candidate
//      keys (appended without a branch), and std::nth_element keeps the k largest. Keys are unique (they hold
//      the index), so these are exactly the contract's, ties included. Linear time whatever the data.
float select_chunk(const float* e, int64_t len, int64_t k, Scratch& s, std::vector<int32_t>& kept) {
  kept.resize(k);
  uint32_t max_bits = 0;
  if (k == len) {  // everything is kept: no selection
    for (int64_t i = 0; i < len; ++i) {
      kept[i] = static_cast<int32_t>(i);
      max_bits = std::max(max_bits, magnitude_bits(e[i]));
    }
    return bits_to_float(max_bits);
  }
  const int64_t groups = (len + kGroup - 1) / kGroup;
  s.group_max.resize(groups);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t lo = g * kGroup, hi = std::min(len, lo + kGroup);
    uint32_t m = 0;
#pragma omp simd reduction(max : m)
    for (int64_t i = lo; i < hi; ++i) m = std::max(m, magnitude_bits(e[i]));
    s.group_max[g] = m;
  }
  uint32_t floor = 0;
  if (k <= groups) {
    s.order.assign(s.group_max.begin(), s.group_max.end());
    std::nth_element(s.order.begin(), s.order.begin() + (k - 1), s.order.end(), std::greater<uint32_t>());
    floor = s.order[k - 1];
  }
  s.keys.resize(len);
  int64_t n = 0;
  for (int64_t g = 0; g < groups; ++g) {
    if (s.group_max[g] < floor) continue;
    const int64_t lo = g * kGroup, hi = std::min(len, lo + kGroup);
    for (int64_t i = lo; i < hi; ++i) {
      s.keys[n] = selection_key(e[i], i);
      n += magnitude_bits(e[i]) >= floor ? 1 : 0;
    }
  }
  if (n > k) std::nth_element(s.keys.begin(), s.keys.begin() + (k - 1), s.keys.begin() + n, std::greater<uint64_t>());
  for (int64_t j = 0; j < k; ++j) {
    kept[j] = 65535 - static_cast<int32_t>(s.keys[j] & 0xFFFFu);
    max_bits = std::max(max_bits, static_cast<uint32_t>(s.keys[j] >> 16));
  }
  std::sort(kept.begin(), kept.end());
  return bits_to_float(max_bits);
}

// out[i] += q_j * weight for one replica's entries of chunk c (out: that chunk's first element). Returns how
// many indices point past the chunk (not applied).
int64_t accumulate_chunk(float* chunk, int64_t len, int64_t c, const int64_t* entry_starts,
                         const int64_t* byte_starts, const int16_t* indices, const void* values,
                         const float* scales, int value_bits, float weight) {
  const int64_t first = entry_starts[c], k = entry_starts[c + 1] - first;
  const uint8_t* bytes = static_cast<const uint8_t*>(values) + byte_starts[c];
  const float m = value_bits ? scales[c] : 0.0f;
  // The chunk's 2^b levels, each computed once by sparse_level (so bit for bit the same values), when the
  // chunk has more entries than levels: one table lookup per entry instead of a division.
  float levels[256];
  const bool table = value_bits && (int64_t{1} << value_bits) <= k;
  if (table) {
    for (uint32_t code = 0; code < (1u << value_bits); ++code) levels[code] = sparse_level(code, m, value_bits);
  }
  int64_t bad = 0;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t i = static_cast<uint16_t>(indices[first + j]);
    if (i >= len) {
      ++bad;
      continue;
    }
    const float q = !value_bits ? static_cast<const float*>(values)[first + j]
                    : table     ? levels[unpack_code(bytes, j, value_bits)]
                                : sparse_level(unpack_code(bytes, j, value_bits), m, value_bits);
    chunk[i] = add_rn(chunk[i], mul_rn(q, weight));  // the product rounded to fp32, then the sum
  }
  return bad;
}

// f(i) for each in-chunk index i of chunk c kept by a replica of nonzero weight (valid indices only).
template <typename F>
void for_each_kept(int64_t c, int64_t len, const int64_t* entry_starts, const int16_t* const* indices,
                   const float* weights, int64_t replicas, F f) {
  for (int64_t r = 0; r < replicas; ++r) {
    if (weights[r] == 0.0f) continue;
    for (int64_t j = entry_starts[c]; j < entry_starts[c + 1]; ++j) {
      const int64_t i = static_cast<uint16_t>(indices[r][j]);
      if (i < len) f(i);
    }
  }
}

// dst[0..n) = src[0..n); with `stream`, non-temporal stores where aligned: a large out is written once and not
// read again here, so its lines need not be read into the cache first.
void store(float* dst, const float* src, int64_t n, bool stream) {
  int64_t i = 0;
#if defined(__SSE2__)
  if (stream) {
    for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & 15u); ++i) dst[i] = src[i];
    for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
  }
#endif
  std::memcpy(dst + i, src + i, sizeof(float) * (n - i));
}

}  // namespace

void sparse_pack(float* e, const int64_t* offsets, const int64_t* entry_starts, const int64_t* byte_starts,
                 int64_t chunks, int64_t topk, int value_bits, int16_t* indices, void* values, float* scales) {
  const bool parallel = offsets[chunks] - offsets[0] >= kMinParallel;
#pragma omp parallel if (parallel)
  {
    Scratch scratch;
    std::vector<int32_t> kept;
#pragma omp for schedule(dynamic, 16)
    for (int64_t c = 0; c < chunks; ++c) {
      float* chunk = e + offsets[c];
      const int64_t len = offsets[c + 1] - offsets[c];
      const int64_t k = std::min(topk, len);
      const float m = k > 0 ? select_chunk(chunk, len, k, scratch, kept) : 0.0f;
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
    bad += accumulate_chunk(out + offsets[c], offsets[c + 1] - offsets[c], c, entry_starts, byte_starts, indices,
                            values, scales, value_bits, weight);
  }
  return bad;
}

int64_t sparse_average(float* out, int64_t numel, const int64_t* offsets, const int64_t* entry_starts,
                       const int64_t* byte_starts, int64_t chunks, int64_t replicas, const int16_t* const* indices,
                       const void* const* values, const float* const* scales, int value_bits, const float* weights,
                       float total) {
  // Outside the chunks nothing was kept: zeros, as the reference's out.zero_() leaves them.
  std::memset(out, 0, sizeof(float) * offsets[0]);
  std::memset(out + offsets[chunks], 0, sizeof(float) * (numel - offsets[chunks]));
  int64_t bad = 0;
  const bool parallel = offsets[chunks] - offsets[0] >= kMinParallel;
  const bool stream = offsets[chunks] - offsets[0] >= kMinStream;
#pragma omp parallel if (parallel) reduction(+ : bad)
  {
    // One chunk at a time in a scratch buffer that stays in cache: zero, every replica's entries in replica
    // order (so each element's sum rounds as the reference's unpack after unpack), the division, then one
    // write to out (streaming when out is large). The reference instead makes 1 + R + 1 passes over out.
    std::vector<float> sum;
    std::vector<uint8_t> divided;  // all 0 between chunks
#pragma omp for schedule(static) nowait
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t len = offsets[c + 1] - offsets[c];
      sum.assign(len, 0.0f);
      if (static_cast<int64_t>(divided.size()) < len) divided.resize(len, 0);
      for (int64_t r = 0; r < replicas; ++r) {
        if (weights[r] == 0.0f) continue;  // a replica that adds nothing (it just joined)
        bad += accumulate_chunk(sum.data(), len, c, entry_starts, byte_starts, indices[r], values[r],
                                value_bits ? scales[r] : nullptr, value_bits, weights[r]);
      }
      if (total > 0.0f) {  // only the kept entries: the others are +0, and +0 / total is +0
        for_each_kept(c, len, entry_starts, indices, weights, replicas, [&](int64_t i) {
          if (!divided[i]) sum[i] = div_rn(sum[i], total);
          divided[i] = 1;
        });
        for_each_kept(c, len, entry_starts, indices, weights, replicas, [&](int64_t i) { divided[i] = 0; });
      }
      store(out + offsets[c], sum.data(), len, stream);
    }
#if defined(__SSE2__)
    // Each thread orders its own streaming stores before the region's closing barrier, so they are visible
    // to the caller (and to other threads) when the region ends.
    if (stream) _mm_sfence();
#endif
  }
  return bad;
}

}  // namespace cpu
}  // namespace acco
