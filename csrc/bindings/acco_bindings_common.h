// Argument checks shared by the CPU and CUDA bindings.
#pragma once

#include <torch/extension.h>

#include <optional>

#include "../acco_common.h"

namespace acco {
namespace bindings {

inline int dtype_code(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return kFloat32;
    case torch::kBFloat16: return kBFloat16;
    case torch::kFloat16: return kFloat16;
    default: TORCH_CHECK(false, "acco_ds ops support float32, bfloat16 and float16 tensors, got ", t.scalar_type());
  }
  return -1;
}

inline void check_flat(const torch::Tensor& t, const char* name, torch::DeviceType device) {
  TORCH_CHECK(t.device().type() == device, name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

inline void check_adam_args(const torch::Tensor& master, const torch::Tensor& grad, const torch::Tensor& m,
                            const torch::Tensor& v, const std::optional<torch::Tensor>& out,
                            torch::DeviceType device) {
  const int64_t n = master.numel();
  for (auto pair : {std::make_pair(&master, "master"), std::make_pair(&grad, "grad"), std::make_pair(&m, "exp_avg"),
                    std::make_pair(&v, "exp_avg_sq")}) {
    check_flat(*pair.first, pair.second, device);
    TORCH_CHECK(pair.first->scalar_type() == torch::kFloat32, pair.second, " must be float32");
    TORCH_CHECK(pair.first->numel() == n, pair.second, " has ", pair.first->numel(), " elements, master has ", n);
  }
  if (out.has_value()) {
    check_flat(*out, "out", device);
    TORCH_CHECK(out->numel() == n, "out has ", out->numel(), " elements, master has ", n);
    dtype_code(*out);
  }
}

inline int qtype_code(const torch::Tensor& q) {
  if (q.scalar_type() == torch::kChar) return kInt8;
  if (q.scalar_type() == at::ScalarType::Float8_e4m3fn) return kFp8E4M3;
  TORCH_CHECK(false, "quantized values must be int8 or float8_e4m3fn, got ", q.scalar_type());
  return -1;
}

inline int64_t num_blocks(int64_t n, int64_t block) { return n == 0 ? 0 : (n - 1) / block + 1; }

// quantize_pack(x, residual, q, scales) and dequantize_accumulate(q, scales, out): `x` names the
// full-precision tensor ("x" or "out"), whose element count n the others must match.
inline void check_quant_args(const torch::Tensor& x, const char* x_name, const std::optional<torch::Tensor>& residual,
                             const torch::Tensor& q, const torch::Tensor& scales, int64_t block,
                             torch::DeviceType device) {
  TORCH_CHECK(block >= 1, "block_size must be positive, got ", block);
  const int64_t n = x.numel();
  check_flat(x, x_name, device);
  dtype_code(x);
  check_flat(q, "q", device);
  qtype_code(q);
  TORCH_CHECK(q.numel() == n, "q has ", q.numel(), " elements, ", x_name, " has ", n);
  check_flat(scales, "scales", device);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32, "scales must be float32, got ", scales.scalar_type());
  TORCH_CHECK(scales.numel() == num_blocks(n, block), "scales has ", scales.numel(), " elements, ",
              num_blocks(n, block), " blocks of ", block, " expected");
  TORCH_CHECK(q.device() == x.device() && scales.device() == x.device(), "q and scales must be on ", x_name,
              "'s device ", x.device(), ", got ", q.device(), " and ", scales.device());
  if (residual.has_value()) {
    check_flat(*residual, "residual", device);
    TORCH_CHECK(residual->scalar_type() == torch::kFloat32 || residual->scalar_type() == torch::kBFloat16,
                "residual must be float32 or bfloat16, got ", residual->scalar_type());
    TORCH_CHECK(residual->numel() == n, "residual has ", residual->numel(), " elements, ", x_name, " has ", n);
    TORCH_CHECK(residual->device() == x.device(), "residual must be on ", x_name, "'s device ", x.device(),
                ", got ", residual->device());
  }
}

}  // namespace bindings
}  // namespace acco
