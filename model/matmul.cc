#include "model/matmul.h"

#include "kernels/codec_internal.h"

namespace kvtier::model {

void MatMul(const float* x, int n, const float* w, int rows, int cols, float* out,
            KernelLevel level) {
  if (level != KernelLevel::kReference && kvtier::internal::SimdAvailable()) {
    return internal::MatMulAvx2(x, n, w, rows, cols, out);
  }
  for (int r = 0; r < rows; ++r) {
    const float* wr = w + static_cast<int64_t>(r) * cols;
    for (int t = 0; t < n; ++t) {
      const float* xt = x + static_cast<int64_t>(t) * cols;
      float acc = 0;
      for (int j = 0; j < cols; ++j) acc += wr[j] * xt[j];
      out[static_cast<int64_t>(t) * rows + r] = acc;
    }
  }
}

}  // namespace kvtier::model
