// MatMul's AVX2+FMA version (built with -mavx2 -mfma; called only when the
// CPU has them).
#include "kernels/x86_intrinsics.h"
#include "model/avx2_internal.h"
#include "model/matmul.h"

namespace kvtier::model::internal {
namespace {

// Rows [r, r + R) against tokens [t, t + T): R * T accumulators, each summed
// in the same order (8 lanes, then the lanes, then the scalar tail).
template <int R, int T>
void Tile(const float* x, const float* w, int rows, int cols, float* out, int r, int t) {
  __m256 acc[R][T];
  for (int i = 0; i < R; ++i) {
    for (int k = 0; k < T; ++k) acc[i][k] = _mm256_setzero_ps();
  }
  const int vec = cols / 8 * 8;
  for (int j = 0; j < vec; j += 8) {
    __m256 xv[T];
    for (int k = 0; k < T; ++k) xv[k] = _mm256_loadu_ps(x + static_cast<int64_t>(t + k) * cols + j);
    for (int i = 0; i < R; ++i) {
      const __m256 wv = _mm256_loadu_ps(w + static_cast<int64_t>(r + i) * cols + j);
      for (int k = 0; k < T; ++k) acc[i][k] = _mm256_fmadd_ps(wv, xv[k], acc[i][k]);
    }
  }
  for (int i = 0; i < R; ++i) {
    const float* wr = w + static_cast<int64_t>(r + i) * cols;
    for (int k = 0; k < T; ++k) {
      const float* xt = x + static_cast<int64_t>(t + k) * cols;
      float s = Sum8(acc[i][k]);
      for (int j = vec; j < cols; ++j) s += wr[j] * xt[j];
      out[static_cast<int64_t>(t + k) * rows + r + i] = s;
    }
  }
}

template <int R>
void Rows(const float* x, int n, const float* w, int rows, int cols, float* out, int r) {
  int t = 0;
  for (; t + 4 <= n; t += 4) Tile<R, 4>(x, w, rows, cols, out, r, t);
  for (; t < n; ++t) Tile<R, 1>(x, w, rows, cols, out, r, t);
}

}  // namespace

void MatMulAvx2(const float* x, int n, const float* w, int rows, int cols, int r0, int r1,
                float* out) {
  // Tokens in chunks whose x fits in L2 beside the weight rows in flight.
  constexpr int kChunk = 64;
  for (int t0 = 0; t0 < n; t0 += kChunk) {
    const int m = n - t0 < kChunk ? n - t0 : kChunk;
    const float* xc = x + static_cast<int64_t>(t0) * cols;
    float* oc = out + static_cast<int64_t>(t0) * rows;
    int r = r0;
    for (; r + 2 <= r1; r += 2) Rows<2>(xc, m, w, rows, cols, oc, r);
    for (; r < r1; ++r) Rows<1>(xc, m, w, rows, cols, oc, r);
  }
}

}  // namespace kvtier::model::internal
