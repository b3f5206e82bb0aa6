// CPU kernels of acco_ds (csrc/cpu/acco_cpu.cpp). No torch headers.
#pragma once


#include "../acco_common.h"

namespace acco {
namespace cpu {

// One pass over a flat fp32 shard: Adam(W) update of (master, m, v) from grad,
// the new parameters cast to out_dtype into `out` (may be null, out_dtype -1).
// commit == false ("peek") writes only `out`; master, m and v stay untouched.
void adam_update(float* master, const float* grad, float* m, float* v, void* out, int out_dtype, int64_t n,
                 const AdamScalars& s, bool commit);

// Block quantization of compressed communication (reference: acco_ds/ops/reference.py quantize_pack).
// v = x (+ residual); per block of `block` values one fp32 scale max|v|/qmax (NaN, with values 0, for a
// block holding a non-finite value) and one wire byte per value; residual (if not null) <- v - sent.
// x_dtype, residual_dtype (-1: none): DType codes; q_type: QType.
void quantize_pack(const void* x, int x_dtype, void* residual, int residual_dtype, uint8_t* q, int q_type,
                   float* scales, int64_t n, int64_t block);

// out = out + q * scale, per block, rounded to out's dtype (the product rounded to float first).
void dequantize_accumulate(const uint8_t* q, int q_type, const float* scales, void* out, int out_dtype, int64_t n,
                           int64_t block);

}  // namespace cpu
}  // namespace acco

namespace acco {
namespace cpu {

// Sparse outer communication (reference: acco_ds/ops/reference.py sparse_pack, sparse_unpack_accumulate).
// Chunk c is e[offsets[c], offsets[c+1]); entry_starts / byte_starts (chunks + 1 each) place its kept entries
// in `indices` and its codes in `values` (reference.sparse_layout). value_bits 2/4/8: `values` is uint8 and
// must be zeroed (codes are ORed in), `scales` one fp32 per chunk; 0: `values` is fp32, `scales` unused.
// e[kept] -= q in place.
void sparse_pack(float* e, const int64_t* offsets, const int64_t* entry_starts, const int64_t* byte_starts,
                 int64_t chunks, int64_t topk, int value_bits, int16_t* indices, void* values, float* scales);

// out[kept] += q * weight. Returns the number of indices outside their chunk (those are not applied).
int64_t sparse_unpack_accumulate(float* out, const int64_t* offsets, const int64_t* entry_starts,
                                 const int64_t* byte_starts, int64_t chunks, const int16_t* indices,
                                 const void* values, const float* scales, int value_bits, float weight);

// out = (sum over r of q_r * weights[r], in replica order) / total, written whole (zeros where no replica kept
// anything; no division when total <= 0): reference.sparse_average for R payloads in one pass over out.
// Returns the number of indices outside their chunk (those are not applied).
int64_t sparse_average(float* out, int64_t numel, const int64_t* offsets, const int64_t* entry_starts,
                       const int64_t* byte_starts, int64_t chunks, int64_t replicas, const int16_t* const* indices,
                       const void* const* values, const float* const* scales, int value_bits, const float* weights,
                       float total);

}  // namespace cpu
}  // namespace acco
