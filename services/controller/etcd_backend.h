// kvtier-controller's etcd back end: several controller replicas share one
// view through etcd (Debian's etcd-server), and one of them, elected, runs
// the background sweep (dead-replica replacement, and the repairs it
// queues).
//
// Keys, under --etcd_prefix (default /kvtier):
//   nodes/<node id>              a node's record, attached to an etcd lease
//                                of the node's own (its membership lease):
//                                "kind address capacity used sessions gpu
//                                 lease heartbeat_ms registered_ms"
//   placements/<tenant>/<session> "worker store,store,..." (PlacementShare;
//                                the key's mod revision is its version)
//   policies/<model>             a serialized SetPolicyRequest
//   leader                       the leader replica's id, under its lease
// Register and Heartbeat may reach any replica; it writes the node's record
// (a heartbeat renews the node's lease and its usage). Every replica pulls
// the records each tick into its own Membership (Reconcile), so Route and
// GetPolicy answer from the same view on every replica.
#ifndef KVTIER_SERVICES_CONTROLLER_ETCD_BACKEND_H_
#define KVTIER_SERVICES_CONTROLLER_ETCD_BACKEND_H_

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "controller/controller.h"
#include "services/controller/coordination.h"
#include "services/controller/etcd_client.h"

namespace kvtier {

struct EtcdBackendOptions {
  std::string prefix = "/kvtier";
  // This replica's name in the election. Required.
  std::string replica_id;
  // The leader's lease: a dead leader is replaced within about this (etcd
  // rounds it up to whole seconds, and to its minimum). Default: 3 s.
  absl::Duration leader_lease = absl::Seconds(3);
};

// Thread-safe. `controller` is not owned and must outlive it.
class EtcdBackend final : public controller::PlacementShare, public Coordination {
 public:
  EtcdBackend(std::unique_ptr<EtcdClient> etcd, EtcdBackendOptions options,
              controller::Controller* controller);

  // A node registered at this replica: a new lease (its membership lease)
  // and its record.
  absl::Status NodeRegistered(const controller::NodeSpec& spec) override;
  // A heartbeat at this replica: renews the node's lease and records its
  // usage in etcd, and in this replica's membership (registering it here
  // when it registered at another replica and was not pulled yet).
  // NOT_FOUND when etcd has no live record of it (it must register again).
  absl::Status NodeHeartbeat(const std::string& id, uint64_t used_bytes,
                             uint32_t active_sessions) override;
  // Reconcile, then Campaign; failures to read etcd are logged.
  bool Sync() override;
  bool AdoptsReports() const override { return false; }  // Placements live in etcd.
  // Pulls every node record into the local membership: new nodes and new
  // incarnations register, fresh records count as heartbeats. Records whose
  // heartbeat is older than the membership lease are left to expire.
  absl::Status Reconcile();
  // Keeps or takes the leadership; true while this replica leads.
  bool Campaign();
  bool leader() const override { return leader_.load(); }

  // Model policies (PolicyBook's shared store).
  absl::Status PutPolicy(const std::string& model, const std::string& bytes);
  absl::StatusOr<std::optional<std::string>> GetPolicy(const std::string& model);

  // controller::PlacementShare.
  absl::StatusOr<std::optional<Entry>> Load(const std::string& tenant,
                                            const std::string& session) override;
  absl::StatusOr<bool> Save(const std::string& tenant, const std::string& session,
                            const Entry& entry, int64_t expected_version) override;
  absl::StatusOr<std::vector<std::pair<std::pair<std::string, std::string>, Entry>>> LoadAll()
      override;

 private:
  struct Record {
    controller::NodeSpec spec;
    uint64_t used = 0;
    uint32_t sessions = 0;
    int64_t lease = 0;
    int64_t heartbeat_ms = 0;
    int64_t registered_ms = 0;
  };
  static std::string Encode(const Record& r);
  static std::optional<Record> Decode(const std::string& id, const std::string& value);
  std::string NodeKey(const std::string& id) const { return options_.prefix + "/nodes/" + id; }

  const std::unique_ptr<EtcdClient> etcd_;
  const EtcdBackendOptions options_;
  controller::Controller* const controller_;
  std::atomic<bool> leader_{false};
  absl::Mutex mu_;
  int64_t leader_lease_ ABSL_GUARDED_BY(mu_) = 0;
  // The incarnation (registered_ms) of each node as last pulled.
  std::map<std::string, int64_t> seen_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_CONTROLLER_ETCD_BACKEND_H_
