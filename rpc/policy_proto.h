// The Worker wire types and the engine's own, converted once at the service
// edge: ModelSpec -> ModelShape, Policy -> SessionPolicy (a struct, never
// text). Used by the worker service and by engines that host the worker
// engine in process (refengine/inproc.h).
#ifndef KVTIER_RPC_POLICY_PROTO_H_
#define KVTIER_RPC_POLICY_PROTO_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvtier/v1/controller.pb.h"
#include "kvtier/v1/worker.pb.h"
#include "worker/engine.h"

namespace kvtier {

// INVALID_ARGUMENT for a shape the worker cannot hold or an unknown dtype.
absl::StatusOr<worker::ModelShape> ShapeFromProto(const v1::ModelSpec& m);

// Converts the wire policy to the engine's: unset fields (zero scalars,
// absent optionals) take the published defaults (ALGORITHMS.md); the
// presence-aware booleans keep an explicit false. INVALID_ARGUMENT for an
// unknown method, codec or recall strategy, or a bad parameter; for an
// eviction "profile:<name>" without layer_budgets (a profile travels as its
// budgets: nothing here opens a file a client names). CODEC_RAW
// (and unset) stores the model's own dtype (`model_dtype`; fp32 when
// unspecified): lossless.
absl::StatusOr<worker::SessionPolicy> PolicyFromProto(const v1::Policy& p,
                                                      DType model_dtype = DType::kFp32);

// The policy of a GetPolicy answer (kvtier-controller's per-model policy):
// PolicyFromProto of its policy, except that non-empty layer_budgets make
// the eviction a layer profile (SnapKV selection with those per-head budgets
// per layer, the policy's window and kernel). INVALID_ARGUMENT as
// PolicyFromProto, or for a layer budget not above the window.
absl::StatusOr<worker::SessionPolicy> PolicyFromAnswer(const v1::GetPolicyResponse& a,
                                                       DType model_dtype = DType::kFp32);

// The policy a session runs with, every default filled in (L_w resolved).
v1::Policy EffectivePolicy(const v1::Policy& requested, const worker::SessionPolicy& eff);

// EndRound's report as kvtier-worker answers it (speculation figures and the
// process's memory included).
v1::EndRoundResponse EndRoundToProto(const worker::EndRoundReport& r);

v1::ProcessMemory ProcessMemoryToProto(const ProcessMemory& m);

// A recall decision as a prefill response carries it.
v1::RecallDecision RecallToProto(const worker::RecallReport& r);

}  // namespace kvtier

#endif  // KVTIER_RPC_POLICY_PROTO_H_
