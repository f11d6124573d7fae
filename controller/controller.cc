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
    : options_(options),
      membership_(options.membership),
      start_ms_(options.membership.clock->NowUnixMs()) {}

void Controller::Adopt(const std::string& worker_id, const std::string& tenant,
                       const std::string& session, std::vector<std::string> store_addresses) {
  if (!ValidateName("tenant", tenant).ok() || !ValidateName("session_id", session).ok()) return;
  absl::MutexLock lock(&mu_);
  auto [it, added] = placements_.try_emplace({tenant, session});
  if (!added) return;  // The controller's own record is the newer.
  it->second.worker = worker_id;
  it->second.store_addresses = std::move(store_addresses);
  it->second.last_used_ms = options_.membership.clock->NowUnixMs();
}

absl::Status Controller::ResolveReportedLocked(Recorded& rec, const std::vector<NodeInfo>& stores) {
  if (rec.store_addresses.empty()) return absl::OkStatus();
  std::vector<std::string> ids;
  for (const std::string& a : rec.store_addresses) {
    const auto it = std::find_if(stores.begin(), stores.end(),
                                 [&](const NodeInfo& n) { return n.spec.address == a; });
    if (it != stores.end()) {
      ids.push_back(it->spec.id);
    } else if (options_.membership.clock->NowUnixMs() - start_ms_ <
               absl::ToInt64Milliseconds(membership_.lease())) {
      return absl::UnavailableError(
          absl::StrCat("the controller restarted moments ago and store ", a,
                       " of this session has not registered again yet; retry"));
    }
  }
  // Unmatched ones after a lease: dead stores, replaced (and repaired from
  // the matched ones) next.
  rec.stores = std::move(ids);
  rec.store_addresses.clear();
  return absl::OkStatus();
}

std::vector<size_t> Controller::RankFor(const Key& key, const std::vector<NodeInfo>& nodes) const {
  // The rendezvous key: tenant and session with a separator neither holds.
  const std::string k = absl::StrCat(key.first, "/", key.second);
  std::vector<Candidate> c;
  c.reserve(nodes.size());
  for (const NodeInfo& n : nodes) c.push_back({n.spec.id, membership_.Weight(n)});
  return Rank(k, c);
}

bool Controller::FillStoresLocked(const Key& key, Recorded& rec,
                                  const std::vector<NodeInfo>& stores) {
  const size_t replicas = static_cast<size_t>(std::clamp(options_.replicas, 1, 3));
  std::vector<std::string> kept;
  for (const std::string& id : rec.stores) {
    if (Find(stores, id) != nullptr) kept.push_back(id);
  }
  const size_t survivors = kept.size();
  if (kept.size() < replicas && kept.size() < stores.size()) {
    for (size_t i : RankFor(key, stores)) {
      if (kept.size() == replicas) break;
      const std::string& id = stores[i].spec.id;
      if (std::find(kept.begin(), kept.end(), id) == kept.end()) kept.push_back(id);
    }
  }
  const bool changed = kept != rec.stores;
  // A session that had stores and keeps a survivor: the added ones need
  // its rounds. (A new session, or one that lost every replica, has nothing
  // to copy from.)
  if (!rec.stores.empty() && survivors > 0) {
    for (size_t i = survivors; i < kept.size(); ++i) {
      RepairTask t;
      t.tenant = key.first;
      t.session = key.second;
      for (size_t j = 0; j < survivors; ++j) t.sources.push_back(*Find(stores, kept[j]));
      t.target = *Find(stores, kept[i]);
      repairs_.push_back(std::move(t));
    }
  }
  rec.stores = std::move(kept);
  return changed;
}

std::vector<NodeInfo> Controller::NodesOf(const std::string& tenant,
                                          const std::string& session) const {
  std::vector<std::string> ids;
  {
    absl::MutexLock lock(&mu_);
    auto it = placements_.find(Key{tenant, session});
    if (it == placements_.end()) return {};
    ids.push_back(it->second.worker);
    ids.insert(ids.end(), it->second.stores.begin(), it->second.stores.end());
  }
  std::vector<NodeInfo> out;
  for (const std::string& id : ids) {
    std::optional<NodeInfo> n = membership_.Get(id);
    if (n.has_value() && n->live) out.push_back(*std::move(n));
  }
  return out;
}

absl::StatusOr<Placement> Controller::Route(const std::string& tenant, const std::string& session,
                                            uint64_t need_bytes, const std::string& avoid_worker) {
  KVT_RETURN_IF_ERROR(ValidateName("tenant", tenant));
  KVT_RETURN_IF_ERROR(ValidateName("session_id", session));
  if (share_ == nullptr) return RouteLocal(tenant, session, need_bytes, avoid_worker, {}, nullptr);
  // Shared: decide on the shared entry, and write the decision when it
  // changed it; a replica that wrote first wins and we decide again on its.
  for (int attempt = 0; attempt < 5; ++attempt) {
    KVT_ASSIGN_OR_RETURN(std::optional<PlacementShare::Entry> shared,
                         share_->Load(tenant, session));
    PlacementShare::Entry decided;
    KVT_ASSIGN_OR_RETURN(Placement p,
                         RouteLocal(tenant, session, need_bytes, avoid_worker, shared, &decided));
    if (shared.has_value() && shared->worker == decided.worker &&
        shared->stores == decided.stores) {
      return p;
    }
    KVT_ASSIGN_OR_RETURN(bool saved, share_->Save(tenant, session, decided,
                                                  shared.has_value() ? shared->version : 0));
    if (saved) return p;
  }
  return absl::AbortedError(
      absl::StrCat("placement of ", session, " kept changing under other controller replicas"));
}

absl::StatusOr<int> Controller::ReplaceDeadStores() {
  if (share_ == nullptr) return 0;
  const std::vector<NodeInfo> stores = membership_.Live(NodeKind::kStore);
  if (stores.empty()) return 0;
  KVT_ASSIGN_OR_RETURN(auto all, share_->LoadAll());
  int changed = 0;
  for (auto& [key, entry] : all) {
    const bool lost_one = std::any_of(entry.stores.begin(), entry.stores.end(),
                                      [&](const auto& id) { return Find(stores, id) == nullptr; });
    const size_t want = static_cast<size_t>(std::clamp(options_.replicas, 1, 3));
    if (!lost_one && entry.stores.size() >= std::min(want, stores.size())) continue;
    PlacementShare::Entry next;
    {
      absl::MutexLock lock(&mu_);
      Recorded& rec = placements_[key];
      rec.worker = entry.worker;
      rec.stores = entry.stores;
      rec.store_addresses.clear();
      rec.last_used_ms = options_.membership.clock->NowUnixMs();
      FillStoresLocked(key, rec, stores);
      next.worker = rec.worker;
      next.stores = rec.stores;
    }
    KVT_ASSIGN_OR_RETURN(bool saved, share_->Save(key.first, key.second, next, entry.version));
    if (saved) ++changed;  // Else another replica moved it; the next sweep looks again.
  }
  return changed;
}

absl::StatusOr<Placement> Controller::RouteLocal(const std::string& tenant,
                                                 const std::string& session, uint64_t need_bytes,
                                                 const std::string& avoid_worker,
                                                 const std::optional<PlacementShare::Entry>& shared,
                                                 PlacementShare::Entry* decided) {
  std::vector<NodeInfo> workers = membership_.Live(NodeKind::kWorker);
  const std::vector<NodeInfo> stores = membership_.Live(NodeKind::kStore);
  if (!avoid_worker.empty()) {
    workers.erase(std::remove_if(workers.begin(), workers.end(),
                                 [&](const NodeInfo& n) { return n.spec.id == avoid_worker; }),
                  workers.end());
  }
  // Decode-role workers take no placements; they take the decode steps.
  std::vector<NodeInfo> decoders;
  for (auto it = workers.begin(); it != workers.end();) {
    if (it->spec.role == WorkerRole::kDecode) {
      decoders.push_back(*it);
      it = workers.erase(it);
    } else {
      ++it;
    }
  }
  if (workers.empty()) {
    return absl::UnavailableError(absl::StrCat(
        "no live worker that prefills", avoid_worker.empty() ? "" : " other than ", avoid_worker,
        decoders.empty() ? "" : absl::StrCat(" (", decoders.size(), " decode-only workers live)")));
  }
  if (stores.empty()) return absl::UnavailableError("no live store");
  const Key key{tenant, session};

  Placement out;
  out.epoch = membership_.epoch();
  absl::MutexLock lock(&mu_);
  Recorded& rec = placements_[key];
  rec.last_used_ms = options_.membership.clock->NowUnixMs();
  if (decided != nullptr) {
    // The shared entry is the truth; this replica's record only caches it.
    rec.worker = shared.has_value() ? shared->worker : "";
    rec.stores = shared.has_value() ? shared->stores : std::vector<std::string>();
    rec.store_addresses.clear();
  }

  // The worker: the recorded one while it lives (and the caller reaches it).
  const NodeInfo* w = rec.worker.empty() ? nullptr : Find(workers, rec.worker);
  if (w == nullptr) {
    for (size_t i : RankFor(key, workers)) {
      const NodeInfo& n = workers[i];
      const uint64_t cap = n.spec.capacity_bytes;
      if (cap == 0 || need_bytes == 0 || n.used_bytes + need_bytes <= cap) {
        w = &n;
        break;
      }
    }
    if (w == nullptr) {
      if (rec.stores.empty()) placements_.erase(key);
      return absl::ResourceExhaustedError(absl::StrCat("no live worker has room for ", need_bytes,
                                                       " more working-set bytes (", workers.size(),
                                                       " live)"));
    }
    rec.worker = w->spec.id;
    out.placed_now = true;
  }
  out.worker = *w;
  if (!decoders.empty()) out.decode_worker = decoders[RankFor(key, decoders)[0]];

  // The stores: recorded replicas that live keep their place; the others are
  // replaced in the session's rendezvous order.
  KVT_RETURN_IF_ERROR(ResolveReportedLocked(rec, stores));
  if (FillStoresLocked(key, rec, stores)) out.placed_now = true;
  for (const std::string& id : rec.stores) out.stores.push_back(*Find(stores, id));
  if (decided != nullptr) {
    decided->worker = rec.worker;
    decided->stores = rec.stores;
  }
  return out;
}

std::vector<std::string> Controller::Tick() {
  std::vector<std::string> dead = membership_.Sweep();
  const int64_t now = options_.membership.clock->NowUnixMs();
  const int64_t idle_ms = absl::ToInt64Milliseconds(options_.placement_idle);
  const std::vector<NodeInfo> stores = membership_.Live(NodeKind::kStore);
  absl::MutexLock lock(&mu_);
  for (auto it = placements_.begin(); it != placements_.end();) {
    if (now - it->second.last_used_ms > idle_ms) {
      it = placements_.erase(it);
      continue;
    }
    // Replace dead replicas now, not at the session's next Route, so that
    // repair starts as soon as the store is declared dead.
    Recorded& rec = it->second;
    const bool lost_one = std::any_of(rec.stores.begin(), rec.stores.end(), [&](const auto& id) {
      return std::find(dead.begin(), dead.end(), id) != dead.end();
    });
    // (Shared placements are replaced by the leader's ReplaceDeadStores.)
    if (lost_one && !stores.empty() && share_ == nullptr) FillStoresLocked(it->first, rec, stores);
    ++it;
  }
  return dead;
}

std::optional<RepairTask> Controller::NextRepair() {
  absl::MutexLock lock(&mu_);
  while (!repairs_.empty()) {
    RepairTask t = std::move(repairs_.front());
    repairs_.pop_front();
    // Skip a task whose target is no longer one of the session's replicas
    // (it died too, or the placement was forgotten): its replacement has a
    // task of its own.
    auto it = placements_.find({t.tenant, t.session});
    if (it == placements_.end()) continue;
    const auto& ids = it->second.stores;
    if (std::find(ids.begin(), ids.end(), t.target.spec.id) == ids.end()) continue;
    ++repairs_running_;
    return t;
  }
  return std::nullopt;
}

void Controller::RepairFinished(RepairTask task, bool ok, int max_attempts) {
  absl::MutexLock lock(&mu_);
  if (repairs_running_ > 0) --repairs_running_;
  if (ok || ++task.attempt >= max_attempts) return;
  repairs_.push_back(std::move(task));
}

size_t Controller::RepairsPending() const {
  absl::MutexLock lock(&mu_);
  return repairs_.size() + repairs_running_;
}

size_t Controller::UnderReplicated() const {
  absl::MutexLock lock(&mu_);
  const size_t replicas = static_cast<size_t>(std::clamp(options_.replicas, 1, 3));
  size_t n = 0;
  for (const auto& [k, r] : placements_) n += r.stores.size() < replicas ? 1 : 0;
  return n;
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
