#include "controller/membership.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/names.h"
#include "base/status_macros.h"

namespace kvtier::controller {

const char* NodeKindName(NodeKind k) { return k == NodeKind::kWorker ? "worker" : "store"; }

const char* WorkerRoleName(WorkerRole r) {
  switch (r) {
    case WorkerRole::kPrefill:
      return "prefill";
    case WorkerRole::kDecode:
      return "decode";
    case WorkerRole::kBoth:
      break;
  }
  return "both";
}

Membership::Membership(MembershipOptions options) : options_(options) {}

absl::Status Membership::Register(const NodeSpec& spec) {
  KVT_RETURN_IF_ERROR(ValidateName("node_id", spec.id));
  if (absl::Status s = ValidateAddress("address", spec.address); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("node ", spec.id, ": ", s.message()));
  }
  const int64_t now = options_.clock->NowUnixMs();
  absl::MutexLock lock(&mu_);
  for (const auto& [id, n] : nodes_) {
    if (id != spec.id && n.live && n.spec.address == spec.address) {
      return absl::AlreadyExistsError(
          absl::StrCat("address ", spec.address, " is served by live node ", id));
    }
  }
  NodeInfo& n = nodes_[spec.id];
  if (n.live && n.spec.address != spec.address) {
    return absl::AlreadyExistsError(
        absl::StrCat("node ", spec.id, " is live at ", n.spec.address, ", not ", spec.address));
  }
  if (n.live && n.spec.kind != spec.kind) {
    return absl::AlreadyExistsError(
        absl::StrCat("node ", spec.id, " is live as a ", NodeKindName(n.spec.kind)));
  }
  const bool was_live = n.live;
  n.spec = spec;
  n.live = true;
  n.used_bytes = 0;
  n.active_sessions = 0;
  n.registered_ms = now;
  n.last_heartbeat_ms = now;
  if (!was_live) ++epoch_;
  LogInfo("node registered", {{"node", spec.id},
                              {"kind", NodeKindName(spec.kind)},
                              {"address", spec.address},
                              {"capacity_bytes", spec.capacity_bytes},
                              {"epoch", epoch_}});
  return absl::OkStatus();
}

absl::Status Membership::Heartbeat(const std::string& id, uint64_t used_bytes,
                                   uint32_t active_sessions) {
  const int64_t now = options_.clock->NowUnixMs();
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(id);
  if (it == nodes_.end() || !it->second.live) {
    return absl::NotFoundError(
        absl::StrCat("node ", id, it == nodes_.end() ? " is not registered" : " was declared dead",
                     ": register again"));
  }
  it->second.used_bytes = used_bytes;
  it->second.active_sessions = active_sessions;
  it->second.last_heartbeat_ms = now;
  return absl::OkStatus();
}

std::vector<std::string> Membership::Sweep() {
  const int64_t now = options_.clock->NowUnixMs();
  const int64_t lease_ms = absl::ToInt64Milliseconds(lease());
  std::vector<std::string> dead;
  absl::MutexLock lock(&mu_);
  for (auto& [id, n] : nodes_) {
    if (n.live && now - n.last_heartbeat_ms > lease_ms) {
      n.live = false;
      dead.push_back(id);
    }
  }
  if (!dead.empty()) {
    ++epoch_;
    for (const std::string& id : dead) {
      LogWarn("node declared dead", {{"node", id}, {"lease_ms", lease_ms}, {"epoch", epoch_}});
    }
  }
  return dead;
}

std::vector<NodeInfo> Membership::Live(NodeKind kind) const {
  std::vector<NodeInfo> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, n] : nodes_) {
    if (n.live && n.spec.kind == kind) out.push_back(n);
  }
  return out;
}

std::vector<NodeInfo> Membership::All() const {
  std::vector<NodeInfo> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, n] : nodes_) out.push_back(n);
  return out;
}

std::optional<NodeInfo> Membership::Get(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(id);
  if (it == nodes_.end()) return std::nullopt;
  return it->second;
}

uint64_t Membership::epoch() const {
  absl::MutexLock lock(&mu_);
  return epoch_;
}

const char* PressureName(Pressure p) {
  switch (p) {
    case Pressure::kNone:
      return "none";
    case Pressure::kModerate:
      return "moderate";
    case Pressure::kHigh:
      return "high";
  }
  return "?";
}

Pressure Membership::PressureOf(const NodeInfo& n) const {
  if (!n.live || n.spec.capacity_bytes == 0) return Pressure::kNone;
  const double used =
      static_cast<double>(n.used_bytes) / static_cast<double>(n.spec.capacity_bytes);
  if (used >= options_.pressure_high) return Pressure::kHigh;
  if (used >= options_.pressure_moderate) return Pressure::kModerate;
  return Pressure::kNone;
}

double Membership::Weight(const NodeInfo& n) const {
  double free = 1.0;
  if (n.spec.capacity_bytes > 0) {
    const uint64_t used = std::min(n.used_bytes, n.spec.capacity_bytes);
    free = static_cast<double>(n.spec.capacity_bytes - used) /
           static_cast<double>(n.spec.capacity_bytes);
  }
  free = std::max(free, 0.05);
  double warm = 1.0;
  const int64_t warmup_ms = absl::ToInt64Milliseconds(options_.warmup);
  if (warmup_ms > 0) {
    const int64_t age = options_.clock->NowUnixMs() - n.registered_ms;
    const double f =
        std::clamp(static_cast<double>(age) / static_cast<double>(warmup_ms), 0.0, 1.0);
    warm = options_.warmup_floor + (1.0 - options_.warmup_floor) * f;
  }
  return free * warm;
}

}  // namespace kvtier::controller
