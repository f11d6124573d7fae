#include "controller/controller.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/names.h"
#include "base/status_macros.h"
#include "controller/placement.h"

namespace kvtier::controller {
namespace {

const NodeInfo* Find(const std::vector<NodeInfo>& nodes, const std::string& id) {
  for (const NodeInfo& n : nodes) {
    if (n.spec.id == id) return &n;
  }
  return nullptr;
}

}  // namespace

Controller::Controller(ControllerOptions options)
    : options_(options), membership_(options.membership) {}

absl::StatusOr<Placement> Controller::Route(const std::string& tenant, const std::string& session,
                                            uint64_t need_bytes) {
  KVT_RETURN_IF_ERROR(ValidateName("tenant", tenant));
  KVT_RETURN_IF_ERROR(ValidateName("session_id", session));
  const std::vector<NodeInfo> workers = membership_.Live(NodeKind::kWorker);
  const std::vector<NodeInfo> stores = membership_.Live(NodeKind::kStore);
  if (workers.empty()) return absl::UnavailableError("no live worker");
  if (stores.empty()) return absl::UnavailableError("no live store");
  // The rendezvous key: tenant and session with a separator neither holds.
  const std::string key = absl::StrCat(tenant, "/", session);
  auto rank = [&](const std::vector<NodeInfo>& nodes) {
    std::vector<Candidate> c;
    c.reserve(nodes.size());
    for (const NodeInfo& n : nodes) c.push_back({n.spec.id, membership_.Weight(n)});
    return Rank(key, c);
  };
  const int replicas = std::clamp(options_.replicas, 1, 3);

  Placement out;
  out.epoch = membership_.epoch();
  absl::MutexLock lock(&mu_);
  Recorded& rec = placements_[{tenant, session}];
  rec.last_used_ms = options_.membership.clock->NowUnixMs();

  // The worker: the recorded one while it lives.
  const NodeInfo* w = rec.worker.empty() ? nullptr : Find(workers, rec.worker);
  if (w == nullptr) {
    for (size_t i : rank(workers)) {
      const NodeInfo& n = workers[i];
      const uint64_t cap = n.spec.capacity_bytes;
      if (cap == 0 || need_bytes == 0 || n.used_bytes + need_bytes <= cap) {
        w = &n;
        break;
      }
    }
    if (w == nullptr) {
      placements_.erase({tenant, session});
      return absl::ResourceExhaustedError(absl::StrCat("no live worker has room for ", need_bytes,
                                                       " more working-set bytes (", workers.size(),
                                                       " live)"));
    }
    rec.worker = w->spec.id;
    out.placed_now = true;
  }
  out.worker = *w;

  // The stores: recorded replicas that live keep their place; the others are
  // replaced in the session's rendezvous order.
  std::vector<std::string> kept;
  for (const std::string& id : rec.stores) {
    if (Find(stores, id) != nullptr) kept.push_back(id);
  }
  if (static_cast<int>(kept.size()) < replicas && kept.size() < stores.size()) {
    for (size_t i : rank(stores)) {
      if (static_cast<int>(kept.size()) == replicas) break;
      const std::string& id = stores[i].spec.id;
      if (std::find(kept.begin(), kept.end(), id) == kept.end()) kept.push_back(id);
    }
    out.placed_now = true;
  }
  rec.stores = kept;
  for (const std::string& id : kept) out.stores.push_back(*Find(stores, id));
  return out;
}

std::vector<std::string> Controller::Tick() {
  std::vector<std::string> dead = membership_.Sweep();
  const int64_t now = options_.membership.clock->NowUnixMs();
  const int64_t idle_ms = absl::ToInt64Milliseconds(options_.placement_idle);
  absl::MutexLock lock(&mu_);
  for (auto it = placements_.begin(); it != placements_.end();) {
    if (now - it->second.last_used_ms > idle_ms) {
      it = placements_.erase(it);
    } else {
      ++it;
    }
  }
  return dead;
}

size_t Controller::Placements() const {
  absl::MutexLock lock(&mu_);
  return placements_.size();
}

size_t Controller::PlacementsOn(const std::string& node_id) const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [k, r] : placements_) {
    n += r.worker == node_id ? 1 : 0;
    n += std::count(r.stores.begin(), r.stores.end(), node_id);
  }
  return n;
}

}  // namespace kvtier::controller
