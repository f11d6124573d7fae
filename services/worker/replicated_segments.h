// worker::SegmentStore over one or several kvtier-stores: a session opened
// with store replicas (OpenSessionRequest.store_addresses, as the
// controller's Route answers them) keeps every round on each of them; any
// other session uses the worker's own --store.
//
// Writes go to every replica, and a round counts as stored only when all of
// them hold it (a failure names the replica; the engine then drops what half
// landed and keeps the round open). With a rerouter (the worker's
// controller), a replica that cannot be reached at a round's first segment
// is replaced by where the controller now places the session (the
// controller is asked with a deadline of its own, 2 s, since the failed call
// may have spent the budget). Reads go to the first replica and fall back to
// the next on UNAVAILABLE, DEADLINE_EXCEEDED (while the call's deadline
// lasts) or NOT_FOUND; each replica tried gets an equal share of what is
// left of the call's deadline, so a store that stopped answering leaves
// time for the next.
#ifndef KVTIER_SERVICES_WORKER_REPLICATED_SEGMENTS_H_
#define KVTIER_SERVICES_WORKER_REPLICATED_SEGMENTS_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "client/store_client.h"
#include "client/store_segments.h"
#include "kvtier/v1/controller.pb.h"
#include "services/worker/known_nodes.h"
#include "worker/segment_store.h"

namespace kvtier {

// Thread-safe.
class ReplicatedSegments : public worker::SegmentStore {
 public:
  // `primary`: the worker's --store, for sessions without replicas of their
  // own. `replica_options`: how to reach the others (token, TLS, deadline);
  // its target is ignored. `known`: the only addresses replicas may have.
  ReplicatedSegments(std::unique_ptr<StoreSegments> primary, StoreClientOptions replica_options,
                     std::unique_ptr<KnownNodes> known);

  // OK when `addresses` may be a session's replicas: at most 3, none empty
  // or repeated (INVALID_ARGUMENT otherwise), each a known store
  // (KnownNodes::Check: PERMISSION_DENIED for any other). Connects to none.
  absl::Status CheckReplicas(const std::vector<std::string>& addresses, const CallOptions& call);
  // The stores that hold (tenant, session); empty: the worker's --store.
  // CheckReplicas first: nothing is dialled unless it passes.
  absl::Status SetReplicas(const std::string& tenant, const std::string& session,
                           const std::vector<std::string>& addresses, const CallOptions& call);
  void Forget(const std::string& tenant, const std::string& session);
  // The stores SetReplicas named for (tenant, session); empty when none.
  std::vector<std::string> Replicas(const std::string& tenant, const std::string& session);
  // Every session with replicas of its own: what the worker reports when it
  // registers with the controller.
  std::vector<v1::HeldSession> Held();

  // Asks where a session's replicas are now (the controller's Route, acting
  // for `tenant`). When set, a round whose first segment cannot reach a
  // replica (UNAVAILABLE, DEADLINE_EXCEEDED) is written to the answer
  // instead, if it no longer names that replica: a dead store is replaced
  // without failing the round. Set before serving.
  using Rerouter = std::function<absl::StatusOr<std::vector<std::string>>(
      const std::string& tenant, const std::string& session, const CallOptions& call)>;
  void SetRerouter(Rerouter r) { rerouter_ = std::move(r); }
  // The controller's placement epoch as this worker last heard it (its
  // heartbeats). With a rerouter, a round's first segment of a session whose
  // replica list predates the current epoch asks the controller first, so a
  // store the controller replaced (dead, even if it came back since) gets no
  // more rounds, and the replacement gets them all. Set before serving.
  void SetEpochSource(std::function<uint64_t()> epoch) { epoch_ = std::move(epoch); }
  // Sessions moved to other replicas by the rerouter.
  uint64_t reroutes() const { return reroutes_.load(); }

  absl::Status Put(const std::string& session, const Segment& s, uint32_t layer_begin,
                   uint32_t layer_end, std::string_view payload, const CallOptions& call) override;
  // Every replica's PutMany at once (a thread each beyond the first); the
  // first replica in the session's order that fails a write names the
  // failure. Replicas that stored everything are not written again on the
  // retry after a reroute; when the call fails, writes that start a round
  // are taken back from them (DropRound), so that a round is on every
  // replica or on none.
  std::vector<absl::Status> PutMany(const std::string& session,
                                    const std::vector<SegmentWrite>& writes,
                                    const CallOptions& call) override;
  absl::StatusOr<std::vector<std::string>> Get(const std::string& session,
                                               const std::vector<Segment>& segments,
                                               const CallOptions& call) override;
  absl::Status Delete(const std::string& session, const CallOptions& call) override;
  absl::Status DropRound(const std::string& session, uint32_t round,
                         const CallOptions& call) override;
  // On every replica; the first failure is returned.
  absl::Status DropSegments(const std::string& session, const std::vector<Segment>& segments,
                            const CallOptions& call) override;
  absl::Status RecordRecalls(const std::string& session, const std::vector<uint32_t>& rounds,
                             const CallOptions& call) override;
  // From the first replica that knows the session.
  absl::StatusOr<std::vector<StoredRound>> List(const std::string& session,
                                                const CallOptions& call) override;

  StoreSegments* primary() { return primary_.get(); }
  // Reads served by a replica other than the session's first.
  uint64_t read_fallbacks() const { return read_fallbacks_.load(); }

 private:
  // Asks the rerouter for the session's replicas when its list predates the
  // current epoch, and takes the answer.
  void RefreshIfStale(const std::string& session, const CallOptions& call);
  // The session's stores, first first (never empty).
  std::vector<std::pair<std::string, StoreSegments*>> For(const CallOptions& call,
                                                          const std::string& session);

  std::unique_ptr<StoreSegments> primary_;
  const StoreClientOptions replica_options_;
  const std::unique_ptr<KnownNodes> known_;
  absl::Mutex mu_;
  std::map<std::pair<std::string, std::string>, std::vector<std::string>> replicas_
      ABSL_GUARDED_BY(mu_);
  // The epoch each session's list was last confirmed at.
  std::map<std::pair<std::string, std::string>, uint64_t> confirmed_ ABSL_GUARDED_BY(mu_);
  // One client per store address, kept for the worker's life.
  std::map<std::string, std::unique_ptr<StoreSegments>> pool_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> read_fallbacks_{0};
  std::atomic<uint64_t> reroutes_{0};
  Rerouter rerouter_;
  std::function<uint64_t()> epoch_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_WORKER_REPLICATED_SEGMENTS_H_
