#include "model/matmul.h"

#include <algorithm>

#include "kernels/codec_internal.h"

namespace kvtier::model {

void SplitRows(int rows, ThreadPool* pool, const std::function<void(int, int)>& run) {
  constexpr int kMinRows = 64;
  const int threads = pool == nullptr ? 1 : pool->threads();
  if (threads <= 1 || rows < 2 * kMinRows) return run(0, rows);
  const int pieces = std::min(threads, rows / kMinRows);
  const int per = (rows / pieces + 1) & ~1;
  pool->ParallelFor(pieces, [&](int i) {
    const int r0 = i * per, r1 = std::min(rows, r0 + per);
    if (r0 < r1) run(r0, r1);
  });
}

void MatMul(const float* x, int n, const float* w, int rows, int cols, float* out,
            KernelLevel level, ThreadPool* pool) {
  if (level != KernelLevel::kReference && kvtier::internal::SimdAvailable()) {
    return SplitRows(rows, pool, [&](int r0, int r1) {
      internal::MatMulAvx2(x, n, w, rows, cols, r0, r1, out);
    });
  }
  SplitRows(rows, pool, [&](int r0, int r1) {
    for (int r = r0; r < r1; ++r) {
      const float* wr = w + static_cast<int64_t>(r) * cols;
      for (int t = 0; t < n; ++t) {
        const float* xt = x + static_cast<int64_t>(t) * cols;
        float acc = 0;
        for (int j = 0; j < cols; ++j) acc += wr[j] * xt[j];
        out[static_cast<int64_t>(t) * rows + r] = acc;
      }
    }
  });
}

}  // namespace kvtier::model
