// CPU kernels of acco_ds: one OpenMP parallel region per call, inner loops
// specialised per dtype so that they vectorize (build with -fno-math-errno so
// that sqrtf does too, and -ffp-contract=off to keep torch's rounding).
#include "acco_cpu.h"

#include <algorithm>
#include <cmath>

namespace acco {
namespace cpu {
namespace {

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kMinParallel = 1 << 15;

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

// ----------------------------------------------------------- block quantization
// Parallel over blocks; each block is read twice (max, then quantize) rather than staged, so a block of
// any size needs no scratch memory (a block of 256 fp32 values is still in L1 on the second read).
template <int XD, int RD, int QT>
void quantize_blocks(const void* __restrict x, void* __restrict residual, uint8_t* __restrict q,
                     float* __restrict scales, int64_t n, int64_t block) {
  const int64_t nb = n == 0 ? 0 : (n - 1) / block + 1;
#pragma omp parallel for schedule(static) if (n >= kMinParallel)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * block, hi = lo + std::min(block, n - lo);
    float amax = 0.0f;
    int bad = 0;  // a NaN or an infinity: !(|v| <= FLT_MAX). The max alone would skip NaN (maxps, std::max).
#pragma omp simd reduction(max : amax) reduction(| : bad)
    for (int64_t i = lo; i < hi; ++i) {
      const float a = std::fabs(load_v<XD, RD>(x, residual, i));
      bad |= !(a <= 3.402823466e38f);
      amax = std::max(amax, a);
    }
    const float s = block_scale<QT>(amax, !bad);
    scales[b] = s;
    if (bad || s == 0.0f) {
      // Values 0 (the reference divides by 1 there, times 0). The residual becomes v - 0 * s: v for a
      // zero scale (an all-zero block, or max |v| so small that max/qmax underflows), NaN for a NaN scale.
      for (int64_t i = lo; i < hi; ++i) {
        q[i] = 0;
        if constexpr (RD >= 0) {
          store_cast<RD>(residual, i, sub_rn(load_v<XD, RD>(x, residual, i), mul_rn(0.0f, s)));
        }
      }
      continue;
    }
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) {
      const float v = load_v<XD, RD>(x, residual, i);
      float sent;
      q[i] = quantize_value<QT>(v, s, sent);
      if constexpr (RD >= 0) store_cast<RD>(residual, i, sub_rn(v, sent));
    }
  }
}

template <int XD, int RD>
void quantize_q(const void* x, void* r, uint8_t* q, int q_type, float* scales, int64_t n, int64_t block) {
  if (q_type == kInt8) {
    quantize_blocks<XD, RD, kInt8>(x, r, q, scales, n, block);
  } else {
    quantize_blocks<XD, RD, kFp8E4M3>(x, r, q, scales, n, block);
  }
}

template <int XD>
void quantize_r(const void* x, void* r, int r_dtype, uint8_t* q, int q_type, float* scales, int64_t n,
                int64_t block) {
  switch (r_dtype) {
    case kFloat32: return quantize_q<XD, kFloat32>(x, r, q, q_type, scales, n, block);
    case kBFloat16: return quantize_q<XD, kBFloat16>(x, r, q, q_type, scales, n, block);
    default: return quantize_q<XD, -1>(x, r, q, q_type, scales, n, block);
  }
}

template <int QT, int OD>
void dequantize_blocks(const uint8_t* __restrict q, const float* __restrict scales, void* __restrict out, int64_t n,
                       int64_t block) {
  const int64_t nb = n == 0 ? 0 : (n - 1) / block + 1;
#pragma omp parallel for schedule(static) if (n >= kMinParallel)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * block, hi = lo + std::min(block, n - lo);
    const float s = scales[b];
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) {
      store_cast<OD>(out, i, dequantize_add<QT>(load_as_float<OD>(out, i), q[i], s));
    }
  }
}

template <int QT>
void dequantize_o(const uint8_t* q, const float* scales, void* out, int out_dtype, int64_t n, int64_t block) {
  switch (out_dtype) {
    case kFloat32: return dequantize_blocks<QT, kFloat32>(q, scales, out, n, block);
    case kBFloat16: return dequantize_blocks<QT, kBFloat16>(q, scales, out, n, block);
    default: return dequantize_blocks<QT, kFloat16>(q, scales, out, n, block);
  }
}

}  // namespace

void quantize_pack(const void* x, int x_dtype, void* residual, int residual_dtype, uint8_t* q, int q_type,
                   float* scales, int64_t n, int64_t block) {
  switch (x_dtype) {
    case kFloat32: return quantize_r<kFloat32>(x, residual, residual_dtype, q, q_type, scales, n, block);
    case kBFloat16: return quantize_r<kBFloat16>(x, residual, residual_dtype, q, q_type, scales, n, block);
    default: return quantize_r<kFloat16>(x, residual, residual_dtype, q, q_type, scales, n, block);
  }
}

void dequantize_accumulate(const uint8_t* q, int q_type, const float* scales, void* out, int out_dtype, int64_t n,
                           int64_t block) {
  if (q_type == kInt8) {
    dequantize_o<kInt8>(q, scales, out, out_dtype, n, block);
  } else {
    dequantize_o<kFp8E4M3>(q, scales, out, out_dtype, n, block);
  }
}

void adam_update(float* master, const float* grad, float* m, float* v, void* out, int out_dtype, int64_t n,
                 const AdamScalars& s, bool commit) {
  if (commit) {
    adam_dispatch<true>(master, grad, m, v, out, out_dtype, n, s);
  } else {
    adam_dispatch<false>(master, grad, m, v, out, out_dtype, n, s);
  }
}

}  // namespace cpu
}  // namespace acco
