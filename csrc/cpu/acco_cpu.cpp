// CPU kernels of acco_ds: one OpenMP parallel region per call, inner loops
// specialised per dtype so that they vectorize (build with -fno-math-errno so
// that sqrtf does too, and -ffp-contract=off to keep torch's rounding).
#include "acco_cpu.h"

#include <algorithm>

namespace acco {
namespace cpu {
namespace {

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kMinParallel = 1 << 15;

template <int OutDType, bool Commit>
void adam_pass(float* __restrict master, const float* __restrict grad, float* __restrict m, float* __restrict v,
               void* __restrict out, int64_t n, const AdamScalars s) {
#pragma omp parallel for simd schedule(static) if (n >= kMinParallel)
  for (int64_t i = 0; i < n; ++i) {
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

template <bool Commit>
void adam_dispatch(float* master, const float* grad, float* m, float* v, void* out, int out_dtype, int64_t n,
                   const AdamScalars& s) {
  switch (out_dtype) {
    case kFloat32: return adam_pass<kFloat32, Commit>(master, grad, m, v, out, n, s);
    case kBFloat16: return adam_pass<kBFloat16, Commit>(master, grad, m, v, out, n, s);
    case kFloat16: return adam_pass<kFloat16, Commit>(master, grad, m, v, out, n, s);
    default: if (Commit) adam_pass<-1, true>(master, grad, m, v, out, n, s);  // a peek without out: nothing to do
  }
}

}  // namespace

void adam_update(float* master, const float* grad, float* m, float* v, void* out, int out_dtype, int64_t n,
                 const AdamScalars& s, bool commit) {
  if (commit) {
    adam_dispatch<true>(master, grad, m, v, out, out_dtype, n, s);
  } else {
    adam_dispatch<false>(master, grad, m, v, out, out_dtype, n, s);
  }
}

}  // namespace cpu
}  // namespace acco
