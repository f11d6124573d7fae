// The Worker wire types and the engine's own, converted once at the service
// edge: ModelSpec -> ModelShape, Policy -> SessionPolicy (a struct, never
// text), DenseTensor <-> fp32 rows in the caller's dtype.
#ifndef KVTIER_SERVICES_WORKER_POLICY_PROTO_H_
#define KVTIER_SERVICES_WORKER_POLICY_PROTO_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvtier/v1/worker.pb.h"
#include "worker/engine.h"

namespace kvtier {

// INVALID_ARGUMENT for a shape the worker cannot hold or an unknown dtype.
absl::StatusOr<worker::ModelShape> ShapeFromProto(const v1::ModelSpec& m);

// Converts the wire policy to the engine's: unset fields (zero scalars,
// absent optionals) take the published defaults (ALGORITHMS.md); the
// presence-aware booleans keep an explicit false. INVALID_ARGUMENT for an
// unknown method, codec or recall strategy, or a bad parameter. CODEC_RAW
// (and unset) stores the model's own dtype (`model_dtype`; fp32 when
// unspecified): lossless.
absl::StatusOr<worker::SessionPolicy> PolicyFromProto(const v1::Policy& p,
                                                      v1::DType model_dtype = v1::DTYPE_FP32);

// The policy a session runs with, every default filled in (L_w resolved).
v1::Policy EffectivePolicy(const v1::Policy& requested, const worker::SessionPolicy& eff);

// The token count of `t`, a [tokens, heads, d] tensor of fp32, fp16 or bf16
// whose bytes match its shape; INVALID_ARGUMENT (naming `what`) otherwise.
absl::StatusOr<int64_t> DenseTokens(const v1::DenseTensor& t, int heads, int d, const char* what);

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

#endif  // KVTIER_SERVICES_WORKER_POLICY_PROTO_H_
