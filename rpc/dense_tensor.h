// kvtier.v1.DenseTensor, the q/k/v/o of the Worker RPCs, to and from fp32
// rows: shared by the worker service and the engines that call it.
#ifndef KVTIER_RPC_DENSE_TENSOR_H_
#define KVTIER_RPC_DENSE_TENSOR_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvtier/v1/worker.pb.h"

namespace kvtier {

// The token count of `t`, a [tokens, heads, d] tensor of fp32, fp16 or bf16
// whose bytes match its shape; INVALID_ARGUMENT (naming `what`) otherwise.
absl::StatusOr<int64_t> DenseTokens(const v1::DenseTensor& t, int heads, int d, const char* what);

// Widens every element of `t` (checked by DenseTokens) into `out`.
void ReadDense(const v1::DenseTensor& t, float* out);

// An answer's output tensor widened into out[0, n): INTERNAL (naming `what`)
// unless `t` is a well-formed [tokens, heads, d] tensor of exactly n elements.
absl::Status ReadDenseExactly(const v1::DenseTensor& t, float* out, size_t n, const char* what);

// Appends the rows of `t`, a [tokens, heads, d] tensor of fp32, fp16 or bf16,
// to `out` as fp32. INVALID_ARGUMENT (naming `what`) for another shape,
// dtype or byte count.
absl::Status AppendDense(const v1::DenseTensor& t, int heads, int d, const char* what,
                         std::vector<float>* out);

// Writes rows [t0, t0 + tokens) of `x` ([*, heads, d] fp32) to `t` in `dtype`
// (fp32, fp16 or bf16): the caller's own dtype goes back on the wire.
void WriteDense(const float* x, int64_t t0, int64_t tokens, int heads, int d, v1::DType dtype,
                v1::DenseTensor* t);

}  // namespace kvtier

#endif  // KVTIER_RPC_DENSE_TENSOR_H_
