// Launchers of the CUDA kernels (csrc/cuda/acco_cuda_kernels.cu). No torch headers.
#pragma once

#include <cuda_runtime.h>


#include "../acco_common.h"

namespace acco {
namespace cuda {

// AdamW update of a flat shard; see acco::cpu::adam_update.
void adam_update(float* master, const float* grad, float* m, float* v, void* out, int out_dtype, int64_t n,
                 const AdamScalars& s, bool commit, cudaStream_t stream);

}  // namespace cuda
}  // namespace acco
