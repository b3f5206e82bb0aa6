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

// Sparse outer communication; see acco::cpu::sparse_pack / sparse_unpack_accumulate. `table` (device memory):
// offsets, entry_starts, byte_starts, chunks + 1 each. value_bits > 0: `values` is zeroed, 4-byte aligned and
// padded to whole 32-bit words (codes are ORed in word by word). Chunks of at most 65536 elements.
void sparse_pack(float* e, const int64_t* table, int64_t chunks, int64_t topk, int value_bits, int16_t* indices,
                 void* values, float* scales, cudaStream_t stream);
// An index past its chunk's end is skipped (the CPU op raises on it).
void sparse_unpack_accumulate(float* out, const int64_t* table, int64_t chunks, const int16_t* indices,
                              const void* values, const float* scales, int value_bits, float weight,
                              cudaStream_t stream);

}  // namespace cuda
}  // namespace acco
