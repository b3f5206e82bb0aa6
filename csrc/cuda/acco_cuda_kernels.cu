// CUDA kernels of acco_ds. Compiles with nvcc alone (no torch headers):
//   nvcc -c -std=c++17 -fmad=false -arch=sm_80 csrc/cuda/acco_cuda_kernels.cu
// Build without --use_fast_math and with -fmad=false: sqrtf and '/' must be
// IEEE, and the only fused multiply-adds are the explicit fmaf calls that
// mirror torch's own (see adam_element).
//
// adam_kernel: one grid-stride pass, 4 elements per thread with 16-byte loads
// when every pointer is aligned (flat ZeRO partitions are), scalar tail.
// quantize_warp_kernel: a warp per quantization block of 128..1024 elements
// (vector loads into registers, a warp-shuffle max, one read of memory);
// quantize_kernel, for other block sizes and a shorter last block: one thread
// block per quantization block (a block-wide max, then a second read);
// dequantize_kernel: one grid-stride pass. Both round every float operation
// on its own (add_rn, mul_rn, div_rn in acco_common.h), in the reference's
// order, so that they agree bit for bit with the torch reference on CPU
// (tests/test_quant_kernels.py checks it where a GPU is present).
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

// ----------------------------------------------------------- block quantization
// max |v| and "all finite" over the thread block: a warp-shuffle step, then warp 0 over the warps' results.
// fmaxf drops a NaN, so non-finite values are tracked by `finite`, not by the max.
__device__ __forceinline__ void block_reduce(float& amax, int& finite) {
  __shared__ float warp_max[kThreads / 32];
  __shared__ int warp_finite[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
    finite &= __shfl_xor_sync(0xFFFFFFFFu, finite, offset);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) {
    warp_max[warp] = amax;
    warp_finite[warp] = finite;
  }
  __syncthreads();
  if (warp == 0) {
    amax = lane < warps ? warp_max[lane] : 0.0f;
    finite = lane < warps ? warp_finite[lane] : 1;
    for (int offset = 16; offset > 0; offset /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
      finite &= __shfl_xor_sync(0xFFFFFFFFu, finite, offset);
    }
    if (lane == 0) {
      warp_max[0] = amax;
      warp_finite[0] = finite;
    }
  }
  __syncthreads();
  amax = warp_max[0];
  finite = warp_finite[0];
  __syncthreads();  // warp_max is reused by the next quantization block of this thread block
}

// One value of a block with scale s: its wire byte and, in residual_out, what the send left out (v when
// the block is not quantized: scale 0; NaN for a non-finite block). Both quantize kernels call it.
template <int QT>
__device__ __forceinline__ uint32_t quantize_one(float v, float s, bool quantize, float& residual_out) {
  float sent = mul_rn(0.0f, s);
  uint8_t byte = 0;
  if (quantize) byte = quantize_value<QT>(v, s, sent);
  residual_out = sub_rn(v, sent);
  return byte;
}

// One thread block per quantization block (grid-stride over blocks): the max over the block, then each
// thread quantizes its strided values. The block is read twice (it is in L1/L2 on the second read).
template <int XD, int RD, int QT>
__global__ void quantize_kernel(const void* __restrict__ x, void* __restrict__ residual, uint8_t* __restrict__ q,
                                float* __restrict__ scales, int64_t n, int64_t block, int64_t nb) {
  for (int64_t b = blockIdx.x; b < nb; b += gridDim.x) {
    const int64_t lo = b * block;
    const int64_t hi = lo + (block < n - lo ? block : n - lo);
    float amax = 0.0f;
    int finite = 1;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
      const float v = load_v<XD, RD>(x, residual, i);
      finite &= isfinite(v) ? 1 : 0;
      amax = fmaxf(amax, fabsf(v));
    }
    block_reduce(amax, finite);
    const float s = block_scale<QT>(amax, finite != 0);
    if (threadIdx.x == 0) scales[b] = s;
    const bool quantize = finite && s != 0.0f;  // else values 0, residual v - 0 * s (v, or NaN)
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
      float r;
      q[i] = static_cast<uint8_t>(quantize_one<QT>(load_v<XD, RD>(x, residual, i), s, quantize, r));
      if constexpr (RD >= 0) store_cast<RD>(residual, i, r);
    }
  }
}

// 4 consecutive elements as floats, with one 16-byte (fp32) or 8-byte (bf16/fp16) load; DType < 0: zeros.
template <int DType>
__device__ __forceinline__ float4 load4(const void* p, int64_t j) {
  if constexpr (DType == kFloat32) {
    return reinterpret_cast<const float4*>(p)[j];
  } else if constexpr (DType < 0) {
    return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  } else {
    const uint2 u = reinterpret_cast<const uint2*>(p)[j];
    const uint16_t h[4] = {static_cast<uint16_t>(u.x), static_cast<uint16_t>(u.x >> 16),
                           static_cast<uint16_t>(u.y), static_cast<uint16_t>(u.y >> 16)};
    return make_float4(load_as_float<DType>(h, 0), load_as_float<DType>(h, 1), load_as_float<DType>(h, 2),
                       load_as_float<DType>(h, 3));
  }
}

// A warp per quantization block of 32 * VPT elements (block sizes 128, 256, 512, 1024): each lane loads its
// VPT values once, 4 at a time with vector loads (a warp reads 32 consecutive groups of 4), the max is a
// warp shuffle (no shared memory, no __syncthreads), and the values are quantized from registers. Only
// whole blocks; the launcher gives a shorter last block to quantize_kernel. Both call quantize_one per
// element, so both agree bit for bit with the reference.
template <int XD, int RD, int QT, int VPT>
__global__ void quantize_warp_kernel(const void* __restrict__ x, void* __restrict__ residual,
                                     uint8_t* __restrict__ q, float* __restrict__ scales, int64_t nb) {
  constexpr int kGroups = VPT / 4;  // groups of 4 per lane
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; b < nb; b += warps) {
    float4 v[kGroups];
    float amax = 0.0f;
    int finite = 1;
#pragma unroll
    for (int c = 0; c < kGroups; ++c) {
      const int64_t j = (b * kGroups + c) * 32 + lane;
      float4 a = load4<XD>(x, j);
      if constexpr (RD >= 0) {  // x alone keeps -0.0 (load_v)
        const float4 r = load4<RD>(residual, j);
        a = make_float4(add_rn(a.x, r.x), add_rn(a.y, r.y), add_rn(a.z, r.z), add_rn(a.w, r.w));
      }
      v[c] = a;
      finite &= (isfinite(a.x) && isfinite(a.y) && isfinite(a.z) && isfinite(a.w)) ? 1 : 0;
      amax = fmaxf(fmaxf(amax, fmaxf(fabsf(a.x), fabsf(a.y))), fmaxf(fabsf(a.z), fabsf(a.w)));
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
      finite &= __shfl_xor_sync(0xFFFFFFFFu, finite, offset);
    }
    const float s = block_scale<QT>(amax, finite != 0);
    if (lane == 0) scales[b] = s;
    const bool quantize = finite && s != 0.0f;
#pragma unroll
    for (int c = 0; c < kGroups; ++c) {
      const int64_t j = (b * kGroups + c) * 32 + lane;
      float4 r;
      const uint32_t bytes = quantize_one<QT>(v[c].x, s, quantize, r.x) |
                             (quantize_one<QT>(v[c].y, s, quantize, r.y) << 8) |
                             (quantize_one<QT>(v[c].z, s, quantize, r.z) << 16) |
                             (quantize_one<QT>(v[c].w, s, quantize, r.w) << 24);
      reinterpret_cast<uint32_t*>(q)[j] = bytes;
      if constexpr (RD >= 0) store4<RD>(residual, j, r);
    }
  }
}

template <int QT, int OD>
__global__ void dequantize_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scales,
                                  void* __restrict__ out, int64_t n, int64_t block) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    store_cast<OD>(out, i, dequantize_add<QT>(load_as_float<OD>(out, i), q[i], scales[i / block]));
  }
}

template <int XD, int RD, int QT>
void launch_warp_quantize(int vpt, unsigned grid, const void* x, void* r, uint8_t* q, float* scales, int64_t nb,
                          cudaStream_t stream) {
  switch (vpt) {
    case 4: return quantize_warp_kernel<XD, RD, QT, 4><<<grid, kThreads, 0, stream>>>(x, r, q, scales, nb);
    case 8: return quantize_warp_kernel<XD, RD, QT, 8><<<grid, kThreads, 0, stream>>>(x, r, q, scales, nb);
    case 16: return quantize_warp_kernel<XD, RD, QT, 16><<<grid, kThreads, 0, stream>>>(x, r, q, scales, nb);
    default: return quantize_warp_kernel<XD, RD, QT, 32><<<grid, kThreads, 0, stream>>>(x, r, q, scales, nb);
  }
}

template <int XD, int RD>
void launch_quantize(const void* x, void* r, uint8_t* q, int q_type, float* scales, int64_t n, int64_t block,
                     cudaStream_t stream) {
  // Whole blocks of 128..1024 elements with aligned pointers: a warp per block (quantize_warp_kernel).
  const int64_t whole = n / block;
  const int x_size = XD == kFloat32 ? 4 : 2, r_size = RD == kFloat32 ? 4 : 2;
  const bool aligned = reinterpret_cast<uintptr_t>(x) % (4 * x_size) == 0 && reinterpret_cast<uintptr_t>(q) % 4 == 0 &&
                       (RD < 0 || reinterpret_cast<uintptr_t>(r) % (4 * r_size) == 0);
  const int vpt = block == 128 ? 4 : block == 256 ? 8 : block == 512 ? 16 : block == 1024 ? 32 : 0;
  int64_t done = 0;
  if (vpt != 0 && aligned && whole > 0) {
    const unsigned wgrid = static_cast<unsigned>(std::min<int64_t>((whole + 7) / 8, int64_t{1} << 20));  // 8 warps
    if (q_type == kInt8) {
      launch_warp_quantize<XD, RD, kInt8>(vpt, wgrid, x, r, q, scales, whole, stream);
    } else {
      launch_warp_quantize<XD, RD, kFp8E4M3>(vpt, wgrid, x, r, q, scales, whole, stream);
    }
    done = whole * block;
    if (done == n) return;
    x = static_cast<const char*>(x) + done * x_size;
    if (RD >= 0) r = static_cast<char*>(r) + done * r_size;
    q += done;
    scales += whole;
  }
  const int64_t rest = n - done;
  const int64_t nb = (rest - 1) / block + 1;
  // Threads: the block size rounded up to whole warps (short blocks leave no idle warps), at most kThreads.
  int threads = 32;
  while (threads < kThreads && threads < block) threads *= 2;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(nb, int64_t{1} << 20));
  if (q_type == kInt8) {
    quantize_kernel<XD, RD, kInt8><<<grid, threads, 0, stream>>>(x, r, q, scales, rest, block, nb);
  } else {
    quantize_kernel<XD, RD, kFp8E4M3><<<grid, threads, 0, stream>>>(x, r, q, scales, rest, block, nb);
  }
}

template <int XD>
void quantize_r(const void* x, void* r, int r_dtype, uint8_t* q, int q_type, float* scales, int64_t n, int64_t block,
                cudaStream_t stream) {
  switch (r_dtype) {
    case kFloat32: return launch_quantize<XD, kFloat32>(x, r, q, q_type, scales, n, block, stream);
    case kBFloat16: return launch_quantize<XD, kBFloat16>(x, r, q, q_type, scales, n, block, stream);
    default: return launch_quantize<XD, -1>(x, r, q, q_type, scales, n, block, stream);
  }
}

template <int QT>
void dequantize_o(const uint8_t* q, const float* scales, void* out, int out_dtype, int64_t n, int64_t block,
                  cudaStream_t stream) {
  const int grid = grid_size(n);
  switch (out_dtype) {
    case kFloat32: return dequantize_kernel<QT, kFloat32><<<grid, kThreads, 0, stream>>>(q, scales, out, n, block);
    case kBFloat16: return dequantize_kernel<QT, kBFloat16><<<grid, kThreads, 0, stream>>>(q, scales, out, n, block);
    default: return dequantize_kernel<QT, kFloat16><<<grid, kThreads, 0, stream>>>(q, scales, out, n, block);
  }
}

}  // namespace

void quantize_pack(const void* x, int x_dtype, void* residual, int residual_dtype, uint8_t* q, int q_type,
                   float* scales, int64_t n, int64_t block, cudaStream_t stream) {
  if (n == 0) return;
  switch (x_dtype) {
    case kFloat32: return quantize_r<kFloat32>(x, residual, residual_dtype, q, q_type, scales, n, block, stream);
    case kBFloat16: return quantize_r<kBFloat16>(x, residual, residual_dtype, q, q_type, scales, n, block, stream);
    default: return quantize_r<kFloat16>(x, residual, residual_dtype, q, q_type, scales, n, block, stream);
  }
}

void dequantize_accumulate(const uint8_t* q, int q_type, const float* scales, void* out, int out_dtype, int64_t n,
                           int64_t block, cudaStream_t stream) {
  if (n == 0) return;
  if (q_type == kInt8) {
    dequantize_o<kInt8>(q, scales, out, out_dtype, n, block, stream);
  } else {
    dequantize_o<kFp8E4M3>(q, scales, out, out_dtype, n, block, stream);
  }
}

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
