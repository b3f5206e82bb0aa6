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
