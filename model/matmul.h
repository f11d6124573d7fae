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
#include "model/thread_pool.h"

namespace kvtier::model {

// x [n][cols], w [rows][cols], out [n][rows]; row-major. With a pool of
// several threads, the rows are split over them (the bits do not change).
void MatMul(const float* x, int n, const float* w, int rows, int cols, float* out,
            KernelLevel level = KernelLevel::kBest, ThreadPool* pool = nullptr);

// Splits rows [0, rows) into pieces of at least 64 rows (an even number)
// over `pool` and calls run(r0, r1) for each; without a pool, or with too
// few rows, run(0, rows) on the calling thread.
void SplitRows(int rows, ThreadPool* pool, const std::function<void(int, int)>& run);

namespace internal {
// Rows [r0, r1) of MatMul.
void MatMulAvx2(const float* x, int n, const float* w, int rows, int cols, int r0, int r1,
                float* out);
}  // namespace internal

}  // namespace kvtier::model

#endif  // KVTIER_MODEL_MATMUL_H_
