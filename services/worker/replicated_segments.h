// worker::SegmentStore over one or several kvtier-stores: a session opened
// with store replicas (OpenSessionRequest.store_addresses, as the
// controller's Route answers them) keeps every round on each of them; any
// other session uses the worker's own --store.
//
// Writes go to every replica, and a round counts as stored only when all of
// them hold it (a failure names the replica; the engine then drops what half
// landed and keeps the round open). Reads go to the first replica and fall
// back to the next on UNAVAILABLE, DEADLINE_EXCEEDED (while the call's
// deadline lasts) or NOT_FOUND.
#ifndef KVTIER_SERVICES_WORKER_REPLICATED_SEGMENTS_H_
#define KVTIER_SERVICES_WORKER_REPLICATED_SEGMENTS_H_

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "client/store_client.h"
#include "services/worker/store_segments.h"
#include "worker/segment_store.h"

namespace kvtier {

// Thread-safe.
class ReplicatedSegments : public worker::SegmentStore {
 public:
  // `primary`: the worker's --store, for sessions without replicas of their
  // own. `replica_options`: how to reach the others (token, TLS, deadline);
  // its target is ignored.
  ReplicatedSegments(std::unique_ptr<StoreSegments> primary, StoreClientOptions replica_options);

  // The stores that hold (tenant, session); empty: the worker's --store.
  // INVALID_ARGUMENT for more than 3 addresses, a repeated one or an empty
  // one.
  absl::Status SetReplicas(const std::string& tenant, const std::string& session,
                           const std::vector<std::string>& addresses);
  void Forget(const std::string& tenant, const std::string& session);

  absl::Status Put(const std::string& session, const Segment& s, uint32_t layer_begin,
                   uint32_t layer_end, std::string_view payload, const CallOptions& call) override;
  absl::StatusOr<std::vector<std::string>> Get(const std::string& session,
                                               const std::vector<Segment>& segments,
                                               const CallOptions& call) override;
  absl::Status Delete(const std::string& session, const CallOptions& call) override;
  absl::Status DropRound(const std::string& session, uint32_t round,
                         const CallOptions& call) override;
  absl::Status RecordRecalls(const std::string& session, const std::vector<uint32_t>& rounds,
                             const CallOptions& call) override;

  StoreSegments* primary() { return primary_.get(); }
  // Reads served by a replica other than the session's first.
  uint64_t read_fallbacks() const { return read_fallbacks_.load(); }

 private:
  // The session's stores, first first (never empty).
  std::vector<std::pair<std::string, StoreSegments*>> For(const CallOptions& call,
                                                          const std::string& session);

  std::unique_ptr<StoreSegments> primary_;
  const StoreClientOptions replica_options_;
  absl::Mutex mu_;
  std::map<std::pair<std::string, std::string>, std::vector<std::string>> replicas_
      ABSL_GUARDED_BY(mu_);
  // One client per store address, kept for the worker's life.
  std::map<std::string, std::unique_ptr<StoreSegments>> pool_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> read_fallbacks_{0};
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_WORKER_REPLICATED_SEGMENTS_H_
