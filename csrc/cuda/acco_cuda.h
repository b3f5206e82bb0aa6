// Launchers of the CUDA kernels (csrc/cuda/acco_cuda_kernels.cu). No torch headers.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "../acco_common.h"

namespace acco {
namespace cuda {

// AdamW update of a flat shard; see acco::cpu::adam_update.
void adam_update(float* master, const float* grad, float* m, float* v, void* out, int out_dtype, int64_t n,
                 const AdamScalars& s, bool commit, cudaStream_t stream);

// Multi-tensor pack / unpack between tensors of mixed dtypes and a flat fp32 buffer.
void pack(const std::vector<FlatItem>& items, float* flat, float scale, bool accumulate, cudaStream_t stream);
void unpack(const float* flat, const std::vector<FlatItem>& items, cudaStream_t stream);

}  // namespace cuda
}  // namespace acco
