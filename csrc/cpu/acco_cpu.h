// CPU kernels of acco_ds (csrc/cpu/acco_cpu.cpp). No torch headers.
#pragma once


#include "../acco_common.h"

namespace acco {
namespace cpu {

// One pass over a flat fp32 shard: Adam(W) update of (master, m, v) from grad,
// the new parameters cast to out_dtype into `out` (may be null, out_dtype -1).
// commit == false ("peek") writes only `out`; master, m and v stay untouched.
void adam_update(float* master, const float* grad, float* m, float* v, void* out, int out_dtype, int64_t n,
                 const AdamScalars& s, bool commit);

}  // namespace cpu
}  // namespace acco
