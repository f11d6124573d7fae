// What the production dequantizer (quant.cc) and the 8-bit codes
// (qmatrix.cc) share of ggml's block layouts. The float64 reference
// (quant_ref.cc) derives the same fields on its own, on purpose.
#ifndef KVTIER_MODEL_QUANT_INTERNAL_H_
#define KVTIER_MODEL_QUANT_INTERNAL_H_

#include <cstdint>
#include <cstring>

#include "kernels/half.h"

namespace kvtier::model::internal {

// The fp16 at p.
inline float HalfAt(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return HalfToFloat(h);
}

// The K types' 6-bit scale and min of sub-block j (0..7), packed in 12 bytes.
inline void ScaleMinK4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

}  // namespace kvtier::model::internal

#endif  // KVTIER_MODEL_QUANT_INTERNAL_H_
