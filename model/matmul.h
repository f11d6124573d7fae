// The forward pass's matrix products, float32: out[t][r] = W[r] . x[t] for
// n tokens at once, each weight row read once per tile of tokens.
//
// Every (row, token) product is summed in the same order whatever n is and
// wherever the token falls in its tile, so running tokens one at a time or
// in a batch gives identical bits (Forward::Step and Forward::Run rely on
// it). The vectorized version (AVX2+FMA, chosen at run time like the
// codecs', kernels/codec.h) sums in another order than the scalar one.
#ifndef KVTIER_MODEL_MATMUL_H_
#define KVTIER_MODEL_MATMUL_H_

#include <cstdint>

#include "kernels/codec.h"

namespace kvtier::model {

// x [n][cols], w [rows][cols], out [n][rows]; row-major.
void MatMul(const float* x, int n, const float* w, int rows, int cols, float* out,
            KernelLevel level = KernelLevel::kBest);

namespace internal {
void MatMulAvx2(const float* x, int n, const float* w, int rows, int cols, float* out);
}  // namespace internal

}  // namespace kvtier::model

#endif  // KVTIER_MODEL_MATMUL_H_
