// kvtier-controller's engine (no gRPC): membership plus placement of
// sessions on workers and store replicas.
//
// Placement. A new session goes to the first live worker, in weighted
// rendezvous order (placement.h) with Membership::Weight, that has room for
// what it needs, and to the first `replicas` live stores in the same kind of
// order. The choice is recorded: a session stays with its worker and its
// stores while they live, whatever joins later (a store holds its data; a
// worker its working set). A replica that dies is replaced by the next live
// store in the session's rendezvous order, the others keep their place.
// Because rendezvous order is per session, when one node of N joins or
// leaves, only the sessions it wins or held move: about 1/N of new
// placements, and none of the sessions recorded on live nodes.
//
// Repair. A session whose store replica was replaced (its store died) or
// added (fewer stores were live when it was placed) while another replica
// still holds its rounds gets a RepairTask: copy what the survivors hold to
// the new replica. The server runs the tasks (services/controller/
// repairer.h); this class only records them.
#ifndef KVTIER_CONTROLLER_CONTROLLER_H_
#define KVTIER_CONTROLLER_CONTROLLER_H_

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "controller/membership.h"

namespace kvtier::controller {

struct ControllerOptions {
  MembershipOptions membership;
  // Store replicas per session, 1 to 3. Default: 1.
  int replicas = 1;
  // A recorded placement unused this long is forgotten (the next Route
  // places the session again, by the same rendezvous order). Default: 24 h.
  absl::Duration placement_idle = absl::Hours(24);
};

struct Placement {
  NodeInfo worker;
  // Up to `replicas` live stores, primary first; fewer only when fewer are
  // live (the session is then under-replicated until repair).
  std::vector<NodeInfo> stores;
  uint64_t epoch = 0;
  bool placed_now = false;  // A new or moved placement, not a recorded one.
  // The worker its decode steps go to, when decode-role workers are live
  // (first in the session's rendezvous order among them; not recorded).
  std::optional<NodeInfo> decode_worker;
};

// Copy a session's stored rounds from a surviving replica to a new one.
struct RepairTask {
  std::string tenant, session;
  std::vector<NodeInfo> sources;  // Live replicas that held the session, primary first.
  NodeInfo target;                // The replica that joined the session.
  int attempt = 0;                // Attempts already made.
};

// Where recorded placements are shared between controller replicas (the
// etcd back end). Each entry has a version (0: absent) that a write must
// name, so two replicas that place one session at once agree on one
// placement. Implementations are thread-safe and may block (I/O); the
// controller never calls them under its lock.
class PlacementShare {
 public:
  struct Entry {
    std::string worker;
    std::vector<std::string> stores;
    int64_t version = 0;
  };
  virtual ~PlacementShare() = default;
  // nullopt when the session has no shared placement.
  virtual absl::StatusOr<std::optional<Entry>> Load(const std::string& tenant,
                                                    const std::string& session) = 0;
  // Writes when the shared version is still `expected_version`; false when
  // another replica wrote first.
  virtual absl::StatusOr<bool> Save(const std::string& tenant, const std::string& session,
                                    const Entry& entry, int64_t expected_version) = 0;
  // Every shared placement, as (tenant, session) and entry.
  virtual absl::StatusOr<std::vector<std::pair<std::pair<std::string, std::string>, Entry>>>
  LoadAll() = 0;
};

// Thread-safe.
class Controller {
 public:
  explicit Controller(ControllerOptions options = {});

  // Shares placements through `share` (not owned; it must outlive the
  // controller): Route reads the session's shared placement before deciding
  // and writes what it decided, and ReplaceDeadStores works on every shared
  // placement. Call before serving.
  void SetPlacementShare(PlacementShare* share) { share_ = share; }
  // With a share: replaces store replicas that are not live in every shared
  // placement (the etcd leader's sweep), recording repairs. Returns how many
  // placements changed.
  absl::StatusOr<int> ReplaceDeadStores();

  Membership& membership() { return membership_; }
  const ControllerOptions& options() const { return options_; }

  // Where (tenant, session) lives, placing it when needed. `need_bytes`: the
  // working set the session is expected to need on its worker (0: any).
  // `avoid_worker`: a worker id the caller could not reach; when it is the
  // session's recorded worker the session moves to the next live worker in
  // its order (where the caller resumes it), without waiting for the lease to
  // run out. Only this session moves, so a caller can move nothing but its
  // own sessions.
  // UNAVAILABLE when no worker (other than `avoid_worker`) or no store is
  // live; RESOURCE_EXHAUSTED when live workers have no room for
  // `need_bytes`; INVALID_ARGUMENT for bad names.
  absl::StatusOr<Placement> Route(const std::string& tenant, const std::string& session,
                                  uint64_t need_bytes = 0, const std::string& avoid_worker = "");

  // A worker that (re)registered holds (tenant, session) with these store
  // replicas (addresses, primary first): recorded when the controller has no
  // placement of it (after a restart it has none), so the session stays
  // where it is. The addresses are matched to stores as they register; one
  // not registered within a lease of the controller's start counts as dead
  // (replaced, and repaired from the others).
  void Adopt(const std::string& worker_id, const std::string& tenant, const std::string& session,
             std::vector<std::string> store_addresses);

  // Declares dead the nodes whose lease ran out, replaces dead store
  // replicas in every recorded placement (recording repairs), and forgets
  // idle placements. Returns the nodes declared dead.
  std::vector<std::string> Tick();

  // The next repair to run, if any; the caller reports it with
  // RepairFinished.
  std::optional<RepairTask> NextRepair();
  // `ok`: the target holds every round the sources held. A failed task is
  // queued again (attempt + 1) while its target is still one of the
  // session's replicas and fewer than `max_attempts` were made.
  void RepairFinished(RepairTask task, bool ok, int max_attempts = 5);
  // Sessions with a repair queued or running, and recorded placements with
  // fewer than `replicas` stores.
  size_t RepairsPending() const;
  size_t UnderReplicated() const;

  // The live nodes of (tenant, session)'s recorded placement (its worker,
  // then its store replicas), without placing it; empty when it has none.
  std::vector<NodeInfo> NodesOf(const std::string& tenant, const std::string& session) const;

  // Recorded placements, and how many name `node_id`.
  size_t Placements() const;
  size_t PlacementsOn(const std::string& node_id) const;

 private:
  struct Recorded {
    std::string worker;
    std::vector<std::string> stores;
    // Reported by the worker (Adopt): store addresses not yet matched to
    // registered stores.
    std::vector<std::string> store_addresses;
    int64_t last_used_ms = 0;
  };
  using Key = std::pair<std::string, std::string>;  // (tenant, session)

  // Matches rec's reported store addresses to live stores. UNAVAILABLE
  // while one is not registered and the controller is younger than a lease.
  absl::Status ResolveReportedLocked(Recorded& rec, const std::vector<NodeInfo>& stores)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Indices of `nodes`, best first, for the session's key.
  std::vector<size_t> RankFor(const Key& key, const std::vector<NodeInfo>& nodes) const;
  // Keeps rec's live stores and fills up to `replicas` in the session's
  // order; queues a repair for each store added while a survivor remains.
  // True when the list changed.
  bool FillStoresLocked(const Key& key, Recorded& rec, const std::vector<NodeInfo>& stores)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Route without a share, or on the entry loaded from it.
  absl::StatusOr<Placement> RouteLocal(const std::string& tenant, const std::string& session,
                                       uint64_t need_bytes, const std::string& avoid_worker,
                                       const std::optional<PlacementShare::Entry>& shared,
                                       PlacementShare::Entry* decided);

  const ControllerOptions options_;
  PlacementShare* share_ = nullptr;
  Membership membership_;
  const int64_t start_ms_;
  mutable absl::Mutex mu_;
  std::map<Key, Recorded> placements_ ABSL_GUARDED_BY(mu_);
  std::deque<RepairTask> repairs_ ABSL_GUARDED_BY(mu_);
  size_t repairs_running_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvtier::controller

#endif  // KVTIER_CONTROLLER_CONTROLLER_H_
