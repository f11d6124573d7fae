// Vectorized codec and attention kernels: AVX2 + FMA + F16C + BMI2. This file
// is compiled with those instruction sets enabled; nothing here may run before
// SimdAvailable() (in codec_ref.cc, built for the baseline ISA) says yes.
//
// Codes of 8 consecutive elements always fill whole bytes (8 * bits bits), so
// a chunk of 8 codes is packed with PEXT and unpacked with PDEP.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/codec_internal.h"
#include "kernels/half.h"
#include "kernels/x86_intrinsics.h"

namespace kvtier::internal {
namespace {

constexpr uint64_t kNibbleMask = 0x0f0f0f0f0f0f0f0full;
constexpr uint64_t kCrumbMask = 0x0303030303030303ull;

inline __m256 LoadCodes8(const uint8_t* codes, int bits, int64_t i) {
  const uint8_t* p = codes + (i * bits) / 8;
  uint64_t u;
  if (bits == 8) {
    std::memcpy(&u, p, 8);
  } else if (bits == 4) {
    uint32_t w;
    std::memcpy(&w, p, 4);
    u = _pdep_u64(w, kNibbleMask);
  } else {
    uint16_t w;
    std::memcpy(&w, p, 2);
    u = _pdep_u64(w, kCrumbMask);
  }
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(u))));
}

inline void StoreCodes8(uint8_t* codes, int bits, int64_t i, __m256i q) {
  const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  const uint64_t u = static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_packus_epi16(w16, w16)));
  uint8_t* p = codes + (i * bits) / 8;
  if (bits == 8) {
    std::memcpy(p, &u, 8);
  } else if (bits == 4) {
    const uint32_t w = static_cast<uint32_t>(_pext_u64(u, kNibbleMask));
    std::memcpy(p, &w, 4);
  } else {
    const uint16_t w = static_cast<uint16_t>(_pext_u64(u, kCrumbMask));
    std::memcpy(p, &w, 2);
  }
}

// Stores 32 consecutive 4-bit codes (elements i..i+31, i even; each qK holds
// 8 of them as int32 in [0, 15]) without PEXT: pack to bytes in order, then
// join byte pairs as lo + 16 * hi with one multiply-add.
inline void StoreCodes32x4(uint8_t* codes, int64_t i, __m256i q0, __m256i q1, __m256i q2,
                           __m256i q3) {
  // Per 128-bit lane: bytes of q0[0-3] q1[0-3] q2[0-3] q3[0-3] | q0[4-7] ...
  const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(q0, q1), _mm256_packus_epi32(q2, q3));
  const __m256i ordered = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  const __m256i pairs = _mm256_maddubs_epi16(ordered, _mm256_set1_epi16(0x1001));
  const __m128i packed =
      _mm_packus_epi16(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i / 2), packed);
}

inline __m256 LoadHalf8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 LoadElems8(v1::DType dtype, const void* base, int64_t index) {
  switch (dtype) {
    case v1::DTYPE_FP16:
      return LoadHalf8(static_cast<const uint16_t*>(base) + index);
    case v1::DTYPE_BF16: {
      const __m128i h = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + index));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    default:
      return _mm256_loadu_ps(static_cast<const float*>(base) + index);
  }
}

inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float HMax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lane k of the result = the smallest (kMax: largest) of v[k]'s eight lanes.
template <bool kMax>
inline __m256 Reduce8MinMax(const __m256* v) {
  const auto op = [](__m256 a, __m256 b) {
    return kMax ? _mm256_max_ps(a, b) : _mm256_min_ps(a, b);
  };
  // Per 128-bit half: lanes (0, 2) and (1, 3) of each pair of inputs...
  __m256 p[4];
  for (int j = 0; j < 4; ++j) {
    p[j] =
        op(_mm256_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm256_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  }
  // ...then all four lanes of the half, four inputs to a vector...
  const __m256 q0 = op(_mm256_shuffle_ps(p[0], p[1], 0x44), _mm256_shuffle_ps(p[0], p[1], 0xee));
  const __m256 q1 = op(_mm256_shuffle_ps(p[2], p[3], 0x44), _mm256_shuffle_ps(p[2], p[3], 0xee));
  // ...then the two halves.
  return op(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

// Rounds scale and zero through fp16 and returns 1/scale (0 when scale is 0).
inline __m256 InvScale(__m256 scale) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.0f), scale);
  return _mm256_blendv_ps(zero, inv, _mm256_cmp_ps(scale, zero, _CMP_GT_OQ));
}

inline __m256i QuantizeChunk(__m256 x, __m256 zero, __m256 inv, __m256 qmax) {
  __m256 q = _mm256_mul_ps(_mm256_sub_ps(x, zero), inv);
  q = _mm256_min_ps(_mm256_max_ps(q, _mm256_setzero_ps()), qmax);
  return _mm256_cvtps_epi32(q);  // Round to nearest even, as the reference.
}

bool Supported(const QuantShape& q) {
  if (q.d % 8 != 0) return false;
  if (!q.key && q.group % 8 != 0 && q.group != q.d) return false;
  return q.bits == 2 || q.bits == 4 || q.bits == 8;
}

// exp(x) for x <= 0 (softmax inputs after subtracting the max): Cephes-style
// range reduction and a degree-6 polynomial; relative error about 2e-7.
inline __m256 Exp(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  __m256 fx =
      _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

}  // namespace

namespace {

// The quantizer over input elements of `kIn` (fp32, or fp16/bf16 read
// directly, without a widened copy).
template <v1::DType kIn>
void QuantizeSlab(const QuantShape& q, const void* x, uint8_t* codes, uint16_t* scales,
                  uint16_t* zeros, uint32_t* max_abs_bits) {
  const int d = q.d;
  auto load = [x](int64_t i) { return LoadElems8(kIn, x, i); };
  // |x| as integer bits, the largest per lane (see FirstOutOfRangeSimd).
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  __m256i amax = _mm256_setzero_si256();
  const bool tracking = max_abs_bits != nullptr;
  auto track = [&](__m256 v) {
    if (tracking) amax = _mm256_max_epu32(amax, _mm256_and_si256(_mm256_castps_si256(v), abs_mask));
  };
  auto report = [&] {
    if (max_abs_bits == nullptr) return;
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), amax);
    for (uint32_t l : lanes) *max_abs_bits = std::max(*max_abs_bits, l);
  };
  const float qmaxf = static_cast<float>((1 << q.bits) - 1);
  const __m256 qmax = _mm256_set1_ps(qmaxf);
  if (q.key) {
    std::vector<float> inv(d), zf(d);
    const int64_t groups = (q.tq + q.group - 1) / q.group;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t t0 = g * q.group;
      const int64_t n = std::min<int64_t>(q.group, q.tq - t0);
      // The next group's rows, a cache line per row every 64 bytes of
      // channels: this pass reads the group column by column, which the
      // hardware prefetcher does not follow far enough ahead.
      const int64_t ahead = std::min<int64_t>(q.group, q.tq - t0 - n);
      const auto* bytes = static_cast<const char*>(x);
      constexpr int kElem = kIn == v1::DTYPE_FP32 ? 4 : 2;
      for (int c = 0; c < d; c += 8) {
        if ((c * kElem) % 64 == 0) {
          for (int64_t j = 0; j < ahead; ++j) {
            _mm_prefetch(bytes + ((t0 + n + j) * d + c) * kElem, _MM_HINT_T0);
          }
        }
        __m256 mn = load(t0 * d + c), mx = mn;
        track(mn);
        for (int64_t j = 1; j < n; ++j) {
          const __m256 v = load((t0 + j) * d + c);
          track(v);
          mn = _mm256_min_ps(mn, v);
          mx = _mm256_max_ps(mx, v);
        }
        const __m128i s16 = _mm256_cvtps_ph(_mm256_div_ps(_mm256_sub_ps(mx, mn), qmax), 0);
        const __m128i z16 = _mm256_cvtps_ph(mn, 0);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(scales + g * d + c), s16);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(zeros + g * d + c), z16);
        _mm256_storeu_ps(inv.data() + c, InvScale(_mm256_cvtph_ps(s16)));
        _mm256_storeu_ps(zf.data() + c, _mm256_cvtph_ps(z16));
      }
      for (int64_t t = t0; t < t0 + n; ++t) {
        const int64_t row = t * d;
        int c = 0;
        if (q.bits == 4) {
          for (; c + 32 <= d; c += 32) {
            __m256i qi[4];
            for (int k = 0; k < 4; ++k) {
              const int ck = c + 8 * k;
              qi[k] = QuantizeChunk(load(row + ck), _mm256_loadu_ps(zf.data() + ck),
                                    _mm256_loadu_ps(inv.data() + ck), qmax);
            }
            StoreCodes32x4(codes, t * d + c, qi[0], qi[1], qi[2], qi[3]);
          }
        }
        for (; c < d; c += 8) {
          const __m256i qi = QuantizeChunk(load(row + c), _mm256_loadu_ps(zf.data() + c),
                                           _mm256_loadu_ps(inv.data() + c), qmax);
          StoreCodes8(codes, q.bits, t * d + c, qi);
        }
      }
    }
    report();
    return;
  }
  // Groups of channels per token, eight (token, group) pairs at a time (they
  // are consecutive in scales and zeros): their minima and maxima reduced
  // together, scales and zeros computed in one vector (the same operations
  // as one at a time, so the same values), then each group quantized.
  // The pairs' token and group advance by counting (a 64-bit division per
  // pair cost as much as its arithmetic).
  const int groups = (d + q.group - 1) / q.group;
  const int64_t pairs = q.tq * groups;
  int64_t start = 0;
  if (q.group == 32 && d % 32 == 0) {
    // KIVI's default: groups of 32 tile each token, so pair i is elements
    // [32i, 32i + 32) and its codes start at byte 4 * bits * i. Whole blocks
    // of eight pairs here, with fixed trip counts; the rest below.
    start = pairs / 8 * 8;
    for (int64_t i0 = 0; i0 < start; i0 += 8) {
      const int64_t e0 = i0 * 32;
      __m256 mn[8], mx[8];
      for (int k = 0; k < 8; ++k) {
        __m256 v[4];
        for (int j = 0; j < 4; ++j) {
          v[j] = load(e0 + 32 * k + 8 * j);
          track(v[j]);
        }
        mn[k] = _mm256_min_ps(_mm256_min_ps(v[0], v[1]), _mm256_min_ps(v[2], v[3]));
        mx[k] = _mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3]));
      }
      const __m256 lo = Reduce8MinMax<false>(mn), hi = Reduce8MinMax<true>(mx);
      const __m128i s16 = _mm256_cvtps_ph(_mm256_div_ps(_mm256_sub_ps(hi, lo), qmax), 0);
      const __m128i z16 = _mm256_cvtps_ph(lo, 0);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(scales + i0), s16);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(zeros + i0), z16);
      alignas(32) float invs[8], zs[8];
      _mm256_store_ps(invs, InvScale(_mm256_cvtph_ps(s16)));
      _mm256_store_ps(zs, _mm256_cvtph_ps(z16));
      for (int k = 0; k < 8; ++k) {
        const __m256 inv = _mm256_broadcast_ss(invs + k), zv = _mm256_broadcast_ss(zs + k);
        const int64_t e = e0 + 32 * k;
        __m256i qi[4];
        for (int j = 0; j < 4; ++j) qi[j] = QuantizeChunk(load(e + 8 * j), zv, inv, qmax);
        if (q.bits == 4) {
          StoreCodes32x4(codes, e, qi[0], qi[1], qi[2], qi[3]);
        } else {
          for (int j = 0; j < 4; ++j) StoreCodes8(codes, q.bits, e + 8 * j, qi[j]);
        }
      }
    }
  }
  int64_t next_t = start / groups;
  int next_g = static_cast<int>(start % groups);
  for (int64_t i0 = start; i0 < pairs; i0 += 8) {
    const int nb = static_cast<int>(std::min<int64_t>(8, pairs - i0));
    __m256 mn[8], mx[8];
    int64_t rows[8];  // Each pair's token's first element.
    int c0s[8];       // Each pair's first channel.
    for (int k = 0; k < 8; ++k) {
      if (k >= nb) {
        mn[k] = mx[k] = _mm256_setzero_ps();
        continue;
      }
      rows[k] = next_t * d;
      c0s[k] = next_g * q.group;
      if (++next_g == groups) {
        next_g = 0;
        ++next_t;
      }
      const int c0 = c0s[k];
      const int c1 = std::min(d, c0 + q.group);
      mn[k] = load(rows[k] + c0);
      mx[k] = mn[k];
      track(mn[k]);
      for (int c = c0 + 8; c < c1; c += 8) {
        const __m256 v = load(rows[k] + c);
        track(v);
        mn[k] = _mm256_min_ps(mn[k], v);
        mx[k] = _mm256_max_ps(mx[k], v);
      }
    }
    const __m256 lo = Reduce8MinMax<false>(mn), hi = Reduce8MinMax<true>(mx);
    const __m128i s16 = _mm256_cvtps_ph(_mm256_div_ps(_mm256_sub_ps(hi, lo), qmax), 0);
    const __m128i z16 = _mm256_cvtps_ph(lo, 0);
    if (nb == 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(scales + i0), s16);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(zeros + i0), z16);
    } else {
      alignas(16) uint16_t sv[8], zv[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(sv), s16);
      _mm_store_si128(reinterpret_cast<__m128i*>(zv), z16);
      for (int k = 0; k < nb; ++k) {
        StoreU16(scales, i0 + k, sv[k]);
        StoreU16(zeros, i0 + k, zv[k]);
      }
    }
    const __m256 invs = InvScale(_mm256_cvtph_ps(s16)), zs = _mm256_cvtph_ps(z16);
    for (int k = 0; k < nb; ++k) {
      const int64_t row = rows[k];
      const int c0 = c0s[k];
      const int c1 = std::min(d, c0 + q.group);
      const __m256i lane = _mm256_set1_epi32(k);
      const __m256 inv = _mm256_permutevar8x32_ps(invs, lane);
      const __m256 zv = _mm256_permutevar8x32_ps(zs, lane);
      int c = c0;
      // 32 codes at a time when they start on a byte (row + c even).
      if (q.bits == 4 && ((row + c) & 1) == 0) {
        for (; c + 32 <= c1; c += 32) {
          StoreCodes32x4(codes, row + c, QuantizeChunk(load(row + c), zv, inv, qmax),
                         QuantizeChunk(load(row + c + 8), zv, inv, qmax),
                         QuantizeChunk(load(row + c + 16), zv, inv, qmax),
                         QuantizeChunk(load(row + c + 24), zv, inv, qmax));
        }
      }
      for (; c < c1; c += 8) {
        StoreCodes8(codes, q.bits, row + c, QuantizeChunk(load(row + c), zv, inv, qmax));
      }
    }
  }
  report();
}

}  // namespace

bool QuantizeSlabSimd(const QuantShape& q, const float* x, uint8_t* codes, uint16_t* scales,
                      uint16_t* zeros, uint32_t* max_abs_bits) {
  if (!SimdAvailable() || !Supported(q)) return false;
  QuantizeSlab<v1::DTYPE_FP32>(q, x, codes, scales, zeros, max_abs_bits);
  return true;
}

bool QuantizeSlab16Simd(const QuantShape& q, const uint16_t* x, bool bf16, uint8_t* codes,
                        uint16_t* scales, uint16_t* zeros, uint32_t* max_abs_bits) {
  if (!SimdAvailable() || !Supported(q)) return false;
  if (bf16) {
    QuantizeSlab<v1::DTYPE_BF16>(q, x, codes, scales, zeros, max_abs_bits);
  } else {
    QuantizeSlab<v1::DTYPE_FP16>(q, x, codes, scales, zeros, max_abs_bits);
  }
  return true;
}

bool FirstOutOfRangeSimd(const float* x, int64_t n, float limit, int64_t* first) {
  if (!SimdAvailable()) return false;
  // |x| as integer bits orders like |x|, with Inf and NaN above every finite
  // value: one unsigned max per block, and a scan only of a block that fails.
  uint32_t limit_bits;
  std::memcpy(&limit_bits, &limit, 4);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  constexpr int64_t kBlock = 256;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    int64_t i = b;
    __m256i m = _mm256_setzero_si256();
    for (; i + 8 <= e; i += 8) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      m = _mm256_max_epu32(m, _mm256_and_si256(v, abs_mask));
    }
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m);
    uint32_t mx = 0;
    for (uint32_t l : lanes) mx = std::max(mx, l);
    for (; i < e; ++i) {
      uint32_t u;
      std::memcpy(&u, x + i, 4);
      mx = std::max(mx, u & 0x7fffffffu);
    }
    if (mx <= limit_bits) continue;
    for (int64_t j = b; j < e; ++j) {
      if (!(std::fabs(x[j]) <= limit)) {
        *first = j;
        return true;
      }
    }
  }
  *first = -1;
  return true;
}

bool WidenSimd(const uint16_t* x, bool bf16, int64_t n, float* out) {
  if (!SimdAvailable()) return false;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    const __m256 f = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                          : _mm256_cvtph_ps(h);
    _mm256_storeu_ps(out + i, f);
  }
  for (; i < n; ++i) out[i] = bf16 ? Bf16ToFloat(LoadU16(x, i)) : HalfToFloat(LoadU16(x, i));
  return true;
}

bool AxpySimd(float a, const float* x, int64_t n, float* y) {
  if (!SimdAvailable()) return false;
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += a * x[i];
  return true;
}

bool DotSimd(const float* x, const float* y, int64_t n, float* dot) {
  if (!SimdAvailable()) return false;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8), a1);
  }
  for (; i + 8 <= n; i += 8)
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), a0);
  float sum = HSum(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) sum += x[i] * y[i];
  *dot = sum;
  return true;
}

bool DequantRowsSimd(const QuantShape& q, const uint8_t* codes, const uint16_t* scales,
                     const uint16_t* zeros, int64_t t0, int64_t t1, float* out) {
  if (!SimdAvailable() || !Supported(q)) return false;
  const int d = q.d;
  if (q.key) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t / q.group;
      float* o = out + (t - t0) * d;
      for (int c = 0; c < d; c += 8) {
        const __m256 v =
            _mm256_fmadd_ps(LoadCodes8(codes, q.bits, t * d + c), LoadHalf8(scales + g * d + c),
                            LoadHalf8(zeros + g * d + c));
        _mm256_storeu_ps(o + c, v);
      }
    }
    return true;
  }
  const int groups = (d + q.group - 1) / q.group;
  for (int64_t t = t0; t < t1; ++t) {
    float* o = out + (t - t0) * d;
    for (int g = 0; g < groups; ++g) {
      const __m256 sv = _mm256_set1_ps(_cvtsh_ss(LoadU16(scales, t * groups + g)));
      const __m256 zv = _mm256_set1_ps(_cvtsh_ss(LoadU16(zeros, t * groups + g)));
      const int c1 = std::min(d, (g + 1) * q.group);
      for (int c = g * q.group; c < c1; c += 8) {
        _mm256_storeu_ps(o + c, _mm256_fmadd_ps(LoadCodes8(codes, q.bits, t * d + c), sv, zv));
      }
    }
  }
  return true;
}

namespace {

// scores[r][t] = scale * q[r] . row_t over `n` raw rows, R query heads at once.
template <int R>
void ScoreRaw(v1::DType dtype, const void* base, int64_t first, int64_t token_stride, int64_t n,
              int d, const float* const* q, float scale, float* const* scores) {
  for (int64_t t = 0; t < n; ++t) {
    __m256 acc[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const int64_t row = first + t * token_stride;
    for (int c = 0; c < d; c += 8) {
      const __m256 k = LoadElems8(dtype, base, row + c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(k, _mm256_loadu_ps(q[r] + c), acc[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) scores[r][t] = scale * HSum(acc[r]);
  }
}

// The same over the quantized part of a KIVI/KCVT key slab (groups of tokens
// per channel): q.k_t = sum_c (q_c * s_gc) * code_tc + sum_c q_c * z_gc.
template <int R>
void ScoreKivi(const EncodedView& k, int64_t s, const float* const* q, float scale,
               float* const* scores) {
  const int d = k.head_dim;
  const uint8_t* codes = k.codes + s * k.words_per_slab * 4;
  const uint16_t* sc = k.scales + s * k.groups_per_slab;
  const uint16_t* zc = k.zeros + s * k.groups_per_slab;
  std::vector<float> qs(static_cast<size_t>(R) * d);
  const int64_t groups = (k.quantized + k.group - 1) / k.group;
  for (int64_t g = 0; g < groups; ++g) {
    float bias[R];
    for (int r = 0; r < R; ++r) {
      __m256 b = _mm256_setzero_ps();
      const __m256 sv = _mm256_set1_ps(scale);
      for (int c = 0; c < d; c += 8) {
        const __m256 qv = _mm256_mul_ps(_mm256_loadu_ps(q[r] + c), sv);
        _mm256_storeu_ps(qs.data() + r * d + c, _mm256_mul_ps(qv, LoadHalf8(sc + g * d + c)));
        b = _mm256_fmadd_ps(qv, LoadHalf8(zc + g * d + c), b);
      }
      bias[r] = HSum(b);
    }
    const int64_t t0 = g * k.group;
    const int64_t t1 = std::min(k.quantized, t0 + k.group);
    for (int64_t t = t0; t < t1; ++t) {
      __m256 acc[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      for (int c = 0; c < d; c += 8) {
        const __m256 code = LoadCodes8(codes, k.bits, t * d + c);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm256_fmadd_ps(code, _mm256_loadu_ps(qs.data() + r * d + c), acc[r]);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) scores[r][t] = bias[r] + HSum(acc[r]);
    }
  }
}

// Tokens per tile of P.V: a tile of V rows stays in L1 while every channel
// pair of it is accumulated in registers.
constexpr int64_t kAccumTile = 64;

template <int R>
void AccumRaw(v1::DType dtype, const void* base, int64_t first, int64_t token_stride, int64_t n,
              int d, const float* const* p, float* const* out) {
  for (int64_t t0 = 0; t0 < n; t0 += kAccumTile) {
    const int64_t t1 = std::min(n, t0 + kAccumTile);
    int c = 0;
    for (; c + 16 <= d; c += 16) {
      __m256 a0[R], a1[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t row = first + t * token_stride + c;
        const __m256 v0 = LoadElems8(dtype, base, row), v1 = LoadElems8(dtype, base, row + 8);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256 pv = _mm256_broadcast_ss(p[r] + t);
          a0[r] = _mm256_fmadd_ps(pv, v0, a0[r]);
          a1[r] = _mm256_fmadd_ps(pv, v1, a1[r]);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(out[r] + c, _mm256_add_ps(a0[r], _mm256_loadu_ps(out[r] + c)));
        _mm256_storeu_ps(out[r] + c + 8, _mm256_add_ps(a1[r], _mm256_loadu_ps(out[r] + c + 8)));
      }
    }
    for (; c < d; c += 8) {
      __m256 a0[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) a0[r] = _mm256_setzero_ps();
      for (int64_t t = t0; t < t1; ++t) {
        const __m256 v0 = LoadElems8(dtype, base, first + t * token_stride + c);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
          a0[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p[r] + t), v0, a0[r]);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(out[r] + c, _mm256_add_ps(a0[r], _mm256_loadu_ps(out[r] + c)));
      }
    }
  }
}

// P.V over a KIVI/KCVT value slab (groups of channels per token):
// out_c += sum_t (p_t * s_tg) * code_tc + sum_t p_t * z_tg.
template <int R>
void AccumKivi(const EncodedView& v, int64_t s, const float* const* p, float* const* out) {
  const int d = v.head_dim;
  const int groups = (d + v.group - 1) / v.group;
  const uint8_t* codes = v.codes + s * v.words_per_slab * 4;
  const uint16_t* sc = v.scales + s * v.groups_per_slab;
  const uint16_t* zc = v.zeros + s * v.groups_per_slab;
  std::vector<float> zacc(static_cast<size_t>(R) * groups, 0.0f);
  // p_t * s_tg for the tile, [R][tile][groups].
  std::vector<float> ps(static_cast<size_t>(R) * kAccumTile * groups);
  for (int64_t t0 = 0; t0 < v.quantized; t0 += kAccumTile) {
    const int64_t t1 = std::min(v.quantized, t0 + kAccumTile);
    for (int64_t t = t0; t < t1; ++t) {
      for (int g = 0; g < groups; ++g) {
        const float sg = _cvtsh_ss(LoadU16(sc, t * groups + g));
        const float zg = _cvtsh_ss(LoadU16(zc, t * groups + g));
        for (int r = 0; r < R; ++r) {
          ps[(r * kAccumTile + (t - t0)) * groups + g] = p[r][t] * sg;
          zacc[r * groups + g] += p[r][t] * zg;
        }
      }
    }
    for (int c = 0; c < d; c += 8) {
      const int g = c / v.group;
      __m256 a0[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) a0[r] = _mm256_setzero_ps();
      for (int64_t t = t0; t < t1; ++t) {
        const __m256 code = LoadCodes8(codes, v.bits, t * d + c);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          a0[r] = _mm256_fmadd_ps(
              _mm256_broadcast_ss(&ps[(r * kAccumTile + (t - t0)) * groups + g]), code, a0[r]);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(out[r] + c, _mm256_add_ps(a0[r], _mm256_loadu_ps(out[r] + c)));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < d; ++c) out[r][c] += zacc[r * groups + c / v.group];
  }
}

// --- Integer dot products for 2- and 4-bit codes ---
//
// 32 consecutive codes (elements i..i+31, i a multiple of 32) unpack to one
// vector of bytes in "lane order": with e = 8 / bits codes per byte and
// nb = 32 / e bytes per chunk, byte k * nb + j holds element e * j + k. That
// order costs one broadcast, one variable shift and one mask; the int8
// operand on the other side of a vpmaddubsw is put in the same order once per
// group, and P.V's outputs are put back in element order once per block.

inline int LaneElem(int bits, int pos) {
  const int e = 8 / bits, nb = 32 / e;
  return e * (pos % nb) + pos / nb;
}

// The 32 codes from p (whole bytes: 16 of them at 4 bits, 8 at 2).
template <int kBits>
inline __m256i Unpack32(const uint8_t* p) {
  if constexpr (kBits == 4) {
    const __m256i x =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_and_si256(_mm256_srlv_epi64(x, _mm256_setr_epi64x(0, 0, 4, 4)),
                            _mm256_set1_epi8(0x0f));
  } else {
    int64_t u;
    std::memcpy(&u, p, 8);
    return _mm256_and_si256(
        _mm256_srlv_epi64(_mm256_set1_epi64x(u), _mm256_setr_epi64x(0, 2, 4, 6)),
        _mm256_set1_epi8(0x03));
  }
}

// Lane i of the result = the sum of v[i]'s eight int32 lanes.
inline __m256i Reduce8(const __m256i* v) {
  const __m256i g0 =
      _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i g1 =
      _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20),
                          _mm256_permute2x128_si256(g0, g1, 0x31));
}

// Whether the integer kernels take the quantized part of `b`.
bool IntPath(const EncodedView& b) {
  if (b.codec != v1::CODEC_KIVI && b.codec != v1::CODEC_KCVT) return false;
  if (b.bits != 2 && b.bits != 4) return false;
  if (b.head_dim % 32 != 0 || b.head_dim > 1024) return false;
  if (b.role == v1::TENSOR_ROLE_VALUE) {
    if (b.group % 32 != 0 || b.head_dim % b.group != 0) return false;
    const int groups = b.head_dim / b.group;
    return 8 % groups == 0;
  }
  return b.group >= 1;
}

// Shared by the integer q.K^T kernels. qs[r] = scale * q[r].
template <int R>
void ScaleQueries(const float* const* q, float scale, int d, float (*qs)[1024]) {
  const __m256 sv = _mm256_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < d; c += 8)
      _mm256_store_ps(qs[r] + c, _mm256_mul_ps(_mm256_loadu_ps(q[r] + c), sv));
  }
}

// One K group's weights for one query head: w_c = qs_c * s_gc into `w`;
// returns max |w| and sets *bias = sum_c qs_c * z_gc.
inline float GroupWeights(const float* qs, const uint16_t* sc, const uint16_t* zc, int64_t g, int d,
                          float* w, float* bias) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  // Two chains of sums and maxima (d is a multiple of 16 here), so that
  // they do not wait on each other's latency.
  // (Named, not an array indexed by c: an indexed array lived in memory, and
  // each step waited on the last one's store.)
  __m256 b0 = _mm256_setzero_ps(), b1 = b0, mx0 = b0, mx1 = b0;
  for (int c = 0; c < d; c += 16) {
    const __m256 q0 = _mm256_load_ps(qs + c), q1 = _mm256_load_ps(qs + c + 8);
    const __m256 w0 = _mm256_mul_ps(q0, LoadHalf8(sc + g * d + c));
    const __m256 w1 = _mm256_mul_ps(q1, LoadHalf8(sc + g * d + c + 8));
    _mm256_store_ps(w + c, w0);
    _mm256_store_ps(w + c + 8, w1);
    mx0 = _mm256_max_ps(mx0, _mm256_and_ps(w0, abs_mask));
    mx1 = _mm256_max_ps(mx1, _mm256_and_ps(w1, abs_mask));
    b0 = _mm256_fmadd_ps(q0, LoadHalf8(zc + g * d + c), b0);
    b1 = _mm256_fmadd_ps(q1, LoadHalf8(zc + g * d + c + 8), b1);
  }
  *bias = HSum(_mm256_add_ps(b0, b1));
  return HMax(_mm256_max_ps(mx0, mx1));
}

// Scores of tokens t .. t+n-1 (n <= 8) for each query head: a * the integer
// sums in tok[r][0..7] (one int32 vector per token) + bias.
template <int R>
void StoreScores8(const __m256i (*tok)[8], const float* a, const float* bias, int64_t t, int n,
                  float* const* scores) {
  for (int r = 0; r < R; ++r) {
    const __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Reduce8(tok[r])), _mm256_set1_ps(a[r]),
                                     _mm256_set1_ps(bias[r]));
    if (n == 8) {
      _mm256_storeu_ps(scores[r] + t, f);
    } else {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, f);
      std::memcpy(scores[r] + t, tmp, sizeof(float) * n);
    }
  }
}

// --- q.K^T with int16 weights (every AVX2 CPU) ---
//
// Per K group and query head, w_c = scale * q_c * s_gc is rounded to int16
// against a = max|w| / 32767, so q.k_t = a * sum_c w16_c * code_tc +
// sum_c scale * q_c * z_gc; w's rounding error times the mid code (the same
// for every token of the group) is added back exactly. A token's codes are
// taken 16 bytes at a time (a block of 16 * e channels, e = 8 / bits codes
// per byte), widened to int16 with one vpmovzxbw, and split by a shift and a
// mask into e vectors: vector k holds the channels e * j + k (j = 0..15),
// each multiplied by its weights and pair-summed into int32 with one
// vpmaddwd per query head. The weights are put in that order once per group.
// Sums stay exact in int32 for head_dim <= 1024 at 2 and 4 bits and <= 256
// at 8 bits (IntKeyPath).

// Whether ScoreKiviInt16 takes the quantized part of a K slab.
bool IntKeyPath(const EncodedView& k) {
  if (k.codec != v1::CODEC_KIVI && k.codec != v1::CODEC_KCVT) return false;
  if (k.role == v1::TENSOR_ROLE_VALUE || k.group < 1) return false;
  if (k.bits == 8) return k.head_dim % 16 == 0 && k.head_dim <= 256;
  return (k.bits == 2 || k.bits == 4) && k.head_dim % 32 == 0 && k.head_dim <= 1024;
}

// Rounds 8 weights times `inv` to integers (as floats), adding what the
// rounding dropped to *err.
inline __m256 RoundWeights(const float* w, __m256 inv, __m256* err) {
  const __m256 x = _mm256_mul_ps(_mm256_load_ps(w), inv);
  const __m256 r = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  *err = _mm256_add_ps(*err, _mm256_sub_ps(x, r));
  return r;
}

// One K group's int16 weights for every query head, in the codes' order
// (see above), into w16[r]; a[r] and bias[r] as above.
template <int R, int kBits>
inline void KeyGroupInt16Avx2(const float (*qs)[1024], const uint16_t* sc, const uint16_t* zc,
                              int64_t g, int d, int16_t (*w16)[1024], float* a, float* bias) {
  constexpr int e = 8 / kBits, block = 16 * e;
  // w is padded with zeros to a whole block (2-bit: head_dim 32 mod 64).
  alignas(32) float w[1024 + 64];
  const int padded = (d + block - 1) / block * block;
  std::fill(w + d, w + padded, 0.0f);
  constexpr float kMid = static_cast<float>((1 << kBits) - 1) / 2;
  for (int r = 0; r < R; ++r) {
    float zero_part = 0;
    const float amax = GroupWeights(qs[r], sc, zc, g, d, w, &zero_part);
    a[r] = amax / 32767.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    __m256 err0 = _mm256_setzero_ps(), err1 = err0;
    for (int b0 = 0; b0 < padded; b0 += block) {
      __m256i* out = reinterpret_cast<__m256i*>(w16[r] + b0);
      if constexpr (e == 1) {
        // Channel order. packs works per 128-bit lane; the qword permute
        // restores the order.
        const __m256 v0 = RoundWeights(w + b0, inv, &err0);
        const __m256 v1 = RoundWeights(w + b0 + 8, inv, &err1);
        _mm256_store_si256(
            out, _mm256_permute4x64_epi64(
                     _mm256_packs_epi32(_mm256_cvtps_epi32(v0), _mm256_cvtps_epi32(v1)), 0xd8));
      } else if constexpr (e == 2) {
        // Even channels, then odd. Per 128-bit lane, shuffle_ps takes
        // channels (0, 2, 8, 10 | 4, 6, 12, 14) of v0, v1 (0xdd: the odd
        // ones); packs and a dword permute put them in order.
        __m256 v[4];
        for (int i = 0; i < 4; ++i) v[i] = RoundWeights(w + b0 + 8 * i, inv, i % 2 ? &err1 : &err0);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        const auto pick = [&](int imm_even) {
          const __m256 lo =
              imm_even ? _mm256_shuffle_ps(v[0], v[1], 0x88) : _mm256_shuffle_ps(v[0], v[1], 0xdd);
          const __m256 hi =
              imm_even ? _mm256_shuffle_ps(v[2], v[3], 0x88) : _mm256_shuffle_ps(v[2], v[3], 0xdd);
          return _mm256_permutevar8x32_epi32(
              _mm256_packs_epi32(_mm256_cvtps_epi32(lo), _mm256_cvtps_epi32(hi)), order);
        };
        _mm256_store_si256(out, pick(1));
        _mm256_store_si256(out + 1, pick(0));
      } else {
        // Channels 4j + k for k = 0..3: a 4x4 transpose per 128-bit lane of
        // v0..v3 (j = 0, 2, 4, 6 | 1, 3, 5, 7) and of v4..v7 (j + 8), packed
        // (j = 0, 2, .., 14 | 1, 3, .., 15), then qwords and words reordered.
        __m256 v[8];
        for (int i = 0; i < 8; ++i) v[i] = RoundWeights(w + b0 + 8 * i, inv, i % 2 ? &err1 : &err0);
        __m256i t[2][4];
        for (int h = 0; h < 2; ++h) {
          const __m256* x = v + 4 * h;
          const __m256 l01 = _mm256_unpacklo_ps(x[0], x[1]), l23 = _mm256_unpacklo_ps(x[2], x[3]);
          const __m256 h01 = _mm256_unpackhi_ps(x[0], x[1]), h23 = _mm256_unpackhi_ps(x[2], x[3]);
          t[h][0] = _mm256_cvtps_epi32(_mm256_shuffle_ps(l01, l23, 0x44));
          t[h][1] = _mm256_cvtps_epi32(_mm256_shuffle_ps(l01, l23, 0xee));
          t[h][2] = _mm256_cvtps_epi32(_mm256_shuffle_ps(h01, h23, 0x44));
          t[h][3] = _mm256_cvtps_epi32(_mm256_shuffle_ps(h01, h23, 0xee));
        }
        const __m256i words =
            _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15, 0, 1, 8, 9, 2, 3,
                             10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
        for (int k = 0; k < 4; ++k) {
          const __m256i p = _mm256_packs_epi32(t[0][k], t[1][k]);
          _mm256_store_si256(out + k,
                             _mm256_shuffle_epi8(_mm256_permute4x64_epi64(p, 0xd8), words));
        }
      }
    }
    bias[r] = zero_part + kMid * a[r] * HSum(_mm256_add_ps(err0, err1));
  }
}

// Scores over the quantized part of a KIVI/KCVT key slab (see above).
template <int R, int kBits>
void ScoreKiviInt16(const EncodedView& k, int64_t s, const float* const* q, float scale,
                    float* const* scores) {
  constexpr int e = 8 / kBits, block = 16 * e;
  const int d = k.head_dim;
  const int64_t row_bytes = d * kBits / 8;
  const uint8_t* codes = k.codes + s * k.words_per_slab * 4;
  const uint16_t* sc = k.scales + s * k.groups_per_slab;
  const uint16_t* zc = k.zeros + s * k.groups_per_slab;
  alignas(32) int16_t w16[R][1024];
  alignas(32) float qs[R][1024];
  float a[R], bias[R];
  const __m256i mask = _mm256_set1_epi16((1 << kBits) - 1);
  const int whole = d / block * block;  // Channels in whole 16-byte blocks.
  const int64_t groups = (k.quantized + k.group - 1) / k.group;
  ScaleQueries<R>(q, scale, d, qs);
  for (int64_t g = 0; g < groups; ++g) {
    KeyGroupInt16Avx2<R, kBits>(qs, sc, zc, g, d, w16, a, bias);
    const int64_t t0 = g * k.group;
    const int64_t t1 = std::min(k.quantized, t0 + k.group);
    for (int64_t t = t0; t < t1; t += 8) {
      const int n = static_cast<int>(std::min<int64_t>(8, t1 - t));
      __m256i tok[R][8];
      for (int u = 0; u < 8; ++u) {
        __m256i acc[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
        if (u < n) {
          const uint8_t* row = codes + (t + u) * row_bytes;
          // The codes 16 tokens on, while these are computed.
          if (t + u + 16 < k.quantized) {
            _mm_prefetch(reinterpret_cast<const char*>(row + 16 * row_bytes), _MM_HINT_T0);
          }
          const auto products = [&](int b0, __m128i bytes) {
            const __m256i x16 = _mm256_cvtepu8_epi16(bytes);
#pragma GCC unroll 4
            for (int kk = 0; kk < e; ++kk) {
              const __m256i x = kBits == 8 ? x16
                                : kk == e - 1
                                    ? _mm256_srli_epi16(x16, kk * kBits)
                                    : _mm256_and_si256(_mm256_srli_epi16(x16, kk * kBits), mask);
#pragma GCC unroll 4
              for (int r = 0; r < R; ++r) {
                acc[r] = _mm256_add_epi32(
                    acc[r], _mm256_madd_epi16(x, _mm256_load_si256(reinterpret_cast<const __m256i*>(
                                                     w16[r] + b0 + 16 * kk))));
              }
            }
          };
          for (int b0 = 0; b0 < whole; b0 += block) {
            products(b0, _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b0 * kBits / 8)));
          }
          // 2-bit with head_dim 32 mod 64: a last block of 8 bytes (the rest
          // of its lanes are zero codes).
          if (whole < d) {
            products(whole,
                     _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + whole * kBits / 8)));
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) tok[r][u] = acc[r];
      }
      StoreScores8<R>(tok, a, bias, t, n, scores);
    }
  }
}

template <int R>
void ScoreKiviInt(const EncodedView& k, int64_t s, const float* const* q, float scale,
                  float* const* scores) {
  switch (k.bits) {
    case 2:
      ScoreKiviInt16<R, 2>(k, s, q, scale, scores);
      break;
    case 4:
      ScoreKiviInt16<R, 4>(k, s, q, scale, scores);
      break;
    default:
      ScoreKiviInt16<R, 8>(k, s, q, scale, scores);
      break;
  }
}

// --- The same products with AVX-512 VNNI (vpdpbusd, 256-bit, EVEX) ---
//
// vpdpbusd multiplies 32 u8 x s8 pairs, adds each four adjacent products and
// accumulates into int32 in one instruction: no int16 sums to widen, no
// limit on how many are added. These functions are compiled for the VNNI
// CPUs (AVX512F/BW/VL/VNNI/VBMI: Ice Lake and Zen 4 on) and run only where
// VnniAvailable() says so; everything they call is inlined from the AVX2 code
// above.
#define KVT_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")))

// Whether ScoreKiviVnni takes the quantized part of a K slab: IntPath's
// shapes with head_dim a multiple of one block (256 / bits channels: 32
// bytes of codes).
bool VnniKeyPath(const EncodedView& k) {
  return IntPath(k) && k.role != v1::TENSOR_ROLE_VALUE && k.head_dim % (256 / k.bits) == 0;
}

// One K group's weights for every query head as int16, in block order:
// w_c = scale * q_c * s_gc rounded against a[r] = max |w| / 32767 (one
// rounding, where the AVX2 path needs a high and a low byte). A block of
// e * 32 channels (e = 8 / bits codes per byte) is e vectors of 32: vector k
// lane i holds channel e * i + k, the order in which ScoreKiviVnni takes the
// codes out of their bytes. bias[r] = sum_c scale * q_c * z_gc plus the
// rounding error times the mid code, which is the same for every token of
// the group.
template <int R>
KVT_VNNI_TARGET inline void KeyGroupInt16(const float (*qs)[1024], const uint16_t* sc,
                                          const uint16_t* zc, int64_t g, int d, int bits,
                                          const __m512i* order, int16_t (*w16)[1024], float* a,
                                          float* bias) {
  alignas(64) float w[1024];
  const int e = 8 / bits, block = 32 * e;
  const float mid = static_cast<float>((1 << bits) - 1) / 2;
  const __m256i* s16 = reinterpret_cast<const __m256i*>(sc + g * d);
  const __m256i* z16 = reinterpret_cast<const __m256i*>(zc + g * d);
  for (int r = 0; r < R; ++r) {
    __m512 b[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    __m512 mx[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int c = 0; c < d; c += 16) {
      const int i = (c / 16) % 2;
      const __m512 qv = _mm512_load_ps(qs[r] + c);
      const __m512 wv = _mm512_mul_ps(qv, _mm512_cvtph_ps(_mm256_loadu_si256(s16 + c / 16)));
      _mm512_store_ps(w + c, wv);
      mx[i] = _mm512_max_ps(mx[i], _mm512_abs_ps(wv));
      b[i] = _mm512_fmadd_ps(qv, _mm512_cvtph_ps(_mm256_loadu_si256(z16 + c / 16)), b[i]);
    }
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(mx[0], mx[1]));
    a[r] = amax / 32767.0f;
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    __m512 err[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int b0 = 0; b0 < d; b0 += block) {
      // The block's int16 weights in channel order, 32 per vector (e of them).
      __m512i h[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                      _mm512_setzero_si512()};
      for (int m = 0; m < e; ++m) {
        const __m512 x0 = _mm512_mul_ps(_mm512_load_ps(w + b0 + 32 * m), inv);
        const __m512 x1 = _mm512_mul_ps(_mm512_load_ps(w + b0 + 32 * m + 16), inv);
        const __m512i i0 = _mm512_cvtps_epi32(x0), i1 = _mm512_cvtps_epi32(x1);
        err[0] = _mm512_add_ps(err[0], _mm512_sub_ps(x0, _mm512_cvtepi32_ps(i0)));
        err[1] = _mm512_add_ps(err[1], _mm512_sub_ps(x1, _mm512_cvtepi32_ps(i1)));
        h[m] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(i0)),
                                  _mm512_cvtepi32_epi16(i1), 1);
      }
      for (int k = 0; k < e; ++k) {
        __m512i out = _mm512_permutex2var_epi16(h[0], order[k], h[1]);
        if (bits == 2) {
          // Lanes 0-15 from the first 64 channels, 16-31 from the next.
          out = _mm512_inserti64x4(
              out, _mm512_castsi512_si256(_mm512_permutex2var_epi16(h[2], order[k], h[3])), 1);
        }
        _mm512_store_si512(w16[r] + b0 + 32 * k, out);
      }
    }
    bias[r] = _mm512_reduce_add_ps(_mm512_add_ps(b[0], b[1])) +
              mid * a[r] * _mm512_reduce_add_ps(_mm512_add_ps(err[0], err[1]));
  }
}

// ScoreKiviInt with int16 weights (KeyGroupInt16) and vpdpwssd over 512-bit
// vectors: a token's codes are taken 32 bytes at a time, widened to int16
// and split into e vectors of 32 codes, each multiplied and summed in one
// instruction per query head (int32 sums: at most 1024 * 15 * 32767 < 2^31).
template <int R>
KVT_VNNI_TARGET void ScoreKiviVnni(const EncodedView& k, int64_t s, const float* const* q,
                                   float scale, float* const* scores) {
  const int d = k.head_dim, bits = k.bits, e = 8 / bits, block = 32 * e;
  const int64_t row_bytes = d * bits / 8;
  const uint8_t* codes = k.codes + s * k.words_per_slab * 4;
  const uint16_t* sc = k.scales + s * k.groups_per_slab;
  const uint16_t* zc = k.zeros + s * k.groups_per_slab;
  alignas(64) int16_t w16[R][1024];
  alignas(64) float qs[R][1024];
  float a[R], bias[R];
  __m512i order[4];
  for (int kk = 0; kk < e; ++kk) {
    alignas(64) int16_t ix[32];
    for (int i = 0; i < 32; ++i) ix[i] = static_cast<int16_t>((e * i + kk) % 64);
    order[kk] = _mm512_load_si512(ix);
  }
  const __m512i mask = _mm512_set1_epi16(static_cast<int16_t>((1 << bits) - 1));
  const int64_t groups = (k.quantized + k.group - 1) / k.group;
  ScaleQueries<R>(q, scale, d, qs);
  for (int64_t g = 0; g < groups; ++g) {
    KeyGroupInt16<R>(qs, sc, zc, g, d, bits, order, w16, a, bias);
    const int64_t t0 = g * k.group;
    const int64_t t1 = std::min(k.quantized, t0 + k.group);
    for (int64_t t = t0; t < t1; t += 8) {
      const int n = static_cast<int>(std::min<int64_t>(8, t1 - t));
      __m256i tok[R][8];
      for (int u = 0; u < 8; ++u) {
        __m512i acc[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
        if (u < n) {
          const uint8_t* row = codes + (t + u) * row_bytes;
          // The codes 16 tokens on, while these are computed.
          if (t + u + 16 < k.quantized) {
            _mm_prefetch(reinterpret_cast<const char*>(row + 16 * row_bytes), _MM_HINT_T0);
          }
          for (int b0 = 0; b0 < d; b0 += block) {
            const __m512i x16 = _mm512_cvtepu8_epi16(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b0 * bits / 8)));
            for (int kk = 0; kk < e; ++kk) {
              const __m512i x = _mm512_and_si512(_mm512_srli_epi16(x16, kk * bits), mask);
#pragma GCC unroll 4
              for (int r = 0; r < R; ++r) {
                acc[r] = _mm512_dpwssd_epi32(acc[r], x, _mm512_load_si512(w16[r] + b0 + 32 * kk));
              }
            }
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          tok[r][u] = _mm256_add_epi32(_mm512_castsi512_si256(acc[r]),
                                       _mm512_extracti64x4_epi64(acc[r], 1));
        }
      }
      StoreScores8<R>(tok, a, bias, t, n, scores);
    }
  }
}

// Whether AccumKivi8Int takes the quantized part of a V slab: 8-bit codes,
// head_dim a multiple of 16, channel groups of a multiple of 16.
bool Int16ValuePath(const EncodedView& v) {
  if (v.codec != v1::CODEC_KIVI && v.codec != v1::CODEC_KCVT) return false;
  return v.bits == 8 && v.role == v1::TENSOR_ROLE_VALUE && v.head_dim % 16 == 0 &&
         v.group % 16 == 0 && v.head_dim <= 1024;
}

// P.V over 8-bit V codes with int16 products: per tile of kAccumTile tokens,
// V group and query head, u_t = p_t * s_tg is rounded against
// a = max_t |u_t| / 32767, and out_c += a * sum_t u16_t * code_tc +
// sum_t p_t * z_tg. Two tokens' codes are interleaved and widened to int16
// so that one vpmaddwd adds both tokens' products for 8 channels (int32
// sums exact: 64 * 255 * 32767 < 2^31). u's rounding error times the mid
// code (127.5) is the same for every channel of the group and is added
// back exactly.
template <int R>
void AccumKivi8Int(const EncodedView& v, int64_t s, const float* const* p, float* const* out) {
  const int d = v.head_dim;
  const int groups = d / v.group;
  const uint8_t* codes = v.codes + s * v.words_per_slab * 4;
  const uint16_t* sc = v.scales + s * v.groups_per_slab;
  const uint16_t* zc = v.zeros + s * v.groups_per_slab;
  constexpr float kMid = 127.5f;
  constexpr int64_t kPairs = kAccumTile / 2;
  std::vector<float> zacc(static_cast<size_t>(R) * groups, 0.0f);
  // Per query head and group: both tokens of each pair as one int32.
  std::vector<int32_t> pairs(static_cast<size_t>(R) * groups * kPairs);
  std::vector<float> a(static_cast<size_t>(R) * groups);
  std::vector<float> extra(static_cast<size_t>(R) * groups);
  // The tile's scales and zeros, widened once for every query head and laid
  // out per group ([g][token], zero past the tile's end), so that the
  // per-head work below runs 8 tokens at a time.
  alignas(32) float sf[64][kAccumTile], zf[64][kAccumTile], pp[kAccumTile], xs[kAccumTile];
  for (int64_t t0 = 0; t0 < v.quantized; t0 += kAccumTile) {
    const int64_t t1 = std::min(v.quantized, t0 + kAccumTile), n = t1 - t0;
    for (int g = 0; g < groups; ++g) {
      for (int64_t i = 0; i < kAccumTile; ++i) {
        sf[g][i] = i < n ? _cvtsh_ss(LoadU16(sc, (t0 + i) * groups + g)) : 0.0f;
        zf[g][i] = i < n ? _cvtsh_ss(LoadU16(zc, (t0 + i) * groups + g)) : 0.0f;
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int64_t i = 0; i < kAccumTile; ++i) pp[i] = i < n ? p[r][t0 + i] : 0.0f;
      for (int g = 0; g < groups; ++g) {
        __m256 mx = _mm256_setzero_ps(), zs = _mm256_setzero_ps();
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        for (int64_t i = 0; i < kAccumTile; i += 8) {
          const __m256 pv = _mm256_load_ps(pp + i);
          const __m256 x = _mm256_mul_ps(pv, _mm256_load_ps(sf[g] + i));
          _mm256_store_ps(xs + i, x);
          mx = _mm256_max_ps(mx, _mm256_and_ps(x, abs_mask));
          zs = _mm256_fmadd_ps(pv, _mm256_load_ps(zf[g] + i), zs);
        }
        zacc[r * groups + g] += HSum(zs);
        const float amax = HMax(mx);
        const __m256 inv = _mm256_set1_ps(amax > 0 ? 32767.0f / amax : 0.0f);
        __m256 e = _mm256_setzero_ps();
        int32_t* pr = pairs.data() + (r * groups + g) * kPairs;
        for (int64_t i = 0; i < kAccumTile; i += 8) {
          const __m256 x = _mm256_mul_ps(_mm256_load_ps(xs + i), inv);
          const __m256 rx = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          e = _mm256_add_ps(e, _mm256_sub_ps(x, rx));
          const __m256i iv = _mm256_cvtps_epi32(rx);
          // int16 of tokens i..i+7; pairs (i, i+1) .. (i+6, i+7) as four int32.
          const __m256i packed = _mm256_packs_epi32(iv, iv);
          const __m256i ordered =
              _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 1, 4, 5, 0, 1, 4, 5));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(pr + i / 2), _mm256_castsi256_si128(ordered));
        }
        a[r * groups + g] = amax / 32767.0f;
        extra[r * groups + g] = kMid * a[r * groups + g] * HSum(e);
      }
    }
    for (int c = 0; c < d; c += 16) {
      const int g = c / v.group;
      __m256i lo[R], hi[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
      for (int64_t j = 0; 2 * j < n; ++j) {
        const int64_t t = t0 + 2 * j;
        const __m128i c0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + t * d + c));
        // The tile's last token may have no partner: zeros, never a read
        // past the slab.
        const __m128i c1 =
            t + 1 < t1 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (t + 1) * d + c))
                       : _mm_setzero_si128();
        // (t, c), (t + 1, c) side by side, widened to int16.
        const __m256i x0 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(c0, c1));
        const __m256i x1 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(c0, c1));
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256i uu = _mm256_set1_epi32(pairs[(r * groups + g) * kPairs + j]);
          lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(x0, uu));
          hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(x1, uu));
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 av = _mm256_set1_ps(a[r * groups + g]);
        const __m256 ev = _mm256_set1_ps(extra[r * groups + g]);
        _mm256_storeu_ps(out[r] + c,
                         _mm256_add_ps(_mm256_loadu_ps(out[r] + c),
                                       _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[r]), av, ev)));
        _mm256_storeu_ps(out[r] + c + 8,
                         _mm256_add_ps(_mm256_loadu_ps(out[r] + c + 8),
                                       _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[r]), av, ev)));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < d; ++c) out[r][c] += zacc[r * groups + c / v.group];
  }
}

// n floats (1, 2, 4 or 8) from p into the low lanes; the rest are not
// defined.
template <int n>
inline __m256 LoadTokens(const float* p) {
  if constexpr (n == 8) {
    return _mm256_loadu_ps(p);
  } else if constexpr (n == 4) {
    return _mm256_castps128_ps256(_mm_loadu_ps(p));
  } else if constexpr (n == 2) {
    return _mm256_castps128_ps256(
        _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  } else {
    return _mm256_castps128_ps256(_mm_load_ss(p));
  }
}

// One sub-block of P.V's int8 weights (tokens t0 .. t0+n-1 of kSub, the rest
// zero): for each query head, u_t = p_t * s_tg rounded to int8 against the
// largest of its group in the sub-block. iv[r][j] lane l holds token
// j * (8 / G) + l / G, group l % G; bsc[r][g] is group g's unit (every lane l
// holds group l % G's). zacc[r] (lanes l, group l % G) gains sum_t p_t z_tg and
// the rounding error times the mid code, which is the same for every channel
// of a group.
template <int R, int G, int kSub>
inline void ValueSubBlockInt8(const uint16_t* sc, const uint16_t* zc, const float* const* p,
                              int64_t t0, int n, int bits, __m256i (*iv)[kSub * G / 8],
                              float (*bsc)[8], __m256* zacc) {
  constexpr int kPerVec = 8 / G;  // Tokens per 8 (token, group) lanes.
  constexpr int kVecs = kSub * G / 8;
  const __m256 midv = _mm256_set1_ps(static_cast<float>((1 << bits) - 1) / 2);
  alignas(32) float sf[kSub * G], zf[kSub * G], pl[kSub + 8];
  alignas(32) int32_t idx[8];
  for (int i = 0; i < 8; ++i) idx[i] = i / G;
  const __m256i tok_idx = _mm256_load_si256(reinterpret_cast<const __m256i*>(idx));
  if (n == kSub) {
    for (int j = 0; j < kVecs; ++j) {
      _mm256_store_ps(sf + 8 * j, LoadHalf8(sc + t0 * G + 8 * j));
      _mm256_store_ps(zf + 8 * j, LoadHalf8(zc + t0 * G + 8 * j));
    }
  } else {
    for (int i = 0; i < kSub * G; ++i) {
      sf[i] = i < n * G ? _cvtsh_ss(LoadU16(sc, t0 * G + i)) : 0.0f;
      zf[i] = i < n * G ? _cvtsh_ss(LoadU16(zc, t0 * G + i)) : 0.0f;
    }
  }
  for (int r = 0; r < R; ++r) {
    // A whole sub-block is read in place; the last, short one from a copy
    // padded with zeros. Each vector reads only its kPerVec tokens (a wider
    // load could run past the end of p, and would not be forwarded from the
    // copy's stores).
    const float* pr = p[r] + t0;
    if (n < kSub) {
      std::memcpy(pl, pr, sizeof(float) * n);
      std::fill(pl + n, pl + kSub + 8, 0.0f);
      pr = pl;
    }
    // Independent products per vector, summed as a tree: one chain of
    // kVecs fused multiply-adds through zacc would cost its latency on every
    // sub-block.
    __m256 uv[kVecs], zs[kVecs];
    __m256 mx = _mm256_setzero_ps(), usum = mx;
    for (int j = 0; j < kVecs; ++j) {
      const __m256 pv = _mm256_permutevar8x32_ps(LoadTokens<kPerVec>(pr + j * kPerVec), tok_idx);
      uv[j] = _mm256_mul_ps(pv, _mm256_load_ps(sf + 8 * j));
      mx = _mm256_max_ps(mx, uv[j]);
      usum = _mm256_add_ps(usum, uv[j]);
      zs[j] = _mm256_mul_ps(pv, _mm256_load_ps(zf + 8 * j));
    }
    // Every lane gets the max of its group (lanes l and l' with l = l' mod G).
    if constexpr (G <= 4) mx = _mm256_max_ps(mx, _mm256_permute2f128_ps(mx, mx, 1));
    if constexpr (G <= 2) mx = _mm256_max_ps(mx, _mm256_permute_ps(mx, 0x4e));
    if constexpr (G == 1) mx = _mm256_max_ps(mx, _mm256_permute_ps(mx, 0xb1));
    const __m256 bv = _mm256_mul_ps(mx, _mm256_set1_ps(1.0f / 127.0f));
    const __m256 inv = InvScale(bv);
    _mm256_store_ps(bsc[r], bv);
    // The rounding error times the mid code, exactly, per group (as for K):
    // mid * (sum_t u_t - b * sum_t u8_t), every vector's lanes being the
    // same groups.
    __m256i isum = _mm256_setzero_si256();
    for (int j = 0; j < kVecs; ++j) {
      iv[r][j] = _mm256_cvtps_epi32(_mm256_mul_ps(uv[j], inv));
      isum = _mm256_add_epi32(isum, iv[r][j]);
    }
    __m256 z0 = zs[0], z1 = zs[1];  // kVecs = 2 * G: even.
#pragma GCC unroll 8
    for (int j = 2; j < kVecs; j += 2) {
      z0 = _mm256_add_ps(z0, zs[j]);
      z1 = _mm256_add_ps(z1, zs[j + 1]);
    }
    const __m256 rounding = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(isum), bv, usum);
    zacc[r] = _mm256_add_ps(zacc[r], _mm256_fmadd_ps(midv, rounding, _mm256_add_ps(z0, z1)));
  }
}

// out[r][c] += acc[r][b0 + pos] (channel c = b0 + chan(pos) for each block
// of kBlock channels from b0) plus each channel's group's share of zacc[r].
template <int R, int G, int kBlock, typename Chan>
inline void FinishValues(const EncodedView& v, const float (*acc)[1024], const __m256* zacc,
                         Chan chan, float* const* out) {
  for (int r = 0; r < R; ++r) {
    alignas(32) float z8[8];
    _mm256_store_ps(z8, zacc[r]);
    float zg[8] = {};
    for (int l = 0; l < 8; ++l) zg[l % G] += z8[l];
    for (int b0 = 0; b0 < v.head_dim; b0 += kBlock) {
      for (int pos = 0; pos < kBlock; ++pos) {
        const int c = b0 + chan(pos);
        out[r][c] += acc[r][b0 + pos] + zg[c / v.group];
      }
    }
  }
}

// AccumKiviInt (below) for G = head_dim / group V groups per token.
template <int R, int G, int kBits>
void AccumKiviIntG(const EncodedView& v, int64_t s, const float* const* p, float* const* out) {
  constexpr int kSub = 16;  // Tokens per int16 accumulation.
  constexpr int kVecs = kSub * G / 8;
  constexpr int bits = kBits;
  const int d = v.head_dim, chunks = d / 32;
  const int64_t row_bytes = d * kBits / 8;
  const uint8_t* codes = v.codes + s * v.words_per_slab * 4;
  const uint16_t* sc = v.scales + s * v.groups_per_slab;
  const uint16_t* zc = v.zeros + s * v.groups_per_slab;
  alignas(32) float acc[R][1024];  // Lane order within each chunk.
  __m256 zacc[R];
  for (int r = 0; r < R; ++r) {
    std::fill(acc[r], acc[r] + d, 0.0f);
    zacc[r] = _mm256_setzero_ps();
  }
  // wp[r][pair][g]: the low 16 bits are u8 of the pair's first token and u8 of
  // its second, as vpmaddubsw takes them.
  alignas(32) int32_t wp[R][kSub / 2][G];
  alignas(32) float bsc[R][8];
  for (int64_t t0 = 0; t0 < v.quantized; t0 += kSub) {
    const int n = static_cast<int>(std::min<int64_t>(kSub, v.quantized - t0));
    __m256i iv[R][kVecs];
    ValueSubBlockInt8<R, G, kSub>(sc, zc, p, t0, n, bits, iv, bsc, zacc);
    for (int r = 0; r < R; ++r) {
      // Join each pair's two tokens into one 16-bit word per group.
      int32_t* w = &wp[r][0][0];
      for (int j = 0; j < kVecs; ++j) {
        if constexpr (G == 8) {
          if (j % 2 == 0) {
            _mm256_store_si256(reinterpret_cast<__m256i*>(w + 4 * j),
                               _mm256_or_si256(iv[r][j], _mm256_slli_epi32(iv[r][j + 1], 8)));
          }
        } else if constexpr (G == 4) {
          const __m256i next = _mm256_permute2x128_si256(iv[r][j], iv[r][j], 1);
          _mm_store_si128(
              reinterpret_cast<__m128i*>(w + 4 * j),
              _mm256_castsi256_si128(_mm256_or_si256(iv[r][j], _mm256_slli_epi32(next, 8))));
        } else {
          // G = 2: lanes (t, g0) (t, g1) (t+1, g0) (t+1, g1) per half; G = 1: t .. t+3.
          const __m256i next =
              G == 2 ? _mm256_srli_si256(iv[r][j], 8) : _mm256_srli_epi64(iv[r][j], 32);
          const __m256i words = _mm256_or_si256(iv[r][j], _mm256_slli_epi32(next, 8));
          const __m256i keep = G == 2 ? _mm256_setr_epi32(0, 1, 4, 5, 0, 0, 0, 0)
                                      : _mm256_setr_epi32(0, 2, 4, 6, 0, 0, 0, 0);
          _mm_store_si128(reinterpret_cast<__m128i*>(w + 4 * j),
                          _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(words, keep)));
        }
      }
    }
    // The next sub-block's codes, while this one is computed.
    const int64_t ahead = std::min<int64_t>(kSub, v.quantized - t0 - n) * d * bits / 8;
    for (int64_t i = 0; i < ahead; i += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(codes + (t0 + kSub) * d * bits / 8 + i),
                   _MM_HINT_T0);
    }
    for (int ch = 0; ch < chunks; ++ch) {
      const int g = ch * 32 / v.group;
      __m256i lo[R], hi[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
      const uint8_t* col = codes + t0 * row_bytes + ch * 4 * kBits;
      const auto pair = [&](int pr, __m256i x0, __m256i x1) {
        const __m256i il = _mm256_unpacklo_epi8(x0, x1), ih = _mm256_unpackhi_epi8(x0, x1);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256i wv = _mm256_set1_epi16(static_cast<int16_t>(wp[r][pr][g]));
          lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(il, wv));
          hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(ih, wv));
        }
      };
      // Whole pairs, then the tile's last token with zeros for a partner
      // (never a read past the slab).
      const int whole = n / 2;
      for (int pr = 0; pr < whole; ++pr) {
        const uint8_t* c0 = col + 2 * pr * row_bytes;
        pair(pr, Unpack32<kBits>(c0), Unpack32<kBits>(c0 + row_bytes));
      }
      if (n % 2 == 1) {
        pair(whole, Unpack32<kBits>(col + 2 * whole * row_bytes), _mm256_setzero_si256());
      }
      // lo holds lane-order positions 0-7 and 16-23, hi 8-15 and 24-31.
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 bv = _mm256_set1_ps(bsc[r][g]);
        float* a = acc[r] + ch * 32;
        const __m256i parts[4] = {_mm256_cvtepi16_epi32(_mm256_castsi256_si128(lo[r])),
                                  _mm256_cvtepi16_epi32(_mm256_castsi256_si128(hi[r])),
                                  _mm256_cvtepi16_epi32(_mm256_extracti128_si256(lo[r], 1)),
                                  _mm256_cvtepi16_epi32(_mm256_extracti128_si256(hi[r], 1))};
        for (int j = 0; j < 4; ++j) {
          _mm256_store_ps(a + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(parts[j]), bv,
                                                     _mm256_load_ps(a + 8 * j)));
        }
      }
    }
  }
  FinishValues<R, G, 32>(
      v, acc, zacc, [](int pos) { return LaneElem(kBits, pos); }, out);
}

// Four 16-byte vectors as one 64-byte vector, x[0] lowest.
KVT_VNNI_TARGET inline __m512i Join4(const __m128i* x) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(x[0]), x[1], 1)),
      _mm256_inserti128_si256(_mm256_castsi128_si256(x[2]), x[3], 1), 1);
}

// 32 bytes from p0, then 32 from p1.
KVT_VNNI_TARGET inline __m512i Load2x32(const uint8_t* p0, const uint8_t* p1) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1)), 1);
}

// Whether AccumKiviVnni takes the quantized part of a V slab: IntPath's
// shapes with head_dim a multiple of 64.
bool VnniValuePath(const EncodedView& v) { return IntPath(v) && v.head_dim % 64 == 0; }

// AccumKiviIntG with vpdpbusd, which adds four adjacent byte products: the
// codes of four tokens are interleaved byte by byte (one vpermt2b or vpermb
// per 64 channels, before the codes are taken out of their bytes), so that
// one instruction adds four tokens' products for 16 channels into int32.
// Each block's sums are scaled into fp32 once per sub-block.
template <int R, int G>
KVT_VNNI_TARGET void AccumKiviVnniG(const EncodedView& v, int64_t s, const float* const* p,
                                    float* const* out) {
  constexpr int kSub = 16;  // Tokens per u rounding (as AccumKiviIntG).
  constexpr int kVecs = kSub * G / 8;
  const int d = v.head_dim, bits = v.bits;
  const int row_bytes = d * bits / 8;
  const uint8_t* codes = v.codes + s * v.words_per_slab * 4;
  const uint16_t* sc = v.scales + s * v.groups_per_slab;
  const uint16_t* zc = v.zeros + s * v.groups_per_slab;
  static const uint8_t kZeroRow[1024 * 4 / 8] = {};  // Rows past the end.
  alignas(64) float acc[R][1024];  // Per 64 channels: 4 vectors of 16 (chan below).
  __m256 zacc[R];
  for (int r = 0; r < R; ++r) {
    std::fill(acc[r], acc[r] + d, 0.0f);
    zacc[r] = _mm256_setzero_ps();
  }
  // u bytes from (token, group) order to (quad, group, token in quad) order.
  alignas(64) uint8_t perm[128] = {};
  for (int i = 0; i < kSub * G; ++i) {
    const int qd = i / (4 * G), g = (i / 4) % G, k = i % 4;
    perm[i] = static_cast<uint8_t>((4 * qd + k) * G + g);
  }
  // Byte 4j + k of a quad vector = byte j of token k's 64 channels. 4-bit:
  // 32 bytes a token, the tokens in two vectors [0 | 1], [2 | 3], bytes 0-15
  // to one quad vector and 16-31 to another; 2-bit: 16 bytes a token, the
  // four in one vector.
  alignas(64) uint8_t ia[64], ib[64], i2[64];
  for (int j = 0; j < 16; ++j) {
    for (int k = 0; k < 4; ++k) {
      ia[4 * j + k] = static_cast<uint8_t>(32 * k + j);
      ib[4 * j + k] = static_cast<uint8_t>(32 * k + 16 + j);
      i2[4 * j + k] = static_cast<uint8_t>(16 * k + j);
    }
  }
  const __m512i idx_a = _mm512_load_si512(ia), idx_b = _mm512_load_si512(ib);
  const __m512i idx_2 = _mm512_load_si512(i2);
  const __m512i nib = _mm512_set1_epi8(0x0f), crumb = _mm512_set1_epi8(0x03);
  const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  alignas(64) uint8_t ub[R][128];
  alignas(32) float bsc[R][8];
  for (int64_t t0 = 0; t0 < v.quantized; t0 += kSub) {
    const int n = static_cast<int>(std::min<int64_t>(kSub, v.quantized - t0));
    __m256i iv[R][kVecs];
    ValueSubBlockInt8<R, G, kSub>(sc, zc, p, t0, n, bits, iv, bsc, zacc);
    for (int r = 0; r < R; ++r) {
      // The bytes in (token, group) order, 16 per pair of vectors, joined in
      // registers (narrow stores read back wide would not be forwarded).
      __m128i b16[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        b16[j] = 2 * j < kVecs ? _mm512_cvtepi32_epi8(_mm512_inserti64x4(
                                     _mm512_castsi256_si512(iv[r][2 * j]), iv[r][2 * j + 1], 1))
                               : _mm_setzero_si128();
      }
      const __m512i lo = Join4(b16), hi = kSub * G > 64 ? Join4(b16 + 4) : _mm512_setzero_si512();
      for (int i = 0; i < kSub * G; i += 64) {
        _mm512_store_si512(ub[r] + i,
                           _mm512_permutex2var_epi8(lo, _mm512_load_si512(perm + i), hi));
      }
    }
    const uint8_t* rows[kSub];
    for (int i = 0; i < kSub; ++i) rows[i] = i < n ? codes + (t0 + i) * row_bytes : kZeroRow;
    // The next sub-block's codes, while this one is computed.
    const int64_t ahead = std::min<int64_t>(kSub, v.quantized - t0 - n) * row_bytes;
    for (int64_t i = 0; i < ahead; i += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(codes + (t0 + kSub) * row_bytes + i), _MM_HINT_T0);
    }
    const int quads = (n + 3) / 4;
    for (int b0 = 0; b0 < d; b0 += 64) {
      // The groups of the block's two halves (groups are 32 channels or more).
      const int g0 = b0 / v.group, g1 = (b0 + 32) / v.group;
      const int off = b0 * bits / 8;
      __m512i ac[R][4];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        ac[r][0] = ac[r][1] = ac[r][2] = ac[r][3] = _mm512_setzero_si512();
      for (int qd = 0; qd < quads; ++qd) {
        const uint8_t* const* rq = rows + 4 * qd;
        if (bits == 4) {
          const __m512i y0 = Load2x32(rq[0] + off, rq[1] + off);
          const __m512i y1 = Load2x32(rq[2] + off, rq[3] + off);
          const __m512i a = _mm512_permutex2var_epi8(y0, idx_a, y1);
          const __m512i b = _mm512_permutex2var_epi8(y0, idx_b, y1);
          const __m512i x[4] = {
              _mm512_and_si512(a, nib), _mm512_and_si512(_mm512_srli_epi16(a, 4), nib),
              _mm512_and_si512(b, nib), _mm512_and_si512(_mm512_srli_epi16(b, 4), nib)};
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            int32_t u0, u1;
            std::memcpy(&u0, ub[r] + (qd * G + g0) * 4, 4);
            std::memcpy(&u1, ub[r] + (qd * G + g1) * 4, 4);
            const __m512i w0 = _mm512_set1_epi32(u0), w1 = _mm512_set1_epi32(u1);
            ac[r][0] = _mm512_dpbusd_epi32(ac[r][0], x[0], w0);
            ac[r][1] = _mm512_dpbusd_epi32(ac[r][1], x[1], w0);
            ac[r][2] = _mm512_dpbusd_epi32(ac[r][2], x[2], w1);
            ac[r][3] = _mm512_dpbusd_epi32(ac[r][3], x[3], w1);
          }
        } else {
          __m512i y = _mm512_castsi128_si512(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(rq[0] + off)));
          y = _mm512_inserti32x4(y, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rq[1] + off)),
                                 1);
          y = _mm512_inserti32x4(y, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rq[2] + off)),
                                 2);
          y = _mm512_inserti32x4(y, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rq[3] + off)),
                                 3);
          const __m512i a = _mm512_permutexvar_epi8(idx_2, y);
          const __m512i x[4] = {_mm512_and_si512(a, crumb),
                                _mm512_and_si512(_mm512_srli_epi16(a, 2), crumb),
                                _mm512_and_si512(_mm512_srli_epi16(a, 4), crumb),
                                _mm512_and_si512(_mm512_srli_epi16(a, 6), crumb)};
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            // Lanes 0-7 are the block's first 32 channels, 8-15 the next.
            int32_t u0, u1;
            std::memcpy(&u0, ub[r] + (qd * G + g0) * 4, 4);
            std::memcpy(&u1, ub[r] + (qd * G + g1) * 4, 4);
            const __m512i wv = _mm512_permutexvar_epi32(
                halves, _mm512_castsi128_si512(_mm_setr_epi32(u0, u1, 0, 0)));
            for (int i = 0; i < 4; ++i) ac[r][i] = _mm512_dpbusd_epi32(ac[r][i], x[i], wv);
          }
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        // 4-bit: vectors 0-1 hold the first half's channels, 2-3 the second;
        // 2-bit: lanes 0-7 of each vector the first, 8-15 the second.
        const __m512 s0 = _mm512_set1_ps(bsc[r][g0]), s1 = _mm512_set1_ps(bsc[r][g1]);
        const __m512 sm = _mm512_castpd_ps(_mm512_insertf64x4(
            _mm512_castps_pd(s0), _mm256_castps_pd(_mm256_set1_ps(bsc[r][g1])), 1));
        float* a = acc[r] + b0;
        for (int i = 0; i < 4; ++i) {
          const __m512 bv = bits == 4 ? (i < 2 ? s0 : s1) : sm;
          _mm512_store_ps(a + 16 * i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(ac[r][i]), bv,
                                                      _mm512_load_ps(a + 16 * i)));
        }
      }
    }
  }
  // Vector i, lane j of a block: 4-bit, byte j (i = 0, 1) or 16 + j (i = 2,
  // 3), its low (even i) or high nibble; 2-bit, byte j's crumb i.
  FinishValues<R, G, 64>(
      v, acc, zacc,
      [bits](int pos) {
        const int i = pos / 16, j = pos % 16;
        return bits == 4 ? (i / 2) * 32 + 2 * j + i % 2 : 4 * j + i;
      },
      out);
}

template <int R>
KVT_VNNI_TARGET void AccumKiviVnni(const EncodedView& v, int64_t s, const float* const* p,
                                   float* const* out) {
  switch (v.head_dim / v.group) {
    case 1:
      return AccumKiviVnniG<R, 1>(v, s, p, out);
    case 2:
      return AccumKiviVnniG<R, 2>(v, s, p, out);
    case 4:
      return AccumKiviVnniG<R, 4>(v, s, p, out);
    default:
      return AccumKiviVnniG<R, 8>(v, s, p, out);
  }
}

// P.V over the quantized part of a KIVI/KCVT value slab with int8 x code
// products. Per 16 tokens, query head and V group, u_t = p_t * s_tg is
// rounded to int8 against its largest value (b = max u / 127); token pairs
// are interleaved byte by byte so that one vpmaddubsw adds two tokens'
// products per channel: out_c += b * sum_t u8_t * code_tc + sum_t p_t * z_tg.
// 8 pairs stay exact in int16 (8 * 2 * 15 * 127 < 2^15). p must be >= 0.
template <int R>
void AccumKiviInt(const EncodedView& v, int64_t s, const float* const* p, float* const* out) {
  const bool four = v.bits == 4;
  switch (v.head_dim / v.group) {
    case 1:
      return four ? AccumKiviIntG<R, 1, 4>(v, s, p, out) : AccumKiviIntG<R, 1, 2>(v, s, p, out);
    case 2:
      return four ? AccumKiviIntG<R, 2, 4>(v, s, p, out) : AccumKiviIntG<R, 2, 2>(v, s, p, out);
    case 4:
      return four ? AccumKiviIntG<R, 4, 4>(v, s, p, out) : AccumKiviIntG<R, 4, 2>(v, s, p, out);
    default:
      return four ? AccumKiviIntG<R, 8, 4>(v, s, p, out) : AccumKiviIntG<R, 8, 2>(v, s, p, out);
  }
}

bool FastPath(const EncodedView& b) {
  if (b.head_dim % 8 != 0) return false;
  if (b.codec == v1::CODEC_RAW) return true;
  if (b.codec != v1::CODEC_KIVI && b.codec != v1::CODEC_KCVT) return false;
  QuantShape q;
  q.key = b.role != v1::TENSOR_ROLE_VALUE;
  q.bits = b.bits;
  q.group = b.group;
  q.d = b.head_dim;
  return Supported(q);
}

template <int R>
void ScoreBlock(const EncodedView& k, int64_t s, const float* const* q, float scale,
                float* const* scores, bool integer) {
  if (k.codec == v1::CODEC_RAW) {
    ScoreRaw<R>(k.dtype, k.raw, s * k.slab_stride, k.token_stride, k.tokens, k.head_dim, q, scale,
                scores);
    return;
  }
  if (k.quantized > 0) {
    if (integer && VnniAvailable() && VnniKeyPath(k)) {
      ScoreKiviVnni<R>(k, s, q, scale, scores);
    } else if (integer && IntKeyPath(k)) {
      ScoreKiviInt<R>(k, s, q, scale, scores);
    } else {
      ScoreKivi<R>(k, s, q, scale, scores);
    }
  }
  if (k.residual > 0) {
    float* shifted[R];
    for (int r = 0; r < R; ++r) shifted[r] = scores[r] + k.quantized;
    ScoreRaw<R>(k.dtype, k.residual_data, s * k.slab_stride, k.token_stride, k.residual, k.head_dim,
                q, scale, shifted);
  }
}

template <int R>
void AccumBlock(const EncodedView& v, int64_t s, const float* const* p, float* const* out,
                bool integer) {
  if (v.codec == v1::CODEC_RAW) {
    AccumRaw<R>(v.dtype, v.raw, s * v.slab_stride, v.token_stride, v.tokens, v.head_dim, p, out);
    return;
  }
  if (v.quantized > 0) {
    if (integer && IntPath(v)) {
      if (VnniAvailable() && VnniValuePath(v)) {
        AccumKiviVnni<R>(v, s, p, out);
      } else {
        AccumKiviInt<R>(v, s, p, out);
      }
    } else if (integer && Int16ValuePath(v)) {
      AccumKivi8Int<R>(v, s, p, out);
    } else {
      AccumKivi<R>(v, s, p, out);
    }
  }
  if (v.residual > 0) {
    const float* shifted[R];
    for (int r = 0; r < R; ++r) shifted[r] = p[r] + v.quantized;
    AccumRaw<R>(v.dtype, v.residual_data, s * v.slab_stride, v.token_stride, v.residual, v.head_dim,
                shifted, out);
  }
}

}  // namespace

bool ScoreBlockSimd(const EncodedView& k, int64_t s, const float* const* q, int n_rep, float scale,
                    float* const* scores, bool integer) {
  if (!SimdAvailable() || !FastPath(k)) return false;
  // Query heads go four at a time so their accumulators stay in registers.
  for (int r0 = 0; r0 < n_rep; r0 += 4) {
    switch (std::min(4, n_rep - r0)) {
      case 1:
        ScoreBlock<1>(k, s, q + r0, scale, scores + r0, integer);
        break;
      case 2:
        ScoreBlock<2>(k, s, q + r0, scale, scores + r0, integer);
        break;
      case 3:
        ScoreBlock<3>(k, s, q + r0, scale, scores + r0, integer);
        break;
      default:
        ScoreBlock<4>(k, s, q + r0, scale, scores + r0, integer);
    }
  }
  return true;
}

bool AccumulateBlockSimd(const EncodedView& v, int64_t s, const float* const* p, int n_rep,
                         float* const* out, bool integer) {
  if (!SimdAvailable() || !FastPath(v)) return false;
  for (int r0 = 0; r0 < n_rep; r0 += 4) {
    switch (std::min(4, n_rep - r0)) {
      case 1:
        AccumBlock<1>(v, s, p + r0, out + r0, integer);
        break;
      case 2:
        AccumBlock<2>(v, s, p + r0, out + r0, integer);
        break;
      case 3:
        AccumBlock<3>(v, s, p + r0, out + r0, integer);
        break;
      default:
        AccumBlock<4>(v, s, p + r0, out + r0, integer);
    }
  }
  return true;
}

bool SoftmaxSimd(float* x, int64_t n) {
  if (!SimdAvailable()) return false;
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
  float m = HMax(mv);
  for (; i < n; ++i) m = std::max(m, x[i]);
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = Exp(_mm256_sub_ps(_mm256_loadu_ps(x + i), mb));
    _mm256_storeu_ps(x + i, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = HSum(sv);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    sum += x[i];
  }
  const __m256 inv = _mm256_set1_ps(1.0f / sum);
  for (i = 0; i + 8 <= n; i += 8)
    _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
  for (; i < n; ++i) x[i] /= sum;
  return true;
}

}  // namespace kvtier::internal
