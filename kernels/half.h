// Scalar conversions between float and the 16-bit storage types (IEEE fp16,
// bfloat16). Round to nearest even; NaN stays NaN; overflow gives infinity.
// The vectorized kernels use F16C for fp16 and must agree with these.
#ifndef KVTIER_KERNELS_HALF_H_
#define KVTIER_KERNELS_HALF_H_

#include <cstdint>
#include <cstring>

namespace kvtier {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t FloatToHalf(float f) {
  const uint32_t x = FloatBits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) {  // Inf or NaN.
    return static_cast<uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0u));
  }
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // Rounds to inf.
  if (absx < 0x38800000u) {                                               // Subnormal or zero.
    // Adding 0.5 makes the FPU round the value to a multiple of 2^-24.
    const float magic = BitsFloat(0x3f000000u);  // 0.5
    const float r = BitsFloat(absx) + magic;
    return static_cast<uint16_t>(sign | (FloatBits(r) - 0x3f000000u));
  }
  const uint32_t mant_odd = (absx >> 13) & 1u;
  uint32_t v = absx + 0xc8000fffu + mant_odd;  // Rebias exponent (-112 << 23), round.
  return static_cast<uint16_t>(sign | (v >> 13));
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24.
    const float f = static_cast<float>(mant) * BitsFloat(0x33800000u);
    return BitsFloat(FloatBits(f) | sign);
  }
  if (exp == 31) return BitsFloat(sign | 0x7f800000u | (mant << 13));
  return BitsFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

inline uint16_t FloatToBf16(float f) {
  const uint32_t x = FloatBits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

inline float Bf16ToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

// Largest finite fp16 value.
inline constexpr float kHalfMax = 65504.0f;

}  // namespace kvtier

#endif  // KVTIER_KERNELS_HALF_H_
