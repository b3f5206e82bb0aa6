// Shared by the CPU and CUDA kernels of sparse outer communication (acco_ds/ops/reference.py, section "sparse
// outer communication": the wire format, chunked top-k with error feedback). Plain C++ (no torch headers).
//
// Selection works on the float bits of |e|: for non-negative floats the unsigned bit patterns order like the
// values, so "largest |e|, ties to the lower index" is "largest key" for key = (bits(|e|) << 16) | (65535 - i)
// (i < 65536: an index travels as 16 bits). The quantization below repeats the reference's fp32 operations
// one by one, each rounded on its own (add_rn etc.: no fma, on the host with -ffp-contract=off too).
#pragma once

#include "acco_common.h"

namespace acco {

constexpr int64_t kMaxSparseChunk = 65536;

// bits of |v| (the sign bit cleared: -0.0 and 0.0 are the same magnitude, as in e.abs()).
ACCO_HD uint32_t magnitude_bits(float v) { return float_to_bits(v) & 0x7FFFFFFFu; }

ACCO_HD uint64_t selection_key(float v, int64_t i) {
  return (static_cast<uint64_t>(magnitude_bits(v)) << 16) | static_cast<uint64_t>(65535 - i);
}

ACCO_HD float round_half_even(float t) {
#if defined(__CUDA_ARCH__)
  return rintf(t);
#else
  return std::nearbyint(t);  // the default rounding mode: to nearest, ties to even (torch.round)
#endif
}

// The code of a kept value v in a chunk whose kept values have max |v| = m (m >= |v|): the nearest of the
// 2^b levels, i = clamp(rint((v / m + 1) * (0.5 * (2^b - 1))), 0, 2^b - 1); m == 0 gives 0.
ACCO_HD uint32_t sparse_code(float v, float m, int value_bits) {
  if (!(m > 0.0f)) return 0;
  const float top = static_cast<float>((1u << value_bits) - 1u);
  float t = round_half_even(mul_rn(add_rn(div_rn(v, m), 1.0f), 0.5f * top));  // 0.5 * top is exact
  t = t < 0.0f ? 0.0f : t;
  t = t > top ? top : t;
  return static_cast<uint32_t>(t);
}

// The value code i stands for: m * ((float)(2 i) / (float)(2^b - 1) - 1); +0.0 when m == 0.
ACCO_HD float sparse_level(uint32_t code, float m, int value_bits) {
  if (!(m > 0.0f)) return 0.0f;
  const float top = static_cast<float>((1u << value_bits) - 1u);
  return mul_rn(m, sub_rn(div_rn(mul_rn(2.0f, static_cast<float>(code)), top), 1.0f));
}

// Code j of a chunk's packed codes (little-endian bit order, entry j at bit j * b of the chunk's bytes).
ACCO_HD uint32_t unpack_code(const uint8_t* chunk_bytes, int64_t j, int value_bits) {
  const int64_t bit = j * value_bits;
  return (static_cast<uint32_t>(chunk_bytes[bit / 8]) >> (bit % 8)) & ((1u << value_bits) - 1u);
}

}  // namespace acco
