// Launchers of the CUDA kernels (csrc/cuda/acco_cuda_kernels.cu). No torch headers.
#pragma once

#include <cuda_runtime.h>


#include "../acco_common.h"

namespace acco {
namespace cuda {

// AdamW update of a flat shard; see acco::cpu::adam_update.
void adam_update(float* master, const float* grad, float* m, float* v, void* out, int out_dtype, int64_t n,
                 const AdamScalars& s, bool commit, cudaStream_t stream);

// Block quantization and its inverse; see acco::cpu::quantize_pack / dequantize_accumulate.
void quantize_pack(const void* x, int x_dtype, void* residual, int residual_dtype, uint8_t* q, int q_type,
                   float* scales, int64_t n, int64_t block, cudaStream_t stream);
void dequantize_accumulate(const uint8_t* q, int q_type, const float* scales, void* out, int out_dtype, int64_t n,
                           int64_t block, cudaStream_t stream);

}  // namespace cuda
}  // namespace acco
