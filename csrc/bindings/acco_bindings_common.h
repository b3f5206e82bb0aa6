// Argument checks shared by the CPU and CUDA bindings.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <vector>

#include "../acco_common.h"
#include "../acco_sparse.h"

namespace acco {
namespace bindings {

// A number for an error message, as text. TORCH_CHECK streams its arguments into a std::ostringstream; on the GPU
// image (this op built by Ubuntu's g++ 13.3 against a torch 2.11 wheel built with gcc-toolset-13) streaming an
// integer or a double there crashed the process (SIGSEGV) where strings did not, so numbers go in as text from
// snprintf.
struct Num {
  char text[32];
};
inline Num num(int64_t v) {
  Num r;
  std::snprintf(r.text, sizeof r.text, "%lld", static_cast<long long>(v));
  return r;
}
inline Num num_real(double v) {
  Num r;
  std::snprintf(r.text, sizeof r.text, "%.17g", v);
  return r;
}

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
    TORCH_CHECK(pair.first->numel() == n, pair.second, " has ", num(pair.first->numel()).text,
                " elements, master has ", num(n).text);
  }
  if (out.has_value()) {
    check_flat(*out, "out", device);
    TORCH_CHECK(out->numel() == n, "out has ", num(out->numel()).text, " elements, master has ",
                num(n).text);
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
  TORCH_CHECK(block >= 1, "block_size must be positive, got ", num(block).text);
  const int64_t n = x.numel();
  check_flat(x, x_name, device);
  dtype_code(x);
  check_flat(q, "q", device);
  qtype_code(q);
  TORCH_CHECK(q.numel() == n, "q has ", num(q.numel()).text, " elements, ", x_name, " has ", num(n).text);
  check_flat(scales, "scales", device);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32, "scales must be float32, got ", scales.scalar_type());
  TORCH_CHECK(scales.numel() == num_blocks(n, block), "scales has ", num(scales.numel()).text, " elements, ",
              num(num_blocks(n, block)).text, " blocks of ", num(block).text, " expected");
  TORCH_CHECK(q.device() == x.device() && scales.device() == x.device(), "q and scales must be on ", x_name,
              "'s device ", x.device(), ", got ", q.device(), " and ", scales.device());
  if (residual.has_value()) {
    check_flat(*residual, "residual", device);
    TORCH_CHECK(residual->scalar_type() == torch::kFloat32 || residual->scalar_type() == torch::kBFloat16,
                "residual must be float32 or bfloat16, got ", residual->scalar_type());
    TORCH_CHECK(residual->numel() == n, "residual has ", num(residual->numel()).text, " elements, ", x_name,
                " has ", num(n).text);
    TORCH_CHECK(residual->device() == x.device(), "residual must be on ", x_name, "'s device ", x.device(),
                ", got ", residual->device());
  }
}


// ------------------------------------------------------------------ sparse outer communication
// The layout of one replica's payload (reference.sparse_layout), computed on the host from the chunk offsets:
// table rows 0, 1, 2 = offsets, entry_starts, byte_starts (chunks + 1 each), int64 on the CPU.
struct SparseLayout {
  torch::Tensor table;
  int64_t chunks = 0, entries = 0, bytes = 0;
};

inline SparseLayout sparse_layout(const torch::Tensor& offsets, int64_t numel, int64_t topk, int64_t value_bits) {
  TORCH_CHECK(value_bits == 0 || value_bits == 2 || value_bits == 4 || value_bits == 8,
              "value_bits must be one of 2, 4, 8 or 0 (fp32 values), got ", num(value_bits).text);
  TORCH_CHECK(topk >= 0, "topk must be >= 0, got ", num(topk).text);
  TORCH_CHECK(offsets.scalar_type() == torch::kInt64 && offsets.dim() == 1 && offsets.numel() >= 1,
              "offsets must be a 1-D int64 tensor of chunks + 1 bounds (reference.chunk_offsets), got ",
              offsets.scalar_type(), " with ", num(offsets.dim()).text, " dimensions and ", num(offsets.numel()).text,
              " elements");
  const torch::Tensor host = offsets.to(torch::kCPU).contiguous();
  const int64_t chunks = host.numel() - 1;
  SparseLayout layout;
  layout.chunks = chunks;
  layout.table = torch::empty({3, chunks + 1}, torch::kInt64);
  const int64_t* off = host.data_ptr<int64_t>();
  int64_t* out = layout.table.data_ptr<int64_t>();
  TORCH_CHECK(off[0] >= 0 && off[chunks] <= numel, "offsets must lie in [0, ", num(numel).text,
              "] (the tensor's elements), got ", num(off[0]).text, " .. ", num(off[chunks]).text);
  out[chunks + 1] = out[2 * (chunks + 1)] = 0;
  for (int64_t c = 0; c <= chunks; ++c) {
    out[c] = off[c];
    if (c == chunks) break;
    const int64_t len = off[c + 1] - off[c];
    TORCH_CHECK(len >= 0 && len <= kMaxSparseChunk, "chunk ", num(c).text, " has ", num(len).text,
                " elements (offsets ", num(off[c]).text, ", ", num(off[c + 1]).text, "): chunks must hold 0 to ",
                num(kMaxSparseChunk).text, " elements (indices travel as 16 bits)");
    const int64_t kept = std::min(len, topk);
    out[chunks + 1 + c + 1] = out[chunks + 1 + c] + kept;
    out[2 * (chunks + 1) + c + 1] = out[2 * (chunks + 1) + c] + (value_bits ? (kept * value_bits + 7) / 8 : 4 * kept);
  }
  layout.entries = out[2 * chunks + 1];
  layout.bytes = out[3 * chunks + 2];
  return layout;
}

inline void check_sparse_tensor(const torch::Tensor& t, const char* name, torch::ScalarType dtype, int64_t numel,
                                const torch::Tensor& like, torch::DeviceType device) {
  check_flat(t, name, device);
  TORCH_CHECK(t.device() == like.device(), name, " must be on ", like.device(), ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.numel() == numel, name, " has ", num(t.numel()).text,
              " elements, the layout of these offsets, topk and value_bits needs ", num(numel).text);
}

// sparse_unpack_accumulate's payload against the layout its offsets, topk and value_bits give.
inline void check_sparse_payload(const torch::Tensor& out, const torch::Tensor& indices, const torch::Tensor& values,
                                 const torch::Tensor& scales, const SparseLayout& layout, int64_t value_bits,
                                 torch::DeviceType device) {
  check_sparse_tensor(indices, "indices", torch::kInt16, layout.entries, out, device);
  if (value_bits) {
    check_sparse_tensor(values, "values", torch::kUInt8, layout.bytes, out, device);
    check_sparse_tensor(scales, "scales", torch::kFloat32, layout.chunks, out, device);
  } else {
    check_sparse_tensor(values, "values", torch::kFloat32, layout.entries, out, device);
  }
}

// sparse_average's R payloads and weights: each payload as check_sparse_payload; the weights as fp32 (as
// sparse_unpack_accumulate takes each) and their total, summed in double in replica order then rounded to fp32
// (as the reference's sum of Python floats, then out.div_(total)).
struct SparseWeights {
  std::vector<float> weights;
  float total = 0.0f;
};

inline SparseWeights check_sparse_payloads(const torch::Tensor& out, const std::vector<torch::Tensor>& indices,
                                           const std::vector<torch::Tensor>& values,
                                           const std::vector<torch::Tensor>& scales, const std::vector<double>& weights,
                                           const SparseLayout& layout, int64_t value_bits, torch::DeviceType device) {
  const size_t r = indices.size();
  TORCH_CHECK(values.size() == r && scales.size() == r && weights.size() == r,
              "sparse_average needs one indices, values, scales and weight per replica, got ", num(r).text, ", ",
              num(values.size()).text, ", ", num(scales.size()).text, " and ", num(weights.size()).text);
  SparseWeights w;
  double total = 0.0;
  for (size_t i = 0; i < r; ++i) {
    check_sparse_payload(out, indices[i], values[i], scales[i], layout, value_bits, device);
    TORCH_CHECK(std::isfinite(weights[i]) && weights[i] >= 0.0, "weight ", num(i).text,
                " must be finite and >= 0, got ", num_real(weights[i]).text);
    w.weights.push_back(static_cast<float>(weights[i]));
    total += weights[i];
  }
  w.total = static_cast<float>(total);
  return w;
}

inline void check_sparse_flat(const torch::Tensor& t, const char* name, torch::DeviceType device) {
  check_flat(t, name, device);
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ", t.scalar_type());
}

}  // namespace bindings
}  // namespace acco
