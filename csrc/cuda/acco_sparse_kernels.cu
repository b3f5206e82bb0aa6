// CUDA kernels of sparse outer communication (reference: acco_ds/ops/reference.py, sparse_pack and
// sparse_unpack_accumulate). Compiles with nvcc alone, as acco_cuda_kernels.cu (same flags: -fmad=false).
//
// sparse_pack_kernel: one thread block of 256 threads per chunk (chunks of up to 65536 elements), in passes
// over the chunk (it stays in L1/L2 between them):
//   1. radix select on the float bits u of |e|, 8 bits per pass from the top: a 256-bin shared histogram of
//      the elements that match the digits chosen so far, then warp 0 finds the digit holding the k-th
//      largest. After 4 passes T = the bits of the k-th largest |e| and `need` = how many of the elements
//      with u == T are kept (the rest of the k have u > T). The first pass also takes max u (m's bits:
//      the largest |e| is always kept).
//   2. in index order, tile by tile of 256 elements: kept = u > T, or u == T and fewer than `need` equal ones
//      came before (ties: lower index; a block-wide prefix sum counts them); a second prefix sum gives each
//      kept element its place in ascending index order. Its thread writes the index, the code (ORed into the
//      32-bit word that holds it: codes of neighbouring entries share bytes) and the residual e - q.
// Every float operation is the reference's, rounded on its own (acco_sparse.h), so the result is bit for bit
// the CPU reference's. sparse_unpack_kernel: one block per chunk, one thread per kept entry.
#include <algorithm>

#include "../acco_sparse.h"
#include "acco_cuda.h"

namespace acco {
namespace cuda {
namespace {

constexpr int kSparseThreads = 256;  // the scans below assume exactly this many threads per block
constexpr int kSparseWarps = kSparseThreads / 32;
constexpr unsigned kFull = 0xFFFFFFFFu;

// Exclusive prefix sum of x over the block (thread order); `total` gets the block's sum.
__device__ __forceinline__ int block_exclusive_scan(int x, int& total, int* warp_sums) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inclusive = x;
  for (int d = 1; d < 32; d *= 2) {
    const int y = __shfl_up_sync(kFull, inclusive, d);
    if (lane >= d) inclusive += y;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  int before = 0;
  total = 0;
  for (int w = 0; w < kSparseWarps; ++w) {
    const int s = warp_sums[w];
    before += w < warp ? s : 0;
    total += s;
  }
  __syncthreads();  // warp_sums is reused by the next scan
  return before + inclusive - x;
}

// The 32-bit word that holds byte `byte` of `values` (4-byte aligned, padded to whole words) gets code << bit.
__device__ __forceinline__ void or_code(uint8_t* values, int64_t byte, uint32_t code, int bit) {
  if (code == 0) return;
  unsigned int* word = reinterpret_cast<unsigned int*>(values + (byte & ~int64_t{3}));
  atomicOr(word, code << (bit + 8 * static_cast<int>(byte & 3)));
}

// table: rows offsets, entry_starts, byte_starts, chunks + 1 each (device memory).
template <int Bits>
__global__ void __launch_bounds__(kSparseThreads)
sparse_pack_kernel(float* __restrict__ e, const int64_t* __restrict__ table, int64_t chunks, int64_t topk,
                   int16_t* __restrict__ indices, void* __restrict__ values, float* __restrict__ scales) {
  __shared__ int hist[256];
  __shared__ int warp_sums[kSparseWarps];
  __shared__ uint32_t s_prefix, s_max;
  __shared__ int s_remaining;
  const int64_t* offsets = table;
  const int64_t* entry_starts = table + chunks + 1;
  const int64_t* byte_starts = table + 2 * (chunks + 1);
  const int tid = threadIdx.x, lane = tid % 32;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    float* chunk = e + offsets[c];
    const int len = static_cast<int>(offsets[c + 1] - offsets[c]);
    const int k = static_cast<int>(topk < len ? topk : len);
    if (k == 0) {
      if (Bits && tid == 0) scales[c] = 0.0f;
      continue;
    }
    // 1. radix select of the k-th largest u, 8 bits at a time.
    uint32_t prefix = 0, mask = 0;
    int remaining = k;  // how many of the elements matching `prefix` are still to be kept
    if (tid == 0) s_max = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = tid; b < 256; b += kSparseThreads) hist[b] = 0;
      __syncthreads();
      uint32_t local_max = 0;
      for (int i = tid; i < len; i += kSparseThreads) {
        const uint32_t u = magnitude_bits(chunk[i]);
        local_max = u > local_max ? u : local_max;
        if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 255u], 1);
      }
      if (shift == 24) atomicMax(&s_max, local_max);
      __syncthreads();
      if (tid < 32) {  // warp 0: the digit d with (count above d) < remaining <= (count at or above d)
        int above = 0;
        for (int group = 0; group < 8; ++group) {
          const int digit = 255 - 32 * group - lane;  // lane 0 holds the highest bin of the group
          const int count = hist[digit];
          int inclusive = count;
          for (int d = 1; d < 32; d *= 2) {
            const int y = __shfl_up_sync(kFull, inclusive, d);
            if (lane >= d) inclusive += y;
          }
          const int group_total = __shfl_sync(kFull, inclusive, 31);
          if (above + group_total >= remaining) {  // uniform over the warp
            const int l = __ffs(__ballot_sync(kFull, above + inclusive >= remaining)) - 1;
            const int at_l = __shfl_sync(kFull, inclusive, l), count_l = __shfl_sync(kFull, count, l);
            if (lane == 0) {
              s_prefix = prefix | (static_cast<uint32_t>(255 - 32 * group - l) << shift);
              s_remaining = remaining - (above + at_l - count_l);
            }
            break;
          }
          above += group_total;
        }
      }
      __syncthreads();
      prefix = s_prefix;
      remaining = s_remaining;
      mask |= 255u << shift;
    }
    const uint32_t threshold = prefix;
    const int need = remaining;  // elements with u == threshold to keep, lowest index first
    const float m = bits_to_float(s_max);
    if (Bits && tid == 0) scales[c] = m;
    // 2. in index order: which are kept, their places, the payload and the residual.
    int16_t* idx_out = indices + entry_starts[c];
    int eq_seen = 0, kept_seen = 0;
    for (int base = 0; base < len && kept_seen < k; base += kSparseThreads) {  // kept_seen: uniform
      const int i = base + tid;
      const uint32_t u = i < len ? magnitude_bits(chunk[i]) : 0u;
      const int is_eq = i < len && u == threshold, is_gt = i < len && u > threshold;
      int eq_total, kept_total;
      const int eq_before = eq_seen + block_exclusive_scan(is_eq, eq_total, warp_sums);
      const int keep = is_gt || (is_eq && eq_before < need);
      const int j = kept_seen + block_exclusive_scan(keep, kept_total, warp_sums);  // entry number in the chunk
      if (keep) {
        const float v = chunk[i];
        idx_out[j] = static_cast<int16_t>(static_cast<uint16_t>(i));
        if constexpr (Bits == 0) {
          static_cast<float*>(values)[entry_starts[c] + j] = v;
          chunk[i] = sub_rn(v, v);  // q = v: the residual is v - v, as the reference computes it
        } else {
          const uint32_t code = sparse_code(v, m, Bits);
          const int bit = j * Bits;
          or_code(static_cast<uint8_t*>(values), byte_starts[c] + bit / 8, code, bit % 8);
          chunk[i] = sub_rn(v, sparse_level(code, m, Bits));
        }
      }
      eq_seen += eq_total;
      kept_seen += kept_total;
    }
    __syncthreads();  // s_max, s_prefix and hist are reset for the next chunk of this block
  }
}

// out[offset + index] += q * weight for each kept entry. An index past its chunk's end (a payload that does not
// belong to these offsets) is skipped here; the CPU op raises on it.
template <int Bits>
__global__ void sparse_unpack_kernel(float* __restrict__ out, const int64_t* __restrict__ table, int64_t chunks,
                                     const int16_t* __restrict__ indices, const void* __restrict__ values,
                                     const float* __restrict__ scales, float weight) {
  const int64_t* offsets = table;
  const int64_t* entry_starts = table + chunks + 1;
  const int64_t* byte_starts = table + 2 * (chunks + 1);
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t len = offsets[c + 1] - offsets[c], first = entry_starts[c], k = entry_starts[c + 1] - first;
    float* chunk = out + offsets[c];
    const float m = Bits ? scales[c] : 0.0f;
    const uint8_t* bytes = static_cast<const uint8_t*>(values) + byte_starts[c];
    for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
      const int64_t i = static_cast<uint16_t>(indices[first + j]);
      if (i >= len) continue;
      float q;
      if constexpr (Bits == 0) {
        q = static_cast<const float*>(values)[first + j];
      } else {
        q = sparse_level(unpack_code(bytes, j, Bits), m, Bits);
      }
      chunk[i] = add_rn(chunk[i], mul_rn(q, weight));  // the product rounded to fp32, then the sum
    }
  }
}

unsigned sparse_grid(int64_t chunks) { return static_cast<unsigned>(std::min<int64_t>(chunks, int64_t{1} << 20)); }

}  // namespace

void sparse_pack(float* e, const int64_t* table, int64_t chunks, int64_t topk, int value_bits, int16_t* indices,
                 void* values, float* scales, cudaStream_t stream) {
  if (chunks == 0) return;
  const unsigned grid = sparse_grid(chunks);
  switch (value_bits) {
    case 0: return sparse_pack_kernel<0><<<grid, kSparseThreads, 0, stream>>>(e, table, chunks, topk, indices,
                                                                                values, scales);
    case 2: return sparse_pack_kernel<2><<<grid, kSparseThreads, 0, stream>>>(e, table, chunks, topk, indices,
                                                                                values, scales);
    case 4: return sparse_pack_kernel<4><<<grid, kSparseThreads, 0, stream>>>(e, table, chunks, topk, indices,
                                                                                values, scales);
    default: return sparse_pack_kernel<8><<<grid, kSparseThreads, 0, stream>>>(e, table, chunks, topk, indices,
                                                                                 values, scales);
  }
}

void sparse_unpack_accumulate(float* out, const int64_t* table, int64_t chunks, const int16_t* indices,
                              const void* values, const float* scales, int value_bits, float weight,
                              cudaStream_t stream) {
  if (chunks == 0) return;
  const unsigned grid = sparse_grid(chunks);
  constexpr int threads = 128;
  switch (value_bits) {
    case 0: return sparse_unpack_kernel<0><<<grid, threads, 0, stream>>>(out, table, chunks, indices, values, scales,
                                                                           weight);
    case 2: return sparse_unpack_kernel<2><<<grid, threads, 0, stream>>>(out, table, chunks, indices, values, scales,
                                                                           weight);
    case 4: return sparse_unpack_kernel<4><<<grid, threads, 0, stream>>>(out, table, chunks, indices, values, scales,
                                                                           weight);
    default: return sparse_unpack_kernel<8><<<grid, threads, 0, stream>>>(out, table, chunks, indices, values,
                                                                            scales, weight);
  }
}

}  // namespace cuda
}  // namespace acco
