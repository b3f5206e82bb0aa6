// torch bindings of the CUDA kernels (csrc/cuda/acco_cuda_kernels.cu): checks, device guard, current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "../cuda/acco_cuda.h"
#include "acco_bindings_common.h"

namespace {

void adamw_update(torch::Tensor master, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                  std::optional<torch::Tensor> out, int64_t step, double lr, double beta1, double beta2, double eps,
                  double weight_decay, double grad_scale, bool commit, bool adamw) {
  acco::bindings::check_adam_args(master, grad, exp_avg, exp_avg_sq, out, torch::kCUDA);
  const c10::cuda::CUDAGuard guard(master.device());
  const acco::AdamScalars s =
      acco::make_adam_scalars(step, lr, beta1, beta2, eps, weight_decay, grad_scale, adamw);
  void* out_ptr = out.has_value() ? out->data_ptr() : nullptr;
  const int out_dtype = out.has_value() ? acco::bindings::dtype_code(*out) : -1;
  acco::cuda::adam_update(master.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                          exp_avg_sq.data_ptr<float>(), out_ptr, out_dtype, master.numel(), s, commit,
                          c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adamw_update", &adamw_update, "Fused AdamW update of a flat fp32 shard (peek or commit) (CUDA)");
}
