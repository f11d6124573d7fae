// Store: removing segments, rounds and sessions (drops, expiry, disk
// pressure), pinning, and applying removals to RocksDB and the payload files.
#include <iterator>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "cachestore/keys.h"
#include "cachestore/names.h"
#include "cachestore/payload_files.h"
#include "cachestore/store.h"
#include "cachestore/store_internal.h"
#include "kvtier/internal/records.pb.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "rocksdb/write_batch.h"

namespace kvtier::cachestore {

using detail::FromRocks;
using detail::NoSession;

// ---- Removal ----

Store::SegmentIt Store::RemoveSegmentLocked(RoundEntry& r, SegmentIt it, Removal::Round* removed,
                                            uint64_t* freed) {
  SegmentEntry& e = it->second;
  if (e.info.state == SegmentState::kWriting) {
    e.cancelled = true;  // CommitWrite removes it and its bytes.
    return std::next(it);
  }
  if (e.info.state == SegmentState::kSealed) {
    ram_bytes_ -= e.info.payload_bytes;
    --ram_segments_;
  }
  disk_bytes_ -= e.info.payload_bytes;
  --disk_segments_;
  *freed += e.info.payload_bytes;
  removed->segments.push_back({it->first, e.file_id});
  return r.segments.erase(it);
}

uint64_t Store::RemoveRoundLocked(SessionEntry& s, uint32_t round, Removal* removal) {
  auto ri = s.rounds.find(round);
  if (ri == s.rounds.end()) return 0;
  RoundEntry& r = ri->second;
  UnindexRoundLocked(s, r);
  uint64_t freed = 0;
  Removal::Round removed{round, {}, /*round_keys=*/true};
  for (auto it = r.segments.begin(); it != r.segments.end();) {
    it = RemoveSegmentLocked(r, it, &removed, &freed);
  }
  removal->rounds.push_back(std::move(removed));
  if (r.segments.empty()) {
    s.rounds.erase(ri);
  } else {
    IndexRoundLocked(s, r);  // Only uploads left: in no order.
  }
  quotas_->Release(s.tenant, freed);
  ++counters_.drops;
  return freed;
}

absl::Status Store::MakeDiskRoomLocked(uint64_t bytes, const std::string& skip_session_key,
                                       std::vector<Removal>* removals) {
  if (drop_order_.bytes() < bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("disk budget of ", options_.disk_budget_bytes,
                                                     " bytes is full and dropping every "
                                                     "unpinned round would not free ",
                                                     bytes, " bytes"));
  }
  std::vector<std::pair<SessionEntry*, uint32_t>> chosen;
  uint64_t freed = 0;
  drop_order_.Walk([&](RoundEntry* r) {
    if (freed >= bytes) return false;
    chosen.push_back({r->session, r->number});
    freed += r->drop_bytes;
    return true;
  });
  std::map<SessionEntry*, Removal> by_session;
  for (auto [s, round] : chosen) {
    Removal& rm = by_session[s];
    rm.session_key = SessionKey(s->tenant, s->session);
    rm.tenant = s->tenant;
    RemoveRoundLocked(*s, round, &rm);
    ++counters_.pressure_drops;
  }
  for (auto& [s, rm] : by_session) {
    LogInfo("dropped rounds under disk pressure",
            {{"tenant", rm.tenant}, {"rounds", rm.rounds.size()}});
    removals->push_back(std::move(rm));
  }
  return absl::OkStatus();
}

absl::Status Store::ApplyRemovals(const std::vector<Removal>& removals) {
  if (removals.empty()) return absl::OkStatus();
  rocksdb::WriteBatch batch;
  std::vector<std::string> recalls;  // The removed rounds' counter records.
  for (const Removal& rm : removals) {
    for (const Removal::Round& r : rm.rounds) {
      for (const Removal::Segment& seg : r.segments) {
        if (seg.file_id == 0) {
          batch.Delete(SegmentDbKey(KeyKind::kPayload, rm.session_key, r.round, seg.segment));
        }
        batch.Delete(SegmentDbKey(KeyKind::kSegment, rm.session_key, r.round, seg.segment));
      }
      if (r.round_keys) {
        batch.Delete(RoundDbKey(KeyKind::kRound, rm.session_key, r.round));
        recalls.push_back(RoundDbKey(KeyKind::kRecall, rm.session_key, r.round));
        batch.Delete(recalls.back());
      }
    }
    if (rm.whole_session) batch.Delete(SessionDbKey(rm.session_key));
  }
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync_writes;
  {
    // A queued counter of a removed round would write its record again after
    // this delete: it is dropped from the queue, and no flush that took it
    // earlier is still writing (flush_mu_).
    absl::MutexLock flush(&flush_mu_);
    {
      absl::MutexLock lock(&counters_mu_);
      for (const std::string& k : recalls) pending_recalls_.erase(k);
    }
    KVT_RETURN_IF_ERROR(FromRocks(db_->Write(wo, &batch), "delete"));
  }
  // Files go only after their records (durably so with sync_writes; else a
  // file is reused only after a WAL sync): a crash in between leaves orphans,
  // which recovery reuses or deletes.
  absl::Status first_error;
  for (const Removal& rm : removals) {
    for (const Removal::Round& r : rm.rounds) {
      for (const Removal::Segment& seg : r.segments) {
        if (seg.file_id == 0) continue;
        absl::Status s = files_->Release(seg.file_id, options_.sync_writes);
        if (!s.ok() && first_error.ok()) first_error = s;
      }
    }
  }
  return first_error;
}

absl::StatusOr<Store::DropResult> Store::DropRounds(const std::string& tenant,
                                                    const std::string& session,
                                                    const std::vector<uint32_t>& rounds) {
  absl::MutexLock order(&removal_mu_);
  KVT_RETURN_IF_ERROR(ValidateName("session_id", session));
  for (uint32_t r : rounds) {
    if (r > kMaxRound) {
      return absl::InvalidArgumentError(absl::StrCat("round ", r, " is outside [0, 2^31)"));
    }
  }
  DropResult result;
  Removal rm;
  {
    absl::MutexLock lock(&mu_);
    rm.session_key = SessionKey(tenant, session);
    rm.tenant = tenant;
    SessionEntry* s = FindSessionLocked(rm.session_key);
    if (s == nullptr) return NoSession(session);
    for (uint32_t round : rounds) {
      if (s->rounds.count(round) == 0) {
        result.not_found.push_back(round);
        continue;
      }
      result.freed_bytes += RemoveRoundLocked(*s, round, &rm);
      result.dropped.push_back(round);
    }
  }
  KVT_RETURN_IF_ERROR(ApplyRemovals({rm}));
  return result;
}

absl::StatusOr<Store::SegmentDropResult> Store::DropSegments(
    const std::string& tenant, const std::string& session, const std::vector<SegmentId>& segments) {
  absl::MutexLock order(&removal_mu_);
  KVT_RETURN_IF_ERROR(ValidateName("session_id", session));
  for (const SegmentId& id : segments) {
    if (id.round > kMaxRound) {
      return absl::InvalidArgumentError(absl::StrCat("round ", id.round, " is outside [0, 2^31)"));
    }
    if (id.segment >= kMaxSegmentsPerRound) {
      return absl::InvalidArgumentError(
          absl::StrCat("segment ", id.segment, " is outside [0, ", kMaxSegmentsPerRound, ")"));
    }
  }
  SegmentDropResult result;
  Removal rm;
  {
    absl::MutexLock lock(&mu_);
    rm.session_key = SessionKey(tenant, session);
    rm.tenant = tenant;
    SessionEntry* s = FindSessionLocked(rm.session_key);
    if (s == nullptr) return NoSession(session);
    for (const SegmentId& id : segments) {
      auto ri = s->rounds.find(id.round);
      if (ri == s->rounds.end() || ri->second.segments.count(id.segment) == 0) {
        result.not_found.push_back(id);
        continue;
      }
      RoundEntry& r = ri->second;
      result.dropped.push_back(id);
      UnindexRoundLocked(*s, r);
      Removal::Round removed{id.round, {}, /*round_keys=*/false};
      uint64_t freed = 0;
      RemoveSegmentLocked(r, r.segments.find(id.segment), &removed, &freed);
      if (!removed.segments.empty()) ++counters_.segment_drops;
      result.freed_bytes += freed;
      quotas_->Release(s->tenant, freed);
      if (r.segments.empty()) {
        removed.round_keys = true;
        s->rounds.erase(ri);
        ++counters_.drops;
      } else {
        IndexRoundLocked(*s, r);
      }
      rm.rounds.push_back(std::move(removed));
    }
  }
  KVT_RETURN_IF_ERROR(ApplyRemovals({rm}));
  return result;
}

absl::StatusOr<Store::ColdDropResult> Store::DropColdRounds(int64_t min_idle_ms) {
  absl::MutexLock order(&removal_mu_);
  ColdDropResult result;
  std::vector<Removal> removals;
  {
    absl::MutexLock lock(&mu_);
    const int64_t now = options_.clock->NowUnixMs();
    // Least recently used first: only sessions idle long enough are visited.
    for (const auto& [last_access, sp] : by_idle_) {
      if (now - last_access < min_idle_ms) break;
      SessionEntry& s = *sp;
      if (s.pinned || s.rounds.size() < 2) continue;
      const uint32_t newest = s.rounds.rbegin()->first;
      std::vector<uint32_t> cold;
      for (const auto& [rn, r] : s.rounds) {
        if (rn == newest || r.recall_count != 0) continue;
        if (r.writing == 0) cold.push_back(rn);
      }
      if (cold.empty()) continue;
      Removal rm;
      rm.session_key = SessionKey(s.tenant, s.session);
      rm.tenant = s.tenant;
      for (uint32_t rn : cold) {
        result.freed_bytes += RemoveRoundLocked(s, rn, &rm);
        ++counters_.cold_drops;
      }
      result.rounds += static_cast<uint32_t>(cold.size());
      ++result.sessions;
      removals.push_back(std::move(rm));
    }
  }
  KVT_RETURN_IF_ERROR(ApplyRemovals(removals));
  if (result.rounds > 0) {
    LogInfo("dropped never-recalled rounds of cold sessions under memory pressure",
            {{"sessions", result.sessions},
             {"rounds", result.rounds},
             {"freed_bytes", result.freed_bytes}});
  }
  return result;
}

std::pair<uint64_t, std::vector<uint32_t>> Store::RemoveSessionLocked(const std::string& key,
                                                                      Removal* rm) {
  SessionEntry& s = sessions_.at(key);
  rm->session_key = key;
  rm->tenant = s.tenant;
  rm->whole_session = true;
  std::vector<uint32_t> all;
  for (auto& [rn, r] : s.rounds) all.push_back(rn);
  uint64_t freed = 0;
  for (uint32_t round : all) freed += RemoveRoundLocked(s, round, rm);
  if (s.rounds.empty()) {
    EraseSessionLocked(key);
  } else {
    // Uploads still running keep the entry until they abort.
    for (auto& [rn, r] : s.rounds) UnindexRoundLocked(s, r);
    UnindexSessionTimesLocked(s);
    s.pinned = false;
    s.persisted = false;
    IndexSessionTimesLocked(s);
    for (auto& [rn, r] : s.rounds) IndexRoundLocked(s, r);
  }
  return {freed, std::move(all)};
}

absl::StatusOr<Store::DropResult> Store::DeleteSession(const std::string& tenant,
                                                       const std::string& session) {
  absl::MutexLock order(&removal_mu_);
  KVT_RETURN_IF_ERROR(ValidateName("session_id", session));
  DropResult result;
  Removal rm;
  {
    absl::MutexLock lock(&mu_);
    const std::string key = SessionKey(tenant, session);
    if (FindSessionLocked(key) == nullptr) return NoSession(session);
    std::tie(result.freed_bytes, result.dropped) = RemoveSessionLocked(key, &rm);
  }
  KVT_RETURN_IF_ERROR(ApplyRemovals({rm}));
  return result;
}

absl::Status Store::WriteSessionRecord(const std::string& session_key, bool pinned, uint32_t ttl) {
  internal::SessionRecord sr;
  sr.set_pinned(pinned);
  sr.set_ttl_seconds(ttl);
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync_writes;
  return FromRocks(db_->Put(wo, SessionDbKey(session_key), sr.SerializeAsString()),
                   "session record write");
}

absl::Status Store::PinSession(const std::string& tenant, const std::string& session, bool pinned) {
  absl::MutexLock order(&removal_mu_);
  KVT_RETURN_IF_ERROR(ValidateName("tenant", tenant));
  KVT_RETURN_IF_ERROR(ValidateName("session_id", session));
  const std::string key = SessionKey(tenant, session);
  uint32_t ttl;
  {
    absl::MutexLock lock(&mu_);
    SessionEntry* found = FindSessionLocked(key);
    if (found == nullptr) return NoSession(session);
    SessionEntry& s = *found;
    // Pinning moves the session's segments to the other spill order, its
    // rounds out of (or into) the drop order, and it out of expiry.
    for (auto& [rn, r] : s.rounds) UnindexRoundLocked(s, r);
    UnindexSessionTimesLocked(s);
    s.pinned = pinned;
    s.persisted = true;
    s.last_access_ms = options_.clock->NowUnixMs();
    IndexSessionTimesLocked(s);
    for (auto& [rn, r] : s.rounds) IndexRoundLocked(s, r);
    ttl = s.ttl_seconds;
  }
  return WriteSessionRecord(key, pinned, ttl);
}

absl::StatusOr<int> Store::ExpireSessions() {
  absl::MutexLock order(&removal_mu_);
  std::vector<Removal> removals;
  {
    absl::MutexLock lock(&mu_);
    const int64_t now = options_.clock->NowUnixMs();
    std::vector<std::string> expired;
    // Unpinned sessions with a TTL, earliest deadline first.
    for (const auto& [deadline, s] : by_deadline_) {
      if (now <= deadline) break;
      LogInfo("session expired", {{"tenant", s->tenant}, {"session", s->session}});
      expired.push_back(SessionKey(s->tenant, s->session));
    }
    for (const std::string& key : expired) {
      removals.emplace_back();
      RemoveSessionLocked(key, &removals.back());
      ++counters_.expired_sessions;
    }
  }
  KVT_RETURN_IF_ERROR(ApplyRemovals(removals));
  return static_cast<int>(removals.size());
}

}  // namespace kvtier::cachestore
