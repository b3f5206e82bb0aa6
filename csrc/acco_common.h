// Shared by the CPU and CUDA kernels of acco_ds: dtype codes, the AdamW
// element update, and float <-> bf16/fp16 conversions that round like torch.
// Plain C++ (no torch headers) so that g++ and nvcc compile the kernels alone.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define ACCO_HD __host__ __device__ __forceinline__
#else
#define ACCO_HD inline
#endif

namespace acco {

// Element types of tensors crossing the kernel boundary.
enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Scalars of one Adam(W) step, computed on the host in double precision as
// torch.optim.Adam(W) computes them (Python floats), then rounded to float
// once, as torch's CPU/CUDA kernels round their scalar arguments.
struct AdamScalars {
  float grad_scale;             // 1/global_count * clip coefficient * 1/loss_scale
  float decay_factor;           // AdamW: 1 - lr*wd; otherwise 1 (a multiply by 1 is exact)
  float l2;                     // Adam with weight decay: wd; otherwise unused
  float lerp_weight;            // 1 - beta1, or (1 - beta1) - 1 on torch's second lerp branch
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float inv_bias_correction2_sqrt;  // 1 / that, in float (the CUDA path)
  float eps;
  float neg_step_size;          // -lr / (1 - beta1^step)
  int use_l2;                   // !adamw && wd != 0 (torch skips the add when wd == 0)
  int lerp_from_start;          // |1 - beta1| < 0.5: torch's lerp starts from m, else from g
};

inline AdamScalars make_adam_scalars(int64_t step, double lr, double beta1, double beta2, double eps,
                                     double weight_decay, double grad_scale, bool adamw) {
  // Same expressions as torch/optim/adam.py (_single_tensor_adam, capturable=False).
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const float weight = static_cast<float>(1.0 - beta1);
  AdamScalars s;
  s.grad_scale = static_cast<float>(grad_scale);
  s.decay_factor = (adamw && weight_decay != 0.0) ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  s.l2 = static_cast<float>(weight_decay);
  s.use_l2 = (!adamw && weight_decay != 0.0) ? 1 : 0;
  s.lerp_from_start = std::fabs(weight) < 0.5f ? 1 : 0;
  s.lerp_weight = s.lerp_from_start ? weight : weight - 1.0f;
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.bias_correction2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
  s.inv_bias_correction2_sqrt = 1.0f / s.bias_correction2_sqrt;
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  return s;
}

// One element of torch.optim.Adam(W)'s step, in torch's order of float
// operations. Branch-free (uniform selects) so that the CPU loop vectorizes.
// Compile with FMA contraction off (-ffp-contract=off): the fmaf calls below
// are exactly the fused operations torch's kernels perform, no others.
ACCO_HD void adam_element(float& p, float g, float& m, float& v, const AdamScalars& s) {
  g = g * s.grad_scale;
  p = p * s.decay_factor;                     // param.mul_(1 - lr * wd)
  g = s.use_l2 ? fmaf(s.l2, p, g) : g;        // grad.add(param, alpha=wd)
  // exp_avg.lerp_(g, w): fma(w, g - m, m) if |w| < 0.5 else fma(w - 1, g - m, g)
  m = fmaf(s.lerp_weight, g - m, s.lerp_from_start ? m : g);
  v = fmaf(s.one_minus_beta2 * g, g, v * s.beta2);  // exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
#if defined(__CUDA_ARCH__)
  // torch's CUDA kernels divide by a CPU scalar as a multiply by its float reciprocal,
  // and compute addcdiv as a + alpha * (b / c), contracted to one fma.
  const float denom = sqrtf(v) * s.inv_bias_correction2_sqrt + s.eps;
  p = fmaf(s.neg_step_size, m / denom, p);
#else
  // torch's CPU kernels: a true division, and addcdiv as a + (alpha * b) / c.
  const float denom = sqrtf(v) / s.bias_correction2_sqrt + s.eps;
  p = p + (s.neg_step_size * m) / denom;
#endif
}

// ---------------------------------------------------------------- conversions
// Host versions are bit-exact with c10::BFloat16 / c10::Half (round to nearest
// even); device versions are the CUDA intrinsics torch itself uses.

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

ACCO_HD uint16_t float_to_bf16_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  const uint32_t u = float_to_bits(f);
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return f != f ? static_cast<uint16_t>(0x7FC0) : rounded;
#endif
}

ACCO_HD float bf16_bits_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

ACCO_HD uint16_t float_to_f16_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  // fp16_ieee_from_fp32_value (c10/util/Half.h), with selects instead of branches.
  const float scale_to_inf = bits_to_float(0x77800000u);   // 2^112
  const float scale_to_zero = bits_to_float(0x08800000u);  // 2^-110
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = float_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = bits_to_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}

ACCO_HD float f16_bits_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  // fp16_ieee_to_fp32_value (c10/util/Half.h).
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bits_to_float((two_w >> 4) + (0xE0u << 23)) * bits_to_float(0x07800000u);
  const float denormalized = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t cutoff = 1u << 27;
  return bits_to_float(sign | (two_w < cutoff ? float_to_bits(denormalized) : float_to_bits(normalized)));
#endif
}

// Typed element store; DType is a template argument so that every loop is
// specialised for one element type.
template <int DType>
ACCO_HD void store_from_float(void* p, int64_t i, float x) {
  if constexpr (DType == kFloat32) {
    static_cast<float*>(p)[i] = x;
  } else {
    static_cast<uint16_t*>(p)[i] = DType == kBFloat16 ? float_to_bf16_bits(x) : float_to_f16_bits(x);
  }
}

// ---------------------------------------------------------------- block quantization
// Wire values of compressed communication (acco_ds/ops/reference.py: quantize_pack, dequantize_accumulate).
enum QType : int { kInt8 = 0, kFp8E4M3 = 1 };

template <int QType>
ACCO_HD float qmax() {
  return QType == kInt8 ? 127.0f : 448.0f;
}

// Single float operations, each rounded on its own: on the device the _rn intrinsics, which nvcc never
// contracts into an fma (whatever -fmad says); on the host -ffp-contract=off does the same.
ACCO_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

ACCO_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

ACCO_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

ACCO_HD float div_rn(float a, float b) {  // IEEE division, as torch's `/` (never a * (1/b))
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// float8_e4m3fn bits -> float (exact: every e4m3 value is a float). 0x7F/0xFF are NaN; no infinities.
// Selects, not branches, so the loop vectorizes.
ACCO_HD float fp8_e4m3_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24;
  const uint32_t e = (b >> 3) & 0xFu, m = b & 7u;
  const float normal = bits_to_float(sign | ((e + 120u) << 23) | (m << 20));          // (1 + m/8) 2^(e-7)
  // Subnormal m 2^-9 = (1 + m/8) 2^-6 - 2^-6, exact (no int -> float conversion: the loop vectorizes).
  const float sub_abs = sub_rn(bits_to_float((121u << 23) | (m << 20)), 0.015625f);
  const float sub = bits_to_float(sign | float_to_bits(sub_abs));
  const float value = e == 0 ? sub : normal;
  return (b & 0x7F) == 0x7F ? bits_to_float(sign | 0x7FC00000u) : value;
}

// float -> float8_e4m3fn bits, round to nearest even: c10::Float8_e4m3fn's conversion (fp8e4m3fn_from_fp32_value),
// both of its paths computed and one selected, so the loop vectorizes. Callers clamp to +-448 (480 and above
// would give NaN).
ACCO_HD uint8_t float_to_fp8_e4m3(float y) {
  const uint32_t bits = float_to_bits(y);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t f_bits = bits ^ sign;
  // Below 2^-6: a subnormal, rounded by a float addition (in 2^14 + |y| the ulp is 2^-9, e4m3's step there).
  const uint32_t denorm_mask = 141u << 23;
  const uint32_t sub = float_to_bits(add_rn(bits_to_float(f_bits), bits_to_float(denorm_mask))) - denorm_mask;
  // Normal: rebias the exponent, round the mantissa to 3 bits, ties to even.
  const uint32_t normal = (f_bits + ((7u - 127u) << 23) + 0x7FFFFu + ((f_bits >> 20) & 1u)) >> 20;
  uint32_t result = f_bits < (121u << 23) ? sub : normal;
  result = f_bits >= (1087u << 20) ? 0x7Fu : result;  // 480 and above, NaN
  return static_cast<uint8_t>(result | (sign >> 24));
}

// Typed element loads (DType: kFloat32, kBFloat16, kFloat16; -1: none, reads 0).
template <int DType>
ACCO_HD float load_as_float(const void* p, int64_t i) {
  if constexpr (DType == kFloat32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (DType == kBFloat16) {
    return bf16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
  } else if constexpr (DType == kFloat16) {
    return f16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
  } else {
    return 0.0f;
  }
}

// The value a quantized send carries: x, plus the residual when there is one (x alone keeps -0.0).
template <int XD, int RD>
ACCO_HD float load_v(const void* x, const void* residual, int64_t i) {
  if constexpr (RD >= 0) {
    return add_rn(load_as_float<XD>(x, i), load_as_float<RD>(residual, i));
  } else {
    return load_as_float<XD>(x, i);
  }
}

// A block's scale: max |v| / qmax, or NaN when the block holds a NaN or an infinity (`finite` false).
template <int QType>
ACCO_HD float block_scale(float amax, bool finite) {
  return finite ? div_rn(amax, qmax<QType>()) : bits_to_float(0x7FC00000u);
}

// One value of a block with scale s (finite, > 0): v / s clamped to +-qmax, then rounded to nearest even
// (int8) or to the nearest e4m3 value (fp8); returns the wire byte and, in `sent`, the value the receiver
// gets: the wire value read back as a float, times s (the reference's residual is v - q.float() * scale).
template <int QType>
ACCO_HD uint8_t quantize_value(float v, float s, float& sent) {
  // clamp(-qmax, qmax) as selects (fminf/fmaxf, which must handle NaN, do not vectorize; y is not NaN here).
  float y = div_rn(v, s);
  y = y < -qmax<QType>() ? -qmax<QType>() : y;
  y = y > qmax<QType>() ? qmax<QType>() : y;
  if constexpr (QType == kInt8) {
    // Round to nearest, ties to even, as rintf (which gcc does not vectorize): |y| <= 127, so adding
    // 1.5 * 2^23 leaves no fraction bits and the float addition itself rounds. r is never -0.0 (M - M is
    // +0.0), so it equals the int8 read back as a float, as the reference multiplies it (rintf's -0.0 would
    // turn the residual of v = -0.0 into +0.0). Using r, not int8 -> float, keeps the loop vectorizable.
    const float r = sub_rn(add_rn(y, 12582912.0f), 12582912.0f);
    sent = mul_rn(r, s);
    return static_cast<uint8_t>(static_cast<int>(r));
  } else {
    const uint8_t b = float_to_fp8_e4m3(y);
    sent = mul_rn(fp8_e4m3_to_float(b), s);
    return b;
  }
}

template <int QType>
ACCO_HD float wire_to_float(uint8_t b) {
  if constexpr (QType == kInt8) {
    return static_cast<float>(static_cast<int8_t>(b));
  } else {
    return fp8_e4m3_to_float(b);
  }
}

// Store for the quantization kernels' float outputs (residual, out): as store_from_float, except that on
// the host a NaN becomes bf16 0xFFFF, as torch's vectorized CPU cast writes it (Vectorized<BFloat16>,
// AVX2/AVX-512: what `residual.copy_(v - sent)` in the reference runs), where c10::BFloat16 writes 0x7FC0.
// On the device torch's cast is __float2bfloat16_rn, as store_from_float.
template <int DType>
ACCO_HD void store_cast(void* p, int64_t i, float x) {
#if defined(__CUDA_ARCH__)
  store_from_float<DType>(p, i, x);
#else
  if constexpr (DType == kBFloat16) {
    static_cast<uint16_t*>(p)[i] = x != x ? static_cast<uint16_t>(0xFFFF) : float_to_bf16_bits(x);
  } else {
    store_from_float<DType>(p, i, x);
  }
#endif
}

// out + q * scale for one element: the product rounded to float, then the sum (no fma).
template <int QType>
ACCO_HD float dequantize_add(float out, uint8_t b, float s) {
  return add_rn(out, mul_rn(wire_to_float<QType>(b), s));
}

}  // namespace acco
