// Helpers of the AVX2 files of model/ (built with -mavx2 -mfma; include only
// from them).
#ifndef KVTIER_MODEL_AVX2_INTERNAL_H_
#define KVTIER_MODEL_AVX2_INTERNAL_H_

#include "kernels/x86_intrinsics.h"

namespace kvtier::model::internal {

// The sum of the 8 lanes, in a fixed order.
inline float Sum8(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace kvtier::model::internal

#endif  // KVTIER_MODEL_AVX2_INTERNAL_H_
