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

}  // namespace bindings
}  // namespace acco
