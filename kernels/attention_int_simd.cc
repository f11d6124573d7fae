// The integer decode-attention kernels (AVX2; kernels/simd_avx2.h): KIVI/KCVT
// codes multiplied as int8/int16 with vpmaddubsw, the scales and zeros
// applied per group afterwards.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/simd_avx2.h"

namespace kvtier::internal {

namespace {

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

}  // namespace

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
  if (k.codec != Codec::kKivi && k.codec != Codec::kKcvt) return false;
  if (k.role == TensorRole::kValue || k.group < 1) return false;
  if (k.bits == 8) return k.head_dim % 16 == 0 && k.head_dim <= 256;
  return (k.bits == 2 || k.bits == 4) && k.head_dim % 32 == 0 && k.head_dim <= 1024;
}

// Whether AccumKivi8Int takes the quantized part of a V slab: 8-bit codes,
// head_dim a multiple of 16, channel groups of a multiple of 16.
bool Int16ValuePath(const EncodedView& v) {
  if (v.codec != Codec::kKivi && v.codec != Codec::kKcvt) return false;
  return v.bits == 8 && v.role == TensorRole::kValue && v.head_dim % 16 == 0 && v.group % 16 == 0 &&
         v.head_dim <= 1024;
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

template void ScoreKiviInt<1>(const EncodedView&, int64_t, const float* const*, float,
                              float* const*);
template void ScoreKiviInt<2>(const EncodedView&, int64_t, const float* const*, float,
                              float* const*);
template void ScoreKiviInt<3>(const EncodedView&, int64_t, const float* const*, float,
                              float* const*);
template void ScoreKiviInt<4>(const EncodedView&, int64_t, const float* const*, float,
                              float* const*);
template void AccumKivi8Int<1>(const EncodedView&, int64_t, const float* const*, float* const*);
template void AccumKivi8Int<2>(const EncodedView&, int64_t, const float* const*, float* const*);
template void AccumKivi8Int<3>(const EncodedView&, int64_t, const float* const*, float* const*);
template void AccumKivi8Int<4>(const EncodedView&, int64_t, const float* const*, float* const*);
template void AccumKiviInt<1>(const EncodedView&, int64_t, const float* const*, float* const*);
template void AccumKiviInt<2>(const EncodedView&, int64_t, const float* const*, float* const*);
template void AccumKiviInt<3>(const EncodedView&, int64_t, const float* const*, float* const*);
template void AccumKiviInt<4>(const EncodedView&, int64_t, const float* const*, float* const*);

}  // namespace kvtier::internal
