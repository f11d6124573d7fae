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
#ifndef KVTIER_CONTROLLER_CONTROLLER_H_
#define KVTIER_CONTROLLER_CONTROLLER_H_

#include <cstdint>
#include <map>
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
};

// Thread-safe.
class Controller {
 public:
  explicit Controller(ControllerOptions options = {});

  Membership& membership() { return membership_; }
  const ControllerOptions& options() const { return options_; }

  // Where (tenant, session) lives, placing it when needed. `need_bytes`: the
  // working set the session is expected to need on its worker (0: any).
  // UNAVAILABLE when no worker or no store is live; RESOURCE_EXHAUSTED when
  // live workers have no room for `need_bytes`; INVALID_ARGUMENT for bad
  // names.
  absl::StatusOr<Placement> Route(const std::string& tenant, const std::string& session,
                                  uint64_t need_bytes = 0);

  // Declares dead the nodes whose lease ran out and forgets idle
  // placements. Returns the nodes declared dead.
  std::vector<std::string> Tick();

  // Recorded placements, and how many name `node_id`.
  size_t Placements() const;
  size_t PlacementsOn(const std::string& node_id) const;

 private:
  struct Recorded {
    std::string worker;
    std::vector<std::string> stores;
    int64_t last_used_ms = 0;
  };
  using Key = std::pair<std::string, std::string>;  // (tenant, session)

  const ControllerOptions options_;
  Membership membership_;
  mutable absl::Mutex mu_;
  std::map<Key, Recorded> placements_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier::controller

#endif  // KVTIER_CONTROLLER_CONTROLLER_H_
