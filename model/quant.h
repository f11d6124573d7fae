// ggml's tensor element types as GGUF files store them: plain floats and the
// block-quantized types, each a run of fixed-size blocks of 32 (Q4_0 .. Q8_0)
// or 256 (the K types) weights. Byte layouts: docs/models.md.
//
// DequantizeRow is the production path (float32 arithmetic in the order ggml
// uses); DequantizeRowReference
// re-derives every weight in float64 straight from the published layout, one
// weight at a time, and exists to check the first.
#ifndef KVTIER_MODEL_QUANT_H_
#define KVTIER_MODEL_QUANT_H_

#include <cstdint>

#include "absl/status/status.h"

namespace kvtier::model {

// Numbered as in ggml (and GGUF's tensor table).
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kBF16 = 30,
};

// The type's name as ggml prints it ("Q4_K"), for any number; "type N" for
// one ggml does not define.
const char* GgmlTypeName(uint32_t type);
// True for the types above (those this reader can dequantize).
bool GgmlTypeSupported(uint32_t type);
// Weights per block (1 for the float types) and bytes per block.
int BlockWeights(GgmlType t);
int BlockBytes(GgmlType t);
// Bytes of a row of n weights; n must be a multiple of BlockWeights(t).
int64_t RowBytes(GgmlType t, int64_t n);

// Writes the n weights of the row at `src` (n a multiple of BlockWeights)
// as float32.
void DequantizeRow(GgmlType t, const void* src, float* dst, int64_t n);
// The same weights in float64, from the layout, one weight at a time.
void DequantizeRowReference(GgmlType t, const void* src, double* dst, int64_t n);

}  // namespace kvtier::model

#endif  // KVTIER_MODEL_QUANT_H_
