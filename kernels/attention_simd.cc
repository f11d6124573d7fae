// The vectorized decode-attention kernels (AVX2+FMA+F16C+BMI2;
// kernels/simd_avx2.h): q.K^T and P.V over raw or KIVI/KCVT blocks in fp32,
// dispatching to the integer kernels (attention_int_simd.cc) and the VNNI
// ones (attention_vnni.cc) where they apply; and the softmax.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/simd_avx2.h"

namespace kvtier::internal {

namespace {

// scores[r][t] = scale * q[r] . row_t over `n` raw rows, R query heads at once.
template <int R>
void ScoreRaw(DType dtype, const void* base, int64_t first, int64_t token_stride, int64_t n, int d,
              const float* const* q, float scale, float* const* scores) {
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

template <int R>
void AccumRaw(DType dtype, const void* base, int64_t first, int64_t token_stride, int64_t n, int d,
              const float* const* p, float* const* out) {
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
  if (b.codec == Codec::kRaw) return true;
  if (b.codec != Codec::kKivi && b.codec != Codec::kKcvt) return false;
  QuantShape q;
  q.key = b.role != TensorRole::kValue;
  q.bits = b.bits;
  q.group = b.group;
  q.d = b.head_dim;
  return Supported(q);
}

template <int R>
void ScoreBlock(const EncodedView& k, int64_t s, const float* const* q, float scale,
                float* const* scores, bool integer) {
  if (k.codec == Codec::kRaw) {
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
  if (v.codec == Codec::kRaw) {
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
