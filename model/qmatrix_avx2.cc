// QMatMul's AVX2+FMA version (built with -mavx2 -mfma; called only when the
// CPU has them). Each group's codes are widened to float and scaled once per
// tile of tokens; each token's accumulator sees the same operations in the
// same order whatever the tile, so batching does not change its bits.
#include "kernels/x86_intrinsics.h"
#include "model/avx2_internal.h"
#include "model/qmatrix.h"

namespace kvtier::model::internal {
namespace {

__m256 Widen8(const int8_t* q) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

// Rows [r, r + R) against tokens [t, t + T). Every accumulator takes its
// groups and vectors in ascending order, whatever R and T.
template <int G, int R, int T>
void Tile(const float* x, const QMatrix& w, const float* xsum, float* out, int r, int t) {
  constexpr int kV = G / 8;  // Float vectors per group.
  __m256 acc[R][T];
  for (int i = 0; i < R; ++i) {
    for (int k = 0; k < T; ++k) acc[i][k] = _mm256_setzero_ps();
  }
  const int groups = w.cols / G;
  const int8_t* qr[R];
  const float* sr[R];
  for (int i = 0; i < R; ++i) {
    qr[i] = w.q.data() + static_cast<size_t>(r + i) * w.cols;
    sr[i] = w.scale.data() + static_cast<size_t>(r + i) * groups;
  }
  const float* xt[T];
  for (int k = 0; k < T; ++k) xt[k] = x + static_cast<size_t>(t + k) * w.cols;
  for (int g = 0; g < groups; ++g) {
    __m256 s[R];
    for (int i = 0; i < R; ++i) s[i] = _mm256_set1_ps(sr[i][g]);
    for (int v = 0; v < kV; ++v) {
      const int at = g * G + v * 8;
      __m256 wv[R];
      for (int i = 0; i < R; ++i) wv[i] = _mm256_mul_ps(Widen8(qr[i] + at), s[i]);
      for (int k = 0; k < T; ++k) {
        const __m256 xv = _mm256_loadu_ps(xt[k] + at);
        for (int i = 0; i < R; ++i) acc[i][k] = _mm256_fmadd_ps(wv[i], xv, acc[i][k]);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int k = 0; k < T; ++k) {
      float sum = Sum8(acc[i][k]);
      if (xsum != nullptr) {
        const float* br = w.bias.data() + static_cast<size_t>(r + i) * groups;
        const float* xs = xsum + static_cast<size_t>(t + k) * groups;
        float b = 0;
        for (int g = 0; g < groups; ++g) b += br[g] * xs[g];
        sum += b;
      }
      out[static_cast<size_t>(t + k) * w.rows + r + i] = sum;
    }
  }
}

template <int G, int R>
void Rows(const float* x, int t0, int m, const QMatrix& w, const float* xsum, float* out, int r) {
  int t = t0;
  for (; t + 4 <= t0 + m; t += 4) Tile<G, R, 4>(x, w, xsum, out, r, t);
  for (; t < t0 + m; ++t) Tile<G, R, 1>(x, w, xsum, out, r, t);
}

template <int G>
void Run(const float* x, int n, const QMatrix& w, const float* xsum, int r0, int r1, float* out) {
  constexpr int kChunk = 64;
  for (int t0 = 0; t0 < n; t0 += kChunk) {
    const int m = n - t0 < kChunk ? n - t0 : kChunk;
    // Two rows at a time pay off once a tile of tokens shares them; a
    // decode step (one token) goes row by row. The bits are the same.
    int r = r0;
    if (m >= 4) {
      for (; r + 2 <= r1; r += 2) Rows<G, 2>(x, t0, m, w, xsum, out, r);
    }
    for (; r < r1; ++r) Rows<G, 1>(x, t0, m, w, xsum, out, r);
  }
}

}  // namespace

void QMatMulAvx2(const float* x, int n, const QMatrix& w, const float* xsum, int r0, int r1,
                 float* out) {
  if (w.group == 16) return Run<16>(x, n, w, xsum, r0, r1, out);
  return Run<32>(x, n, w, xsum, r0, r1, out);
}

}  // namespace kvtier::model::internal
