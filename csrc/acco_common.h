// Shared by the CPU and CUDA kernels of acco_ds: dtype codes, the AdamW
// element update, and exact float <-> bf16/fp16 conversions. Plain C++ (no
// torch headers) so that nvcc and g++ can compile the kernels on their own.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ACCO_HD __host__ __device__ __forceinline__
#else
#define ACCO_HD inline
#endif

namespace acco {

// Element types of tensors crossing the kernel boundary.
enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Scalars of one AdamW step, prepared on the host in double precision exactly
// as torch.optim.Adam(W) prepares them, then rounded to float once.
struct AdamScalars {
  float grad_scale;     // 1/global_count * clip coefficient * 1/loss_scale
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float weight_decay;   // L2 term (adamw == false)
  float decay_factor;   // 1 - lr * weight_decay (adamw == true)
  float bias_correction2_sqrt;
  float neg_step_size;  // -lr / (1 - beta1^step)
  int adamw;
  int lerp_low;         // |1 - beta1| < 0.5: torch's lerp takes its first branch
};

ACCO_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

ACCO_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

// bf16: round to nearest even, NaN -> quiet NaN (as c10::BFloat16).
ACCO_HD uint16_t float_to_bf16_bits(float f) {
  if (f != f) return 0x7FC0;
  uint32_t u = float_to_bits(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

ACCO_HD float bf16_bits_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// IEEE fp16 conversions without hardware support, bit-exact with c10::Half
// (fp16_ieee_from_fp32_value / fp16_ieee_to_fp32_value).
ACCO_HD uint16_t float_to_f16_bits(float f) {
  const float scale_to_inf = bits_to_float(0x77800000u);   // 2^112
  const float scale_to_zero = bits_to_float(0x08800000u);  // 2^-110
  float base = (fabsf(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = float_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_to_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

ACCO_HD float f16_bits_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float exp_scale = bits_to_float(0x07800000u);  // 2^-112
  const float normalized = bits_to_float((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = 126u << 23;
  const float denormalized = bits_to_float((two_w >> 17) | magic_mask) - 0.5f;
  const uint32_t cutoff = 1u << 27;
  return bits_to_float(sign | (two_w < cutoff ? float_to_bits(denormalized) : float_to_bits(normalized)));
}

ACCO_HD float load_as_float(const void* p, int64_t i, int dtype) {
  if (dtype == kFloat32) return static_cast<const float*>(p)[i];
  uint16_t h = static_cast<const uint16_t*>(p)[i];
  return dtype == kBFloat16 ? bf16_bits_to_float(h) : f16_bits_to_float(h);
}

ACCO_HD void store_from_float(void* p, int64_t i, int dtype, float v) {
  if (dtype == kFloat32) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<uint16_t*>(p)[i] = dtype == kBFloat16 ? float_to_bf16_bits(v) : float_to_f16_bits(v);
  }
}

// One element of torch.optim.Adam(W)'s single-tensor step, with torch's order
// of float operations (fused lerp, mul + addcmul, sqrt / c + eps, addcdiv).
ACCO_HD void adam_element(float& p, float g, float& m, float& v, const AdamScalars& s) {
  g = g * s.grad_scale;
  if (s.adamw) {
    p = p * s.decay_factor;
  } else if (s.weight_decay != 0.0f) {
    g = fmaf(s.weight_decay, p, g);  // grad.add(param, alpha=wd), fused as in torch
  }
  // torch's vectorized lerp is fused: fma(w, g - m, m), or fma(w - 1, g - m, g) for w >= 0.5.
  const float w = s.one_minus_beta1;
  m = s.lerp_low ? fmaf(w, g - m, m) : fmaf(w - 1.0f, g - m, g);
  v = v * s.beta2;
  v = fmaf(s.one_minus_beta2 * g, g, v);  // torch's vectorized addcmul is fused
  const float denom = sqrtf(v) / s.bias_correction2_sqrt + s.eps;
  p = p + (s.neg_step_size * m) / denom;  // torch's addcdiv: self + (value * t1) / t2
}

// Host-side preparation of the scalars, in the order torch computes them.
inline AdamScalars make_adam_scalars(int64_t step, double lr, double beta1, double beta2, double eps,
                                     double weight_decay, double grad_scale, bool adamw) {
  AdamScalars s;
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  s.grad_scale = static_cast<float>(grad_scale);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(eps);
  s.weight_decay = static_cast<float>(weight_decay);
  s.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  s.bias_correction2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
  s.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  s.adamw = adamw ? 1 : 0;
  s.lerp_low = std::fabs(1.0 - beta1) < 0.5 ? 1 : 0;
  return s;
}

// A tensor to pack into (or unpack from) a flat fp32 buffer.
struct FlatItem {
  void* data;
  int64_t numel;
  int64_t offset;  // in elements of the flat buffer
  int dtype;
};

}  // namespace acco
