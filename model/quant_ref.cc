// DequantizeRowReference: every weight on its own, in float64, from the
// block layout as published (docs/models.md), without the loop structure of
// the production path, so that the two are independent derivations.
#include <cstring>

#include "kernels/half.h"
#include "model/quant.h"

namespace kvtier::model {
namespace {

double HalfAt(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<double>(HalfToFloat(h));
}

// Nibble k (0..31) of a 16-byte run holding weights k and k + 16 in the low
// and high halves of byte k % 16.
int Nibble32(const uint8_t* qs, int k) { return k < 16 ? qs[k] & 0xF : qs[k - 16] >> 4; }

// Sub-block s's 6-bit scale and min (s in 0..7) in the K types' 12 bytes.
void SixBit(const uint8_t* b, int s, int* sc, int* m) {
  if (s < 4) {
    *sc = b[s] & 63;
    *m = b[s + 4] & 63;
  } else {
    *sc = (b[s + 4] & 15) | ((b[s - 4] >> 6) << 4);
    *m = (b[s + 4] >> 4) | ((b[s] >> 6) << 4);
  }
}

double Weight(GgmlType t, const uint8_t* row, int64_t w) {
  const int bw = BlockWeights(t);
  const uint8_t* b = row + (w / bw) * BlockBytes(t);
  const int k = static_cast<int>(w % bw);
  switch (t) {
    case GgmlType::kF32: {
      float f;
      std::memcpy(&f, b, 4);
      return f;
    }
    case GgmlType::kF16:
      return HalfAt(b);
    case GgmlType::kBF16: {
      uint16_t h;
      std::memcpy(&h, b, 2);
      return static_cast<double>(BitsFloat(static_cast<uint32_t>(h) << 16));
    }
    case GgmlType::kQ4_0:
      return HalfAt(b) * (Nibble32(b + 2, k) - 8);
    case GgmlType::kQ4_1:
      return HalfAt(b) * Nibble32(b + 4, k) + HalfAt(b + 2);
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1: {
      const bool with_min = t == GgmlType::kQ5_1;
      const uint8_t* qh = b + (with_min ? 4 : 2);
      const int high = (qh[k / 8] >> (k % 8)) & 1;
      const int q = Nibble32(qh + 4, k) | (high << 4);
      return with_min ? HalfAt(b) * q + HalfAt(b + 2) : HalfAt(b) * (q - 16);
    }
    case GgmlType::kQ8_0:
      return HalfAt(b) * static_cast<int8_t>(b[2 + k]);
    case GgmlType::kQ2_K: {
      const int half = k / 128, r = k % 128, j = r / 32, l = r % 32;
      const int sc = b[half * 8 + j * 2 + l / 16];
      const int q = (b[16 + half * 32 + l] >> (2 * j)) & 3;
      return HalfAt(b + 80) * (sc & 15) * q - HalfAt(b + 82) * (sc >> 4);
    }
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K: {
      const bool five = t == GgmlType::kQ5_K;
      const int s = k / 32, l = k % 32;
      int sc, m;
      SixBit(b + 4, s, &sc, &m);
      const uint8_t qs = b[(five ? 48 : 16) + (s / 2) * 32 + l];
      int q = s % 2 == 0 ? qs & 0xF : qs >> 4;
      if (five) q += ((b[16 + l] >> s) & 1) * 16;
      return HalfAt(b) * sc * q - HalfAt(b + 2) * m;
    }
    case GgmlType::kQ6_K: {
      const int half = k / 128, r = k % 128, quarter = r / 32, l = r % 32;
      const uint8_t lo = b[half * 64 + (quarter % 2) * 32 + l];
      const int low = quarter < 2 ? lo & 0xF : lo >> 4;
      const int high = (b[128 + half * 32 + l] >> (2 * quarter)) & 3;
      const int sc = static_cast<int8_t>(b[192 + half * 8 + l / 16 + 2 * quarter]);
      return HalfAt(b + 208) * sc * ((low | (high << 4)) - 32);
    }
  }
  return 0;
}

}  // namespace

void DequantizeRowReference(GgmlType t, const void* src, double* dst, int64_t n) {
  const auto* row = static_cast<const uint8_t*>(src);
  for (int64_t w = 0; w < n; ++w) dst[w] = Weight(t, row, w);
}

}  // namespace kvtier::model
