// torch bindings of the CPU kernels (csrc/cpu/acco_cpu.cpp): argument checks, dtype codes, host scalars.
#include <torch/extension.h>

#include "../cpu/acco_cpu.h"
#include "acco_bindings_common.h"

namespace {

void adamw_update(torch::Tensor master, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                  std::optional<torch::Tensor> out, int64_t step, double lr, double beta1, double beta2, double eps,
                  double weight_decay, double grad_scale, bool commit, bool adamw) {
  acco::bindings::check_adam_args(master, grad, exp_avg, exp_avg_sq, out, torch::kCPU);
  const acco::AdamScalars s =
      acco::make_adam_scalars(step, lr, beta1, beta2, eps, weight_decay, grad_scale, adamw);
  void* out_ptr = out.has_value() ? out->data_ptr() : nullptr;
  const int out_dtype = out.has_value() ? acco::bindings::dtype_code(*out) : -1;
  acco::cpu::adam_update(master.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                         exp_avg_sq.data_ptr<float>(), out_ptr, out_dtype, master.numel(), s, commit);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adamw_update", &adamw_update, "Fused AdamW update of a flat fp32 shard (peek or commit) (CPU)");
}
