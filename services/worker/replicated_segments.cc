#include "services/worker/replicated_segments.h"

#include <algorithm>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/log.h"
#include "base/names.h"
#include "base/status_macros.h"

namespace kvtier {
namespace {

absl::Status Named(const absl::Status& s, const std::string& address) {
  return absl::Status(s.code(), absl::StrCat("store ", address, ": ", s.message()));
}

// A read tried on replica `i` of `n` gets an equal share of what is left of
// the call's budget, so one that stopped answering leaves time for the next.
CallOptions ShareOf(const CallOptions& call, size_t i, size_t n) {
  CallOptions c = call;
  if (call.has_deadline() && i + 1 < n) {
    const absl::Duration left = call.deadline - absl::Now();
    if (left > absl::ZeroDuration()) {
      c.deadline = absl::Now() + left / static_cast<int64_t>(n - i);
    }
  }
  return c;
}

// Reads go on to the next replica after these (DATA_LOSS: this replica's
// copy failed its checksum; another may hold it whole).
bool NextReplica(const absl::Status& s, const CallOptions& call) {
  const absl::StatusCode c = s.code();
  return c == absl::StatusCode::kUnavailable || c == absl::StatusCode::kNotFound ||
         c == absl::StatusCode::kDataLoss ||
         (c == absl::StatusCode::kDeadlineExceeded && absl::Now() < call.deadline);
}

// The controller is asked where a session's replicas are with a deadline of
// its own: the store call that failed may have spent the whole budget on a
// store that stopped answering.
constexpr absl::Duration kRerouteDeadline = absl::Seconds(2);

}  // namespace

ReplicatedSegments::ReplicatedSegments(std::unique_ptr<StoreSegments> primary,
                                       StoreClientOptions replica_options,
                                       std::unique_ptr<KnownNodes> known)
    : primary_(std::move(primary)),
      replica_options_(std::move(replica_options)),
      known_(std::move(known)) {}

absl::Status ReplicatedSegments::CheckReplicas(const std::vector<std::string>& addresses,
                                               const CallOptions& call) {
  if (addresses.size() > 3) {
    return absl::InvalidArgumentError("at most 3 store replicas per session");
  }
  std::set<std::string> seen;
  for (const std::string& a : addresses) {
    if (a.empty() || !seen.insert(a).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "store replica address '", a.substr(0, kMaxAddressLength), "' is empty or repeated"));
    }
  }
  return known_->Check(addresses, call);
}

absl::Status ReplicatedSegments::SetReplicas(const std::string& tenant, const std::string& session,
                                             const std::vector<std::string>& addresses,
                                             const CallOptions& call) {
  KVT_RETURN_IF_ERROR(CheckReplicas(addresses, call));
  absl::MutexLock lock(&mu_);
  for (const std::string& a : addresses) {
    if (pool_.count(a) != 0) continue;
    StoreClientOptions o = replica_options_;
    o.target = a;
    absl::StatusOr<std::unique_ptr<StoreClient>> c = StoreClient::Connect(o);
    if (!c.ok()) return c.status();
    pool_[a] = std::make_unique<StoreSegments>(std::move(*c));
  }
  if (addresses.empty()) {
    replicas_.erase({tenant, session});
    confirmed_.erase({tenant, session});
  } else {
    replicas_[{tenant, session}] = addresses;
    confirmed_[{tenant, session}] = epoch_ ? epoch_() : 0;
  }
  return absl::OkStatus();
}

void ReplicatedSegments::Forget(const std::string& tenant, const std::string& session) {
  absl::MutexLock lock(&mu_);
  replicas_.erase({tenant, session});
  confirmed_.erase({tenant, session});
}

void ReplicatedSegments::RefreshIfStale(const std::string& session, const CallOptions& call) {
  if (!rerouter_ || !epoch_) return;
  const uint64_t now = epoch_();
  {
    absl::MutexLock lock(&mu_);
    auto it = confirmed_.find({call.tenant, session});
    if (it == confirmed_.end() || it->second >= now) return;
  }
  CallOptions ask = call;
  ask.deadline = absl::Now() + kRerouteDeadline;
  absl::StatusOr<std::vector<std::string>> fresh = rerouter_(call.tenant, session, ask);
  if (!fresh.ok() || fresh->empty()) return;  // Keep the list; writes will tell.
  std::vector<std::string> was;
  {
    absl::MutexLock lock(&mu_);
    auto it = replicas_.find({call.tenant, session});
    if (it == replicas_.end()) return;
    was = it->second;
  }
  if (was == *fresh) {
    absl::MutexLock lock(&mu_);
    confirmed_[{call.tenant, session}] = now;
    return;
  }
  if (SetReplicas(call.tenant, session, *fresh, ask).ok()) {
    reroutes_.fetch_add(1);
    LogWarn("store replicas changed by the controller", {{"session", session},
                                                         {"was", absl::StrJoin(was, ",")},
                                                         {"now", absl::StrJoin(*fresh, ",")}});
  }
}

std::vector<std::string> ReplicatedSegments::Replicas(const std::string& tenant,
                                                      const std::string& session) {
  absl::MutexLock lock(&mu_);
  auto it = replicas_.find({tenant, session});
  return it == replicas_.end() ? std::vector<std::string>() : it->second;
}

std::vector<v1::HeldSession> ReplicatedSegments::Held() {
  absl::MutexLock lock(&mu_);
  std::vector<v1::HeldSession> out;
  out.reserve(replicas_.size());
  for (const auto& [key, addresses] : replicas_) {
    v1::HeldSession& h = out.emplace_back();
    h.set_tenant(key.first);
    h.set_session_id(key.second);
    for (const std::string& a : addresses) h.add_store_addresses(a);
  }
  return out;
}

std::vector<std::pair<std::string, StoreSegments*>> ReplicatedSegments::For(
    const CallOptions& call, const std::string& session) {
  absl::MutexLock lock(&mu_);
  auto it = replicas_.find({call.tenant, session});
  if (it == replicas_.end()) return {{"--store", primary_.get()}};
  std::vector<std::pair<std::string, StoreSegments*>> out;
  for (const std::string& a : it->second) out.emplace_back(a, pool_.at(a).get());
  return out;
}

absl::Status ReplicatedSegments::Put(const std::string& session, const Segment& s,
                                     uint32_t layer_begin, uint32_t layer_end,
                                     std::string_view payload, const CallOptions& call) {
  return PutMany(session, {{s, layer_begin, layer_end, payload}}, call).front();
}

std::vector<absl::Status> ReplicatedSegments::PutMany(const std::string& session,
                                                      const std::vector<SegmentWrite>& writes,
                                                      const CallOptions& call) {
  const bool round_start = !writes.empty() && writes.front().s.segment == 0;
  if (round_start) RefreshIfStale(session, call);
  // Every replica at once: the segments are stored when all hold them. The
  // first replica (in the session's order) that fails names the failure.
  std::set<std::string> done;
  std::vector<StoreSegments*> stored;  // The replicas in `done`.
  for (int attempt = 0;; ++attempt) {
    std::vector<std::pair<std::string, StoreSegments*>> targets;
    for (auto& t : For(call, session)) {
      if (done.count(t.first) == 0) targets.push_back(std::move(t));
    }
    std::vector<std::vector<absl::Status>> results(targets.size());
    {
      std::vector<std::thread> others;
      for (size_t i = 1; i < targets.size(); ++i) {
        others.emplace_back(
            [&, i] { results[i] = targets[i].second->PutMany(session, writes, call); });
      }
      if (!targets.empty()) results[0] = targets[0].second->PutMany(session, writes, call);
      for (std::thread& t : others) t.join();
    }
    std::vector<absl::Status> failed;
    std::string failed_at;
    for (size_t i = 0; i < targets.size(); ++i) {
      const std::vector<absl::Status>& st = results[i];
      if (std::all_of(st.begin(), st.end(), [](const absl::Status& x) { return x.ok(); })) {
        done.insert(targets[i].first);
        stored.push_back(targets[i].second);
      } else if (failed.empty()) {
        failed = st;
        failed_at = targets[i].first;
      }
    }
    if (failed.empty()) return std::vector<absl::Status>(writes.size());
    // Only when a round's first segment failed, so that no replica ends up
    // with half a round; only once per call.
    const absl::StatusCode first = failed.front().code();
    const bool unreachable =
        first == absl::StatusCode::kUnavailable || first == absl::StatusCode::kDeadlineExceeded;
    bool has_replicas = false;
    {
      absl::MutexLock lock(&mu_);
      has_replicas = replicas_.count({call.tenant, session}) != 0;
    }
    auto named = [&] {
      for (absl::Status& st : failed) {
        if (!st.ok()) st = Named(st, failed_at);
      }
      // A round is stored on every replica or on none: take it back from
      // the replicas that took it (best effort; a retry replaces it anyway).
      if (round_start) {
        std::set<uint32_t> rounds;
        for (const SegmentWrite& w : writes) rounds.insert(w.s.round);
        for (StoreSegments* store : stored) {
          for (uint32_t r : rounds) {
            if (absl::Status d = store->DropRound(session, r, call); !d.ok()) {
              LogWarn("round not taken back from a replica",
                      {{"session", session}, {"round", r}, {"error", d.ToString()}});
            }
          }
        }
      }
      return failed;
    };
    if (attempt > 0 || !rerouter_ || !unreachable || !round_start || !has_replicas) {
      return named();
    }
    CallOptions ask = call;
    ask.deadline = absl::Now() + kRerouteDeadline;
    absl::StatusOr<std::vector<std::string>> now = rerouter_(call.tenant, session, ask);
    if (!now.ok() || now->empty() || std::find(now->begin(), now->end(), failed_at) != now->end()) {
      return named();
    }
    if (absl::Status set = SetReplicas(call.tenant, session, *now, ask); !set.ok()) {
      return named();
    }
    reroutes_.fetch_add(1);
    LogWarn("store replica replaced",
            {{"session", session}, {"dead", failed_at}, {"replicas", absl::StrJoin(*now, ",")}});
  }
}

absl::StatusOr<std::vector<std::string>> ReplicatedSegments::Get(
    const std::string& session, const std::vector<Segment>& segments, const CallOptions& call) {
  const auto stores = For(call, session);
  absl::Status last;
  for (size_t i = 0; i < stores.size(); ++i) {
    absl::StatusOr<std::vector<std::string>> got =
        stores[i].second->Get(session, segments, ShareOf(call, i, stores.size()));
    if (got.ok()) {
      if (i > 0) {
        read_fallbacks_.fetch_add(1);
        LogWarn("recall served by a later replica",
                {{"session", session}, {"store", stores[i].first}, {"skipped", i}});
      }
      return got;
    }
    last = Named(got.status(), stores[i].first);
    if (!NextReplica(got.status(), call)) break;
  }
  return last;
}

absl::StatusOr<std::vector<worker::SegmentStore::StoredRound>> ReplicatedSegments::List(
    const std::string& session, const CallOptions& call) {
  absl::Status last;
  const auto stores = For(call, session);
  for (size_t i = 0; i < stores.size(); ++i) {
    absl::StatusOr<std::vector<StoredRound>> got =
        stores[i].second->List(session, ShareOf(call, i, stores.size()));
    if (got.ok()) return got;
    last = Named(got.status(), stores[i].first);
    if (!NextReplica(got.status(), call)) break;
  }
  return last;
}

absl::Status ReplicatedSegments::Delete(const std::string& session, const CallOptions& call) {
  absl::Status first;
  for (const auto& [address, store] : For(call, session)) {
    absl::Status st = store->Delete(session, call);
    if (!st.ok() && first.ok()) first = Named(st, address);
  }
  return first;
}

absl::Status ReplicatedSegments::DropRound(const std::string& session, uint32_t round,
                                           const CallOptions& call) {
  absl::Status first;
  for (const auto& [address, store] : For(call, session)) {
    absl::Status st = store->DropRound(session, round, call);
    if (!st.ok() && first.ok()) first = Named(st, address);
  }
  return first;
}

absl::Status ReplicatedSegments::DropSegments(const std::string& session,
                                              const std::vector<Segment>& segments,
                                              const CallOptions& call) {
  absl::Status first;
  for (const auto& [address, store] : For(call, session)) {
    absl::Status st = store->DropSegments(session, segments, call);
    if (!st.ok() && first.ok()) first = Named(st, address);
  }
  return first;
}

absl::Status ReplicatedSegments::RecordRecalls(const std::string& session,
                                               const std::vector<uint32_t>& rounds,
                                               const CallOptions& call) {
  absl::Status first;
  for (const auto& [address, store] : For(call, session)) {
    absl::Status st = store->RecordRecalls(session, rounds, call);
    if (!st.ok() && first.ok()) first = Named(st, address);
  }
  return first;
}

}  // namespace kvtier
