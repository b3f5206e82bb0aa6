// CUDA kernels of acco_ds. Compiles with nvcc alone (no torch headers):
//   nvcc -c -std=c++17 -fmad=false -arch=sm_80 csrc/cuda/acco_cuda_kernels.cu
// Build without --use_fast_math and with -fmad=false: sqrtf and '/' must be
// IEEE, and the only fused multiply-adds are the explicit fmaf calls that
// mirror torch's own (see adam_element).
//
// adam_kernel: one grid-stride pass, 4 elements per thread with 16-byte loads
// when every pointer is aligned (flat ZeRO partitions are), scalar tail.
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

}  // namespace cuda
}  // namespace acco
