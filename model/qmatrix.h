// A weight matrix kept in 8-bit codes: every block-quantized GGUF type
// (model/quant.h) written exactly as int8 codes q with, per group of 16 or 32
// weights of a row, a float scale s and bias b, so that each weight is
// s * q + b in float32, the value DequantizeRow gives, bit for bit. A decode
// step reads 1.25 to 1.5 bytes per weight instead of float32's 4.
//
// QMatMul multiplies like MatMul (model/matmul.h): out[t][r] = W[r] . x[t],
// float32 activations, every (row, token) product summed in the same order
// whatever the batch; AVX2+FMA chosen at run time, scalar otherwise.
#ifndef KVTIER_MODEL_QMATRIX_H_
#define KVTIER_MODEL_QMATRIX_H_

#include <cstdint>
#include <vector>

#include "kernels/codec.h"
#include "model/quant.h"
#include "model/thread_pool.h"

namespace kvtier::model {

struct QMatrix {
  int rows = 0;
  int cols = 0;
  int group = 32;            // Weights per scale: 32, or 16 (Q6_K, Q2_K).
  std::vector<int8_t> q;     // [rows][cols]
  std::vector<float> scale;  // [rows][cols / group]
  std::vector<float> bias;   // [rows][cols / group]; empty when every bias is 0.

  int groups() const { return cols / group; }
  // Row r's weights in float32 (s * q + b).
  void Row(int r, float* out) const;
};

// True for the types QMatrix holds exactly (every block-quantized type).
bool QMatrixHolds(GgmlType t);
// The matrix of `rows` rows of `cols` weights of type t at `data`
// (QMatrixHolds(t), cols a multiple of the type's block).
QMatrix ToQMatrix(GgmlType t, const void* data, int rows, int cols);

void QMatMul(const float* x, int n, const QMatrix& w, float* out,
             KernelLevel level = KernelLevel::kBest, ThreadPool* pool = nullptr);

namespace internal {
// Rows [r0, r1) of QMatMul; xsum [n][groups] the sums of x over each group
// (null when the matrix has no biases).
void QMatMulAvx2(const float* x, int n, const QMatrix& w, const float* xsum, int r0, int r1,
                 float* out);
}  // namespace internal

}  // namespace kvtier::model

#endif  // KVTIER_MODEL_QMATRIX_H_
