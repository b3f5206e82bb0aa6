// CUDA kernels of acco_ds. Compiles with nvcc alone (no torch headers):
//   nvcc -c -std=c++17 -fmad=false -arch=sm_80 csrc/cuda/acco_cuda_kernels.cu
// Build without --use_fast_math and with -fmad=false: sqrtf and '/' must be
// IEEE, and the only fused multiply-adds are the explicit fmaf calls that
// mirror torch's own (see adam_element).
//
// adam_kernel: one grid-stride pass, 4 elements per thread with 16-byte loads
// when every pointer is aligned (flat ZeRO partitions are), scalar tail.
// multi_tensor_kernel: Apex-style multi_tensor_apply: per launch, a small
// struct of tensor pointers and a block -> (tensor, chunk) map passed by value.
#include <algorithm>

#include "acco_cuda.h"

namespace acco {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kILP = 4;

// 4 consecutive outputs with one 16-byte (fp32) or 8-byte (bf16/fp16) store.
template <int DType>
__device__ __forceinline__ void store4(void* out, int64_t j, const float4& p) {
  if constexpr (DType == kFloat32) {
    reinterpret_cast<float4*>(out)[j] = p;
  } else {
    uint16_t h[4];
    store_from_float<DType>(h, 0, p.x);
    store_from_float<DType>(h, 1, p.y);
    store_from_float<DType>(h, 2, p.z);
    store_from_float<DType>(h, 3, p.w);
    uint2 packed;
    packed.x = static_cast<uint32_t>(h[0]) | (static_cast<uint32_t>(h[1]) << 16);
    packed.y = static_cast<uint32_t>(h[2]) | (static_cast<uint32_t>(h[3]) << 16);
    reinterpret_cast<uint2*>(out)[j] = packed;
  }
}

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
    if constexpr (Commit) {
      reinterpret_cast<float4*>(master)[j] = p;
      reinterpret_cast<float4*>(m)[j] = mm;
      reinterpret_cast<float4*>(v)[j] = vv;
    }
    if constexpr (OutDType >= 0) store4<OutDType>(out, j, p);
  }
  for (int64_t i = n_vec * kILP + tid; i < n; i += stride) {
    float p = master[i], mi = m[i], vi = v[i];
    adam_element(p, grad[i], mi, vi, s);
    if constexpr (Commit) {
      master[i] = p;
      m[i] = mi;
      v[i] = vi;
    }
    if constexpr (OutDType >= 0) store_from_float<OutDType>(out, i, p);
  }
}

int grid_size(int64_t work) {
  // Enough blocks to fill the GPU several times; the grid-stride loop does the rest.
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, 65535)));
}

template <int OutDType, bool Commit>
void launch_adam(float* master, const float* grad, float* m, float* v, void* out, int64_t n, const AdamScalars& s,
                 cudaStream_t stream) {
  const int out_bytes = OutDType == kFloat32 ? 16 : 8;  // 4 output elements
  const bool vec = (reinterpret_cast<uintptr_t>(master) | reinterpret_cast<uintptr_t>(grad) |
                    reinterpret_cast<uintptr_t>(m) | reinterpret_cast<uintptr_t>(v)) % 16 == 0 &&
                   (OutDType < 0 || reinterpret_cast<uintptr_t>(out) % out_bytes == 0);
  const int64_t work = vec ? (n + kILP - 1) / kILP : n;
  adam_kernel<OutDType, Commit><<<grid_size(work), kThreads, 0, stream>>>(master, grad, m, v, out, n, s, vec);
}

template <bool Commit>
void adam_dispatch(float* master, const float* grad, float* m, float* v, void* out, int out_dtype, int64_t n,
                   const AdamScalars& s, cudaStream_t stream) {
  switch (out_dtype) {
    case kFloat32: return launch_adam<kFloat32, Commit>(master, grad, m, v, out, n, s, stream);
    case kBFloat16: return launch_adam<kBFloat16, Commit>(master, grad, m, v, out, n, s, stream);
    case kFloat16: return launch_adam<kFloat16, Commit>(master, grad, m, v, out, n, s, stream);
    default: if (Commit) launch_adam<-1, true>(master, grad, m, v, out, n, s, stream);  // peek without out: no-op
  }
}

// ---------------------------------------------------------------- multi-tensor
// Kernel parameters are limited to 4 KB; this struct is about 2.8 KB.
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

template <int DType, bool Pack>
__device__ __forceinline__ void chunk_loop(void* data, float* flat_part, int64_t start, int64_t end, float scale,
                                           bool accumulate) {
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
    if (Pack) {
      const float x = load_as_float<DType>(data, i) * scale;
      flat_part[i] = accumulate ? flat_part[i] + x : x;
    } else {
      store_from_float<DType>(data, i, flat_part[i]);
    }
  }
}

// Pack: flat[offset + i] (+)= tensor[i] * scale; unpack: tensor[i] = flat[offset + i].
template <bool Pack>
__global__ void multi_tensor_kernel(TensorListMeta meta, float* flat, float scale, bool accumulate) {
  const int t = meta.block_to_tensor[blockIdx.x];
  const int64_t start = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * kChunk;
  const int64_t end = min(start + kChunk, meta.numel[t]);
  float* flat_part = flat + meta.offset[t];
  switch (meta.dtype[t]) {  // uniform across the block: no divergence
    case kFloat32: return chunk_loop<kFloat32, Pack>(meta.data[t], flat_part, start, end, scale, accumulate);
    case kBFloat16: return chunk_loop<kBFloat16, Pack>(meta.data[t], flat_part, start, end, scale, accumulate);
    default: return chunk_loop<kFloat16, Pack>(meta.data[t], flat_part, start, end, scale, accumulate);
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
      const bool last_chunk = c == chunks - 1;
      if (n_blocks == kMaxBlocks || (n_tensors + 1 == kMaxTensors && last_chunk)) {
        multi_tensor_kernel<Pack><<<n_blocks, kThreads, 0, stream>>>(meta, flat, scale, accumulate);
        n_blocks = 0;
        if (last_chunk) {
          n_tensors = -1;  // the next tensor starts at slot 0
        } else {
          // The tensor continues in the next launch, from slot 0.
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
    adam_dispatch<true>(master, grad, m, v, out, out_dtype, n, s, stream);
  } else {
    adam_dispatch<false>(master, grad, m, v, out, out_dtype, n, s, stream);
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
