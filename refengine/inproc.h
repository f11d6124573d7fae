// In-process mode: the worker engine (worker::Engine) runs inside the
// inference engine's process, and only the store is remote. Attention costs
// no hop per layer: the shape of an engine that keeps attention on its own
// GPU and uses kvtier for what it keeps between rounds (the LMCache/vLLM
// connector shape), against tier mode's attention disaggregation.
#ifndef KVTIER_REFENGINE_INPROC_H_
#define KVTIER_REFENGINE_INPROC_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kvtier/v1/worker.pb.h"
#include "refengine/conversation.h"
#include "worker/engine.h"

namespace kvtier::refengine {

// A session of `engine` (not owned; it must outlive the session) with the
// wire `policy` (rpc/policy_proto.h converts it as kvtier-worker does):
// the same TierSession as TierBackend, every call in process. The worker's
// statuses come back unchanged.
absl::StatusOr<std::unique_ptr<TierSession>> InProcessBackend(worker::Engine* engine,
                                                              const v1::ModelSpec& spec,
                                                              const std::string& session,
                                                              const v1::Policy& policy);

}  // namespace kvtier::refengine

#endif  // KVTIER_REFENGINE_INPROC_H_
