// Argument checks shared by the CPU and CUDA bindings.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

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

inline std::vector<FlatItem> flat_items(const std::vector<torch::Tensor>& tensors, const torch::Tensor& flat,
                                        const std::vector<int64_t>& offsets, torch::DeviceType device) {
  check_flat(flat, "flat", device);
  TORCH_CHECK(flat.scalar_type() == torch::kFloat32, "flat must be float32");
  TORCH_CHECK(tensors.size() == offsets.size(), "got ", tensors.size(), " tensors but ", offsets.size(), " offsets");
  std::vector<FlatItem> items;
  items.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    check_flat(t, "every tensor", device);
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + t.numel() <= flat.numel(), "tensor ", i, " (", t.numel(),
                " elements at offset ", offsets[i], ") does not fit in the flat buffer of ", flat.numel());
    items.push_back({t.data_ptr(), t.numel(), offsets[i], dtype_code(t)});
  }
  return items;
}

}  // namespace bindings
}  // namespace acco
