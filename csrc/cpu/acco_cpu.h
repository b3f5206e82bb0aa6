// CPU kernels of acco_ds (csrc/cpu/acco_cpu.cpp). No torch headers.
#pragma once

#include <vector>

#include "../acco_common.h"

namespace acco {
namespace cpu {

// One pass over a flat fp32 shard: Adam(W) update of (master, m, v) from grad,
// the new parameters cast to out_dtype into `out` (may be null, out_dtype -1).
// commit == false ("peek") writes only `out`; master, m and v stay untouched.
void adam_update(float* master, const float* grad, float* m, float* v, void* out, int out_dtype, int64_t n,
                 const AdamScalars& s, bool commit);

// flat[offset_t : offset_t + numel_t] (+)= tensor_t * scale for every item t.
void pack(const std::vector<FlatItem>& items, float* flat, float scale, bool accumulate);

// tensor_t = flat[offset_t : offset_t + numel_t], cast to each tensor's dtype.
void unpack(const float* flat, const std::vector<FlatItem>& items);

}  // namespace cpu
}  // namespace acco
