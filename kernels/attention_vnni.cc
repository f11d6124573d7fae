// The integer decode-attention kernels with AVX-512 VNNI (vpdpbusd;
// kernels/simd_avx2.h): compiled for those CPUs, run only where
// VnniAvailable() says so.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/simd_avx2.h"

namespace kvtier::internal {

namespace {

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

}  // namespace

// Whether ScoreKiviVnni takes the quantized part of a K slab: IntPath's
// shapes with head_dim a multiple of one block (256 / bits channels: 32
// bytes of codes).
bool VnniKeyPath(const EncodedView& k) {
  return IntPath(k) && k.role != TensorRole::kValue && k.head_dim % (256 / k.bits) == 0;
}

// Whether AccumKiviVnni takes the quantized part of a V slab: IntPath's
// shapes with head_dim a multiple of 64.
bool VnniValuePath(const EncodedView& v) { return IntPath(v) && v.head_dim % 64 == 0; }

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

template void ScoreKiviVnni<1>(const EncodedView&, int64_t, const float* const*, float,
                               float* const*);
template void ScoreKiviVnni<2>(const EncodedView&, int64_t, const float* const*, float,
                               float* const*);
template void ScoreKiviVnni<3>(const EncodedView&, int64_t, const float* const*, float,
                               float* const*);
template void ScoreKiviVnni<4>(const EncodedView&, int64_t, const float* const*, float,
                               float* const*);
template void AccumKiviVnni<1>(const EncodedView&, int64_t, const float* const*, float* const*);
template void AccumKiviVnni<2>(const EncodedView&, int64_t, const float* const*, float* const*);
template void AccumKiviVnni<3>(const EncodedView&, int64_t, const float* const*, float* const*);
template void AccumKiviVnni<4>(const EncodedView&, int64_t, const float* const*, float* const*);

}  // namespace kvtier::internal
