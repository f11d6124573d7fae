// Token rows at the engine's edge: what a step's q, k and v arrive as.
#ifndef KVTIER_WORKER_ROWS_H_
#define KVTIER_WORKER_ROWS_H_

#include <cstdint>
#include <vector>

#include "kernels/tensor_kinds.h"

namespace kvtier::worker {

// Dense token-major rows [tokens, heads, head_dim] of `dtype` (fp32, fp16 or
// bf16; little-endian), at any alignment. The shape is the session's: the
// engine reads tokens * heads * head_dim elements. Non-owning: `data` must
// stay valid for the call it is passed to. An fp32 pointer converts to rows
// implicitly; a null pointer is "no rows" (an optional argument left out).
struct Rows {
  DType dtype = DType::kFp32;
  const void* data = nullptr;

  Rows() = default;
  Rows(const float* fp32) : data(fp32) {}  // NOLINT: fp32 rows are fp32 pointers.
  Rows(DType t, const void* d) : dtype(t), data(d) {}

  bool empty() const { return data == nullptr; }
};

// Element i of `r` as fp32.
float RowValue(const Rows& r, int64_t i);

// r's `count` elements as fp32: r's own when it is fp32, else widened into
// *buf (resized) and returned from there. Null for empty rows.
const float* Fp32Rows(const Rows& r, int64_t count, std::vector<float>* buf);

}  // namespace kvtier::worker

#endif  // KVTIER_WORKER_ROWS_H_
