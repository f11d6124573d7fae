// Cluster membership with leases: nodes (workers and stores) register, send
// heartbeats, and are declared dead when their lease runs out. The live set
// has an epoch that changes whenever it does, so clients that cache routes
// know when to refresh.
//
// A node that (re)registers starts with a small placement weight that grows
// to its full weight over a warm-up period, so a restarted, empty node is
// not handed every new placement at once.
#ifndef KVTIER_CONTROLLER_MEMBERSHIP_H_
#define KVTIER_CONTROLLER_MEMBERSHIP_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/clock.h"

namespace kvtier::controller {

enum class NodeKind { kWorker, kStore };
enum class WorkerRole { kBoth, kPrefill, kDecode };
const char* WorkerRoleName(WorkerRole r);
const char* NodeKindName(NodeKind k);

// Memory pressure of a node: its used bytes over its capacity against
// MembershipOptions' thresholds. Ordered: a higher level is worse.
enum class Pressure { kNone = 0, kModerate = 1, kHigh = 2 };
const char* PressureName(Pressure p);

struct NodeSpec {
  std::string id;  // [A-Za-z0-9._:-]{1,128}
  NodeKind kind = NodeKind::kWorker;
  std::string address;          // host:port it serves on.
  uint64_t capacity_bytes = 0;  // 0: unknown (placement treats it as free).
  bool has_gpu = false;
  // Workers: which steps it serves (--role). Sessions are placed on kBoth and
  // kPrefill workers; kDecode workers take decode steps after a hand-off.
  WorkerRole role = WorkerRole::kBoth;
};

struct NodeInfo {
  NodeSpec spec;
  bool live = false;
  uint64_t used_bytes = 0;
  uint32_t active_sessions = 0;
  int64_t registered_ms = 0;      // Of the current incarnation.
  int64_t last_heartbeat_ms = 0;  // Registration counts as one.
};

struct MembershipOptions {
  // How often nodes report. Default: 1 s.
  absl::Duration heartbeat_interval = absl::Seconds(1);
  // Heartbeats a node may miss before it is declared dead. Default: 3.
  int missed_heartbeats = 3;
  // A (re)registered node's weight grows linearly from warmup_floor of its
  // full weight to all of it over this long. Zero: no warm-up. Default: 30 s.
  absl::Duration warmup = absl::Seconds(30);
  double warmup_floor = 0.1;
  // Used over capacity at which a node's pressure is MODERATE, and HIGH.
  // Default: 0.80 and 0.95.
  double pressure_moderate = 0.80;
  double pressure_high = 0.95;
  // Time source; not owned. Default: the real clock.
  Clock* clock = Clock::Real();
};

// Thread-safe.
class Membership {
 public:
  explicit Membership(MembershipOptions options = {});

  // Adds a node, or renews one that comes back (dead, restarted, or
  // re-registering with the same address): it starts a new incarnation and
  // warms up again. INVALID_ARGUMENT for a bad id, kind or address;
  // ALREADY_EXISTS when the id is live with another address, or another live
  // node serves on this address.
  absl::Status Register(const NodeSpec& spec);
  // Renews the node's lease and records its usage. NOT_FOUND for an unknown
  // node or one declared dead (it must register again).
  absl::Status Heartbeat(const std::string& id, uint64_t used_bytes, uint32_t active_sessions);
  // Declares dead every live node whose lease ran out; returns their ids.
  std::vector<std::string> Sweep();

  // Live nodes of a kind, by id.
  std::vector<NodeInfo> Live(NodeKind kind) const;
  // Every node ever registered (dead ones too), by id.
  std::vector<NodeInfo> All() const;
  // One of them; nullopt for an id never registered.
  std::optional<NodeInfo> Get(const std::string& id) const;
  // Changes whenever the live set or a live node's address changes.
  uint64_t epoch() const;
  // The node's placement weight now: its free fraction of capacity (at
  // least 5%; 1 when capacity is unknown) times its warm-up factor.
  double Weight(const NodeInfo& n) const;
  // The node's pressure now: kNone for a dead node or one of unknown
  // capacity.
  Pressure PressureOf(const NodeInfo& n) const;
  absl::Duration lease() const { return options_.heartbeat_interval * options_.missed_heartbeats; }
  const MembershipOptions& options() const { return options_; }

 private:
  const MembershipOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::string, NodeInfo> nodes_ ABSL_GUARDED_BY(mu_);
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace kvtier::controller

#endif  // KVTIER_CONTROLLER_MEMBERSHIP_H_
