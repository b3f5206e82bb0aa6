// CUDA kernels of acco_ds. Compiles with nvcc alone (no torch headers):
//   nvcc -c -std=c++17 -arch=sm_80 csrc/cuda/acco_cuda_kernels.cu
//
// adam_kernel: one grid-stride pass, 4 elements per thread with 16-byte loads
// when every pointer is aligned (the flat ZeRO partitions are), scalar tail.
// pack_kernel: Apex-style multi_tensor_apply: per launch, a small struct of
// tensor pointers and a block -> (tensor, chunk) map passed by value.
#include <algorithm>

#include "acco_cuda.h"

namespace acco {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kILP = 4;

template <int OutDType, bool Commit>
__global__ void adam_kernel(float* __restrict__ master, const float* __restrict__ grad, float* __restrict__ m,
                            float* __restrict__ v, void* __restrict__ out, int64_t n, AdamScalars s, bool vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n_vec = vec ? n / kILP : 0;
  for (int64_t j = tid; j < n_vec; j += stride) {
    float4 p = reinterpret_cast<const float4*>(master)[j];
    const float4 g = reinterpret_cast<const float4*>(grad)[j];
    float4 mm = reinterpret_cast<const float4*>(m)[j];
    float4 vv = reinterpret_cast<const float4*>(v)[j];
    adam_element(p.x, g.x, mm.x, vv.x, s);
    adam_element(p.y, g.y, mm.y, vv.y, s);
    adam_element(p.z, g.z, mm.z, vv.z, s);
    adam_element(p.w, g.w, mm.w, vv.w, s);
    if (Commit) {
      reinterpret_cast<float4*>(master)[j] = p;
      reinterpret_cast<float4*>(m)[j] = mm;
      reinterpret_cast<float4*>(v)[j] = vv;
    }
    if (OutDType >= 0) {
      const int64_t i = j * kILP;
      store_from_float(out, i, OutDType, p.x);
      store_from_float(out, i + 1, OutDType, p.y);
      store_from_float(out, i + 2, OutDType, p.z);
      store_from_float(out, i + 3, OutDType, p.w);
    }
  }
  for (int64_t i = n_vec * kILP + tid; i < n; i += stride) {
    float p = master[i], mi = m[i], vi = v[i];
    adam_element(p, grad[i], mi, vi, s);
    if (Commit) {
      master[i] = p;
      m[i] = mi;
      v[i] = vi;
    }
    if (OutDType >= 0) store_from_float(out, i, OutDType, p);
  }
}

template <int OutDType, bool Commit>
void launch_adam(float* master, const float* grad, float* m, float* v, void* out, int64_t n, const AdamScalars& s,
                 cudaStream_t stream) {
  const bool vec = (reinterpret_cast<uintptr_t>(master) | reinterpret_cast<uintptr_t>(grad) |
                    reinterpret_cast<uintptr_t>(m) | reinterpret_cast<uintptr_t>(v)) % 16 == 0;
  const int64_t work = vec ? (n + kILP - 1) / kILP : n;
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, 65535)));
  adam_kernel<OutDType, Commit><<<blocks, kThreads, 0, stream>>>(master, grad, m, v, out, n, s, vec);
}

// ---------------------------------------------------------------- multi-tensor
constexpr int kMaxTensors = 48;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 65536;

struct TensorListMeta {
  void* data[kMaxTensors];
  int64_t numel[kMaxTensors];
  int64_t offset[kMaxTensors];
  unsigned char dtype[kMaxTensors];
  unsigned char block_to_tensor[kMaxBlocks];
  int block_to_chunk[kMaxBlocks];
};

template <bool Pack>
__global__ void multi_tensor_kernel(TensorListMeta meta, float* flat, float scale, bool accumulate) {
  const int t = meta.block_to_tensor[blockIdx.x];
  const int64_t start = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * kChunk;
  const int64_t end = min(start + kChunk, meta.numel[t]);
  void* data = meta.data[t];
  float* dst = flat + meta.offset[t];
  const int dtype = meta.dtype[t];  // uniform across the block: no divergence
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
    if (Pack) {
      const float x = load_as_float(data, i, dtype) * scale;
      dst[i] = accumulate ? dst[i] + x : x;
    } else {
      store_from_float(data, i, dtype, dst[i]);
    }
  }
}

template <bool Pack>
void multi_tensor_apply(const std::vector<FlatItem>& items, float* flat, float scale, bool accumulate,
                        cudaStream_t stream) {
  TensorListMeta meta;
  int n_tensors = 0, n_blocks = 0;
  for (size_t t = 0; t < items.size(); ++t) {
    if (items[t].numel == 0) continue;
    meta.data[n_tensors] = items[t].data;
    meta.numel[n_tensors] = items[t].numel;
    meta.offset[n_tensors] = items[t].offset;
    meta.dtype[n_tensors] = static_cast<unsigned char>(items[t].dtype);
    const int64_t chunks = (items[t].numel + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_to_tensor[n_blocks] = static_cast<unsigned char>(n_tensors);
      meta.block_to_chunk[n_blocks] = static_cast<int>(c);
      ++n_blocks;
      const bool tensors_full = n_tensors + 1 == kMaxTensors && c == chunks - 1;
      if (n_blocks == kMaxBlocks || tensors_full) {
        // Launch what we have; a tensor cut mid-way continues in the next launch.
        multi_tensor_kernel<Pack><<<n_blocks, kThreads, 0, stream>>>(meta, flat, scale, accumulate);
        n_blocks = 0;
        if (c == chunks - 1) {
          n_tensors = -1;
        } else {
          meta.data[0] = meta.data[n_tensors];
          meta.numel[0] = meta.numel[n_tensors];
          meta.offset[0] = meta.offset[n_tensors];
          meta.dtype[0] = meta.dtype[n_tensors];
          n_tensors = 0;
        }
      }
    }
    ++n_tensors;
  }
  if (n_blocks > 0) multi_tensor_kernel<Pack><<<n_blocks, kThreads, 0, stream>>>(meta, flat, scale, accumulate);
}

}  // namespace

void adam_update(float* master, const float* grad, float* m, float* v, void* out, int out_dtype, int64_t n,
                 const AdamScalars& s, bool commit, cudaStream_t stream) {
  if (n == 0) return;
  if (commit) {
    switch (out_dtype) {
      case kFloat32: return launch_adam<kFloat32, true>(master, grad, m, v, out, n, s, stream);
      case kBFloat16: return launch_adam<kBFloat16, true>(master, grad, m, v, out, n, s, stream);
      case kFloat16: return launch_adam<kFloat16, true>(master, grad, m, v, out, n, s, stream);
      default: return launch_adam<-1, true>(master, grad, m, v, out, n, s, stream);
    }
  }
  switch (out_dtype) {
    case kFloat32: return launch_adam<kFloat32, false>(master, grad, m, v, out, n, s, stream);
    case kBFloat16: return launch_adam<kBFloat16, false>(master, grad, m, v, out, n, s, stream);
    case kFloat16: return launch_adam<kFloat16, false>(master, grad, m, v, out, n, s, stream);
    default: return;
  }
}

void pack(const std::vector<FlatItem>& items, float* flat, float scale, bool accumulate, cudaStream_t stream) {
  multi_tensor_apply<true>(items, flat, scale, accumulate, stream);
}

void unpack(const float* flat, const std::vector<FlatItem>& items, cudaStream_t stream) {
  multi_tensor_apply<false>(items, const_cast<float*>(flat), 1.0f, false, stream);
}

}  // namespace cuda
}  // namespace acco
