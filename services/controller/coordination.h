// How kvtier-controller replicas share what they know: the coordination
// back end, chosen at start (docs/cluster.md).
//   EmbeddedCoordination: one controller process; membership in memory, and
//     placements rebuilt from the workers' reports after a restart.
//   EtcdBackend (etcd_backend.h): several replicas sharing node records,
//     placements and policies through etcd, one of them elected leader.
// The service calls it on every Register and Heartbeat, the server's sweep
// once per tick.
#ifndef KVTIER_SERVICES_CONTROLLER_COORDINATION_H_
#define KVTIER_SERVICES_CONTROLLER_COORDINATION_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "controller/controller.h"

namespace kvtier {

// Implementations are thread-safe.
class Coordination {
 public:
  virtual ~Coordination() = default;
  // A node registered at this replica (the local membership has taken it).
  virtual absl::Status NodeRegistered(const controller::NodeSpec& spec) = 0;
  // A heartbeat at this replica: renews the node's lease. NOT_FOUND for a
  // node that must register again.
  virtual absl::Status NodeHeartbeat(const std::string& id, uint64_t used_bytes,
                                     uint32_t active_sessions) = 0;
  // Once per sweep tick, before the controller's own Tick: pulls what other
  // replicas wrote, and keeps or takes the lead. True while this replica
  // runs the background loops (dead-replica replacement, repair).
  virtual bool Sync() = 0;
  virtual bool leader() const = 0;
  // Whether placements are rebuilt from the sessions workers report at
  // registration (Controller::Adopt): only where they live nowhere else.
  virtual bool AdoptsReports() const = 0;
};

// One controller process: everything in its own memory; it always leads.
class EmbeddedCoordination final : public Coordination {
 public:
  explicit EmbeddedCoordination(controller::Membership* membership) : membership_(membership) {}
  absl::Status NodeRegistered(const controller::NodeSpec&) override { return absl::OkStatus(); }
  absl::Status NodeHeartbeat(const std::string& id, uint64_t used_bytes,
                             uint32_t active_sessions) override {
    return membership_->Heartbeat(id, used_bytes, active_sessions);
  }
  bool Sync() override { return true; }
  bool leader() const override { return true; }
  bool AdoptsReports() const override { return true; }

 private:
  controller::Membership* const membership_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_CONTROLLER_COORDINATION_H_
