// The worker's side of kvtier-controller's per-model policies: a session
// opened without a Policy gets its model's registered one (GetPolicy), and
// while the controller reports memory pressure for this worker, each such
// session that has gone cold is asked for again and runs its next rounds
// with the tighter answer (fewer bits, smaller eviction budgets); when the
// pressure is gone, tightened sessions go back to the registered policy.
// Sessions opened with an explicit Policy keep it.
#ifndef KVTIER_SERVICES_WORKER_CONTROLLER_POLICIES_H_
#define KVTIER_SERVICES_WORKER_CONTROLLER_POLICIES_H_

#include <atomic>
#include <map>
#include <memory>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "base/call_options.h"
#include "base/executor.h"
#include "client/controller_client.h"
#include "worker/engine.h"

namespace kvtier {

// Thread-safe. The pointers are not owned and must outlive it.
class ControllerPolicies {
 public:
  ControllerPolicies(std::shared_ptr<ControllerClient> controller, worker::Engine* engine,
                     Executor* io);
  ~ControllerPolicies();  // Waits for a pass in flight.

  // The model's registered policy for a session about to open (GetPolicy's
  // answer, checked with PolicyFromAnswer), or nullopt when the controller
  // has none for the model (the session then runs the defaults).
  // UNAVAILABLE or DEADLINE_EXCEEDED when the controller cannot answer;
  // INVALID_ARGUMENT when its answer is not a policy this worker can run.
  absl::StatusOr<std::optional<v1::GetPolicyResponse>> ForOpen(const worker::SessionKey& id,
                                                               const v1::ModelSpec& model,
                                                               const CallOptions& call);
  // The session opened with ForOpen's policy: it follows the controller.
  void Follow(const worker::SessionKey& id, const v1::ModelSpec& model);
  void Forget(const worker::SessionKey& id);
  // This worker's node id, sent with its GetPolicy calls so that its own
  // pressure counts. Set once it joined the cluster.
  void SetNodeId(std::string id) {
    absl::MutexLock lock(&mu_);
    node_id_ = std::move(id);
  }

  // A heartbeat answer (the agent's thread; never blocks): starts a pass
  // over the followed sessions on `io` when the pressure calls for one and
  // none is running.
  void OnHeartbeat(const v1::HeartbeatResponse& hb);

  // Policies applied after the open: tightened, and restored.
  uint64_t tightened() const { return tightened_.load(); }
  uint64_t restored() const { return restored_.load(); }

 private:
  struct Followed {
    v1::ModelSpec model;
    bool tightened = false;
  };
  void Pass(v1::PressureLevel level, int64_t cold_idle_ms);

  const std::shared_ptr<ControllerClient> controller_;
  worker::Engine* const engine_;
  Executor* const io_;
  absl::Mutex mu_;
  std::map<worker::SessionKey, Followed> followed_ ABSL_GUARDED_BY(mu_);
  bool pass_running_ ABSL_GUARDED_BY(mu_) = false;
  // Followed sessions running a tightened policy now.
  size_t tightened_now_ ABSL_GUARDED_BY(mu_) = 0;
  // Records that `id`'s entry (if any) runs a tightened policy or not.
  void SetTightenedLocked(const worker::SessionKey& id, bool tightened)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string node_id_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> tightened_{0}, restored_{0};
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_WORKER_CONTROLLER_POLICIES_H_
