// Vectorized codec and attention kernels: AVX2 + FMA + F16C + BMI2. This file
// is compiled with those instruction sets enabled; nothing here may run before
// SimdAvailable() (in codec_ref.cc, built for the baseline ISA) says yes.
//
// Codes of 8 consecutive elements always fill whole bytes (8 * bits bits), so
// a chunk of 8 codes is packed with PEXT and unpacked with PDEP.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/codec_internal.h"
#include "kernels/half.h"

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

inline float HMin(__m256 v) {
  __m128 s = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_min_ps(s, _mm_movehl_ps(s, s));
  s = _mm_min_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float HMax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
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

bool QuantizeSlabSimd(const QuantShape& q, const float* x, uint8_t* codes, uint16_t* scales,
                      uint16_t* zeros) {
  if (!SimdAvailable() || !Supported(q)) return false;
  const int d = q.d;
  const float qmaxf = static_cast<float>((1 << q.bits) - 1);
  const __m256 qmax = _mm256_set1_ps(qmaxf);
  if (q.key) {
    std::vector<float> inv(d), zf(d);
    const int64_t groups = (q.tq + q.group - 1) / q.group;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t t0 = g * q.group;
      const int64_t n = std::min<int64_t>(q.group, q.tq - t0);
      for (int c = 0; c < d; c += 8) {
        __m256 mn = _mm256_loadu_ps(x + t0 * d + c), mx = mn;
        for (int64_t j = 1; j < n; ++j) {
          const __m256 v = _mm256_loadu_ps(x + (t0 + j) * d + c);
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
        const float* row = x + t * d;
        int c = 0;
        if (q.bits == 4) {
          for (; c + 32 <= d; c += 32) {
            __m256i qi[4];
            for (int k = 0; k < 4; ++k) {
              const int ck = c + 8 * k;
              qi[k] = QuantizeChunk(_mm256_loadu_ps(row + ck), _mm256_loadu_ps(zf.data() + ck),
                                    _mm256_loadu_ps(inv.data() + ck), qmax);
            }
            StoreCodes32x4(codes, t * d + c, qi[0], qi[1], qi[2], qi[3]);
          }
        }
        for (; c < d; c += 8) {
          const __m256i qi = QuantizeChunk(_mm256_loadu_ps(row + c), _mm256_loadu_ps(zf.data() + c),
                                           _mm256_loadu_ps(inv.data() + c), qmax);
          StoreCodes8(codes, q.bits, t * d + c, qi);
        }
      }
    }
    return true;
  }
  const int groups = (d + q.group - 1) / q.group;
  for (int64_t t = 0; t < q.tq; ++t) {
    const float* row = x + t * d;
    for (int g = 0; g < groups; ++g) {
      const int c0 = g * q.group;
      const int c1 = std::min(d, c0 + q.group);
      __m256 mn = _mm256_loadu_ps(row + c0), mx = mn;
      for (int c = c0 + 8; c < c1; c += 8) {
        const __m256 v = _mm256_loadu_ps(row + c);
        mn = _mm256_min_ps(mn, v);
        mx = _mm256_max_ps(mx, v);
      }
      const float lo = HMin(mn), hi = HMax(mx);
      const uint16_t s16 = _cvtss_sh((hi - lo) / qmaxf, 0);
      const uint16_t z16 = _cvtss_sh(lo, 0);
      StoreU16(scales, t * groups + g, s16);
      StoreU16(zeros, t * groups + g, z16);
      const float sf = _cvtsh_ss(s16);
      const __m256 inv = _mm256_set1_ps(sf > 0.0f ? 1.0f / sf : 0.0f);
      const __m256 zv = _mm256_set1_ps(_cvtsh_ss(z16));
      int c = c0;
      // 32 codes at a time when they start on a byte (t * d + c even).
      if (q.bits == 4 && ((t * d + c) & 1) == 0) {
        for (; c + 32 <= c1; c += 32) {
          StoreCodes32x4(codes, t * d + c, QuantizeChunk(_mm256_loadu_ps(row + c), zv, inv, qmax),
                         QuantizeChunk(_mm256_loadu_ps(row + c + 8), zv, inv, qmax),
                         QuantizeChunk(_mm256_loadu_ps(row + c + 16), zv, inv, qmax),
                         QuantizeChunk(_mm256_loadu_ps(row + c + 24), zv, inv, qmax));
        }
      }
      for (; c < c1; c += 8) {
        StoreCodes8(codes, q.bits, t * d + c,
                    QuantizeChunk(_mm256_loadu_ps(row + c), zv, inv, qmax));
      }
    }
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
                float* const* scores) {
  if (k.codec == v1::CODEC_RAW) {
    ScoreRaw<R>(k.dtype, k.raw, s * k.slab_stride, k.token_stride, k.tokens, k.head_dim, q, scale,
                scores);
    return;
  }
  if (k.quantized > 0) ScoreKivi<R>(k, s, q, scale, scores);
  if (k.residual > 0) {
    float* shifted[R];
    for (int r = 0; r < R; ++r) shifted[r] = scores[r] + k.quantized;
    ScoreRaw<R>(k.dtype, k.residual_data, s * k.slab_stride, k.token_stride, k.residual, k.head_dim,
                q, scale, shifted);
  }
}

template <int R>
void AccumBlock(const EncodedView& v, int64_t s, const float* const* p, float* const* out) {
  if (v.codec == v1::CODEC_RAW) {
    AccumRaw<R>(v.dtype, v.raw, s * v.slab_stride, v.token_stride, v.tokens, v.head_dim, p, out);
    return;
  }
  if (v.quantized > 0) AccumKivi<R>(v, s, p, out);
  if (v.residual > 0) {
    const float* shifted[R];
    for (int r = 0; r < R; ++r) shifted[r] = p[r] + v.quantized;
    AccumRaw<R>(v.dtype, v.residual_data, s * v.slab_stride, v.token_stride, v.residual, v.head_dim,
                shifted, out);
  }
}

}  // namespace

bool ScoreBlockSimd(const EncodedView& k, int64_t s, const float* const* q, int n_rep, float scale,
                    float* const* scores) {
  if (!SimdAvailable() || !FastPath(k)) return false;
  // Query heads go four at a time so their accumulators stay in registers.
  for (int r0 = 0; r0 < n_rep; r0 += 4) {
    switch (std::min(4, n_rep - r0)) {
      case 1:
        ScoreBlock<1>(k, s, q + r0, scale, scores + r0);
        break;
      case 2:
        ScoreBlock<2>(k, s, q + r0, scale, scores + r0);
        break;
      case 3:
        ScoreBlock<3>(k, s, q + r0, scale, scores + r0);
        break;
      default:
        ScoreBlock<4>(k, s, q + r0, scale, scores + r0);
    }
  }
  return true;
}

bool AccumulateBlockSimd(const EncodedView& v, int64_t s, const float* const* p, int n_rep,
                         float* const* out) {
  if (!SimdAvailable() || !FastPath(v)) return false;
  for (int r0 = 0; r0 < n_rep; r0 += 4) {
    switch (std::min(4, n_rep - r0)) {
      case 1:
        AccumBlock<1>(v, s, p + r0, out + r0);
        break;
      case 2:
        AccumBlock<2>(v, s, p + r0, out + r0);
        break;
      case 3:
        AccumBlock<3>(v, s, p + r0, out + r0);
        break;
      default:
        AccumBlock<4>(v, s, p + r0, out + r0);
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
