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

void quantize_pack(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor q, torch::Tensor scales,
                   int64_t block_size) {
  acco::bindings::check_quant_args(x, "x", residual, q, scales, block_size, torch::kCPU);
  void* r = residual.has_value() ? residual->data_ptr() : nullptr;
  const int r_dtype = residual.has_value() ? acco::bindings::dtype_code(*residual) : -1;
  acco::cpu::quantize_pack(x.data_ptr(), acco::bindings::dtype_code(x), r, r_dtype,
                            static_cast<uint8_t*>(q.data_ptr()), acco::bindings::qtype_code(q),
                            scales.data_ptr<float>(), x.numel(), block_size);
}

void dequantize_accumulate(torch::Tensor q, torch::Tensor scales, torch::Tensor out, int64_t block_size) {
  acco::bindings::check_quant_args(out, "out", std::nullopt, q, scales, block_size, torch::kCPU);
  acco::cpu::dequantize_accumulate(static_cast<const uint8_t*>(q.data_ptr()), acco::bindings::qtype_code(q),
                                    scales.data_ptr<float>(), out.data_ptr(), acco::bindings::dtype_code(out),
                                    out.numel(), block_size);
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> sparse_pack(torch::Tensor e, torch::Tensor offsets, int64_t topk,
                                                                    int64_t value_bits) {
  acco::bindings::check_sparse_flat(e, "e", torch::kCPU);
  const auto layout = acco::bindings::sparse_layout(offsets, e.numel(), topk, value_bits);
  const auto opts = e.options();
  torch::Tensor indices = torch::empty({layout.entries}, opts.dtype(torch::kInt16));
  torch::Tensor values = value_bits ? torch::zeros({layout.bytes}, opts.dtype(torch::kUInt8))  // codes are ORed in
                                    : torch::empty({layout.entries}, opts);
  torch::Tensor scales = torch::empty({value_bits ? layout.chunks : 0}, opts);
  const int64_t* t = layout.table.data_ptr<int64_t>();
  const int64_t row = layout.chunks + 1;
  acco::cpu::sparse_pack(e.data_ptr<float>(), t, t + row, t + 2 * row, layout.chunks, topk,
                         static_cast<int>(value_bits), indices.data_ptr<int16_t>(), values.data_ptr(),
                         scales.data_ptr<float>());
  return {indices, values, scales};
}

void sparse_unpack_accumulate(torch::Tensor out, torch::Tensor offsets, torch::Tensor indices, torch::Tensor values,
                              torch::Tensor scales, int64_t topk, int64_t value_bits, double weight) {
  acco::bindings::check_sparse_flat(out, "out", torch::kCPU);
  const auto layout = acco::bindings::sparse_layout(offsets, out.numel(), topk, value_bits);
  acco::bindings::check_sparse_payload(out, indices, values, scales, layout, value_bits, torch::kCPU);
  const int64_t* t = layout.table.data_ptr<int64_t>();
  const int64_t row = layout.chunks + 1;
  const int64_t bad = acco::cpu::sparse_unpack_accumulate(
      out.data_ptr<float>(), t, t + row, t + 2 * row, layout.chunks, indices.data_ptr<int16_t>(), values.data_ptr(),
      value_bits ? scales.data_ptr<float>() : nullptr, static_cast<int>(value_bits), static_cast<float>(weight));
  TORCH_CHECK(bad == 0, acco::bindings::num(bad).text, " indices point past the end of their chunk: the payload "
              "does not belong to these offsets (the other ", acco::bindings::num(layout.entries - bad).text,
              " entries were added to out)");
}

void sparse_average(torch::Tensor out, torch::Tensor offsets, std::vector<torch::Tensor> indices,
                    std::vector<torch::Tensor> values, std::vector<torch::Tensor> scales, std::vector<double> weights,
                    int64_t topk, int64_t value_bits) {
  acco::bindings::check_sparse_flat(out, "out", torch::kCPU);
  const auto layout = acco::bindings::sparse_layout(offsets, out.numel(), topk, value_bits);
  const auto w = acco::bindings::check_sparse_payloads(out, indices, values, scales, weights, layout, value_bits,
                                                      torch::kCPU);
  std::vector<const int16_t*> idx;
  std::vector<const void*> val;
  std::vector<const float*> sc;
  for (size_t r = 0; r < indices.size(); ++r) {
    idx.push_back(indices[r].data_ptr<int16_t>());
    val.push_back(values[r].data_ptr());
    sc.push_back(value_bits ? scales[r].data_ptr<float>() : nullptr);
  }
  const int64_t* t = layout.table.data_ptr<int64_t>();
  const int64_t row = layout.chunks + 1;
  const int64_t bad = acco::cpu::sparse_average(out.data_ptr<float>(), out.numel(), t, t + row, t + 2 * row,
                                                layout.chunks, static_cast<int64_t>(idx.size()), idx.data(),
                                                val.data(), sc.data(), static_cast<int>(value_bits),
                                                w.weights.data(), w.total);
  TORCH_CHECK(bad == 0, acco::bindings::num(bad).text, " indices point past the end of their chunk: a payload "
              "does not belong to these offsets");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adamw_update", &adamw_update, "Fused AdamW update of a flat fp32 shard (peek or commit) (CPU)");
  m.def("quantize_pack", &quantize_pack, "Block quantization with error feedback: x (+ residual) -> q, scales (CPU)");
  m.def("dequantize_accumulate", &dequantize_accumulate, "out += q * scale per block (CPU)");
  m.def("sparse_pack", &sparse_pack, "Chunked top-k, quantize, pack; e[kept] -= q (CPU)");
  m.def("sparse_unpack_accumulate", &sparse_unpack_accumulate, "out[kept] += q * weight (CPU)");
  m.def("sparse_average", &sparse_average, "out = weighted average of R payloads, one pass (CPU)");
}
