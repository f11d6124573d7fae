// What the AVX2 files of kernels/ share (quantize_simd.cc, attention_simd.cc,
// attention_int_simd.cc, attention_vnni.cc): code-word loads and stores,
// fp16/bf16 loads, horizontal reductions, the quantizer's step, exp; the
// integer kernels' lane order and helpers; and the integer and VNNI kernels
// that attention_simd.cc dispatches to. Include it only from files compiled
// with AVX2+FMA+F16C+BMI2 (kernels/CMakeLists.txt), and call nothing here
// before SimdAvailable() says yes.
//
// Codes of 8 consecutive elements always fill whole bytes (8 * bits bits), so
// a chunk of 8 codes is packed with PEXT and unpacked with PDEP.
#ifndef KVTIER_KERNELS_SIMD_AVX2_H_
#define KVTIER_KERNELS_SIMD_AVX2_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/codec.h"
#include "kernels/codec_internal.h"
#include "kernels/half.h"
#include "kernels/x86_intrinsics.h"

namespace kvtier::internal {

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

inline __m256 LoadElems8(DType dtype, const void* base, int64_t index) {
  switch (dtype) {
    case DType::kFp16:
      return LoadHalf8(static_cast<const uint16_t*>(base) + index);
    case DType::kBf16: {
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

inline bool Supported(const QuantShape& q) {
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

// ---- The integer kernels' shared parts (attention_int_simd.cc, attention_vnni.cc) ----

// Tokens per tile of P.V: a tile of V rows stays in L1 while every channel
// pair of it is accumulated in registers.
constexpr int64_t kAccumTile = 64;

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
inline bool IntPath(const EncodedView& b) {
  if (b.codec != Codec::kKivi && b.codec != Codec::kKcvt) return false;
  if (b.bits != 2 && b.bits != 4) return false;
  if (b.head_dim % 32 != 0 || b.head_dim > 1024) return false;
  if (b.role == TensorRole::kValue) {
    if (b.group % 32 != 0 || b.head_dim % b.group != 0) return false;
    const int groups = b.head_dim / b.group;
    return 8 % groups == 0;
  }
  return b.group >= 1;
}

// Shared by the integer q.K^T kernels. qs[r] = scale * q[r].
template <int R>
inline void ScaleQueries(const float* const* q, float scale, int d, float (*qs)[1024]) {
  const __m256 sv = _mm256_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < d; c += 8)
      _mm256_store_ps(qs[r] + c, _mm256_mul_ps(_mm256_loadu_ps(q[r] + c), sv));
  }
}

// Scores of tokens t .. t+n-1 (n <= 8) for each query head: a * the integer
// sums in tok[r][0..7] (one int32 vector per token) + bias.
template <int R>
inline void StoreScores8(const __m256i (*tok)[8], const float* a, const float* bias, int64_t t,
                         int n, float* const* scores) {
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

// ---- The kernels attention_simd.cc dispatches to, R query heads at once (R in 1..4) ----

// Integer AVX2 (attention_int_simd.cc): whether they take a block, and the
// products.
bool IntKeyPath(const EncodedView& k);
bool Int16ValuePath(const EncodedView& v);
template <int R>
void ScoreKiviInt(const EncodedView& k, int64_t s, const float* const* q, float scale,
                  float* const* scores);
template <int R>
void AccumKivi8Int(const EncodedView& v, int64_t s, const float* const* p, float* const* out);
template <int R>
void AccumKiviInt(const EncodedView& v, int64_t s, const float* const* p, float* const* out);

// --- The same products with AVX-512 VNNI (vpdpbusd, 256-bit, EVEX) ---
//
// vpdpbusd multiplies 32 u8 x s8 pairs, adds each four adjacent products and
// accumulates into int32 in one instruction: no int16 sums to widen, no
// limit on how many are added. These functions are compiled for the VNNI
// CPUs (AVX512F/BW/VL/VNNI/VBMI: Ice Lake and Zen 4 on) and run only where
// VnniAvailable() says so; everything they call is inlined from the AVX2 code
// above.
#define KVT_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")))
bool VnniKeyPath(const EncodedView& k);
bool VnniValuePath(const EncodedView& v);
template <int R>
KVT_VNNI_TARGET void ScoreKiviVnni(const EncodedView& k, int64_t s, const float* const* q,
                                   float scale, float* const* scores);
template <int R>
KVT_VNNI_TARGET void AccumKiviVnni(const EncodedView& v, int64_t s, const float* const* p,
                                   float* const* out);

}  // namespace kvtier::internal

#endif  // KVTIER_KERNELS_SIMD_AVX2_H_
