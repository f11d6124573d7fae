// Store: reads (PrepareRead, ReadSegment, promotion), the recall counters
// and their writer thread, listings.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "cachestore/keys.h"
#include "cachestore/names.h"
#include "cachestore/payload_files.h"
#include "cachestore/store.h"
#include "cachestore/store_internal.h"
#include "kernels/crc32c.h"
#include "kvtier/internal/records.pb.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "rocksdb/write_batch.h"

namespace kvtier::cachestore {

using detail::FromRocks;
using detail::NoSession;

// ---- Reads ----

absl::StatusOr<std::vector<SegmentInfo>> Store::PrepareRead(const std::string& tenant,
                                                            const std::string& session,
                                                            const std::vector<SegmentId>& ids,
                                                            uint64_t max_bytes, bool count_recalls,
                                                            std::vector<bool>* missing) {
  KVT_RETURN_IF_ERROR(ValidateName("session_id", session));
  const std::string key = SessionKey(tenant, session);
  std::vector<SegmentInfo> out;
  RecallWrites counters;
  {
    absl::MutexLock lock(&mu_);
    SessionEntry* s = FindSessionLocked(key);
    if (s == nullptr) return NoSession(session);
    uint64_t total = 0;
    std::vector<bool> gone(ids.size(), false);
    std::vector<SegmentId> present;
    present.reserve(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      const SegmentId& id = ids[i];
      auto r = s->rounds.find(id.round);
      const SegmentEntry* e = nullptr;
      if (r != s->rounds.end()) {
        auto it = r->second.segments.find(id.segment);
        if (it != r->second.segments.end() && it->second.info.state != SegmentState::kWriting) {
          e = &it->second;
        }
      }
      if (e == nullptr) {
        if (missing != nullptr) {
          gone[i] = true;
          continue;
        }
        return absl::NotFoundError(absl::StrCat("session '", session, "' has no round ", id.round,
                                                " segment ", id.segment));
      }
      total += e->info.payload_bytes;
      present.push_back(id);
    }
    if (total > max_bytes) {
      return absl::OutOfRangeError(absl::StrCat("the segments asked for hold ", total,
                                                " bytes; one read may take at most ", max_bytes,
                                                " (split the call)"));
    }
    const int64_t now = options_.clock->NowUnixMs();
    TouchSessionLocked(*s, now);
    std::vector<uint32_t> bumped;
    // Counting moves the rounds' sealed segments in the spill order (access
    // and recall count: re-keyed in place, from the keys noted here) and the
    // rounds in the drop order (taken out here, put back below).
    std::vector<RoundEntry*> rekeyed;
    struct Moved {
      SegmentEntry* e;
      const RoundEntry* r;
      SpillKey from;
    };
    std::vector<Moved> moved;
    if (count_recalls) {
      for (const SegmentId& id : present) {
        RoundEntry* r = &s->rounds[id.round];
        if (std::find(rekeyed.begin(), rekeyed.end(), r) != rekeyed.end()) continue;
        rekeyed.push_back(r);
        if (r->in_drop_order) drop_order_.Erase(r, r->recall_count, r->insert_seq, r->drop_bytes);
        for (auto& [sn, e] : r->segments) {
          if (e.info.state == SegmentState::kSealed) moved.push_back({&e, r, SpillKeyOf(e, *r)});
        }
      }
    }
    for (const SegmentId& id : present) {
      RoundEntry& r = s->rounds[id.round];
      SegmentEntry& e = r.segments[id.segment];
      if (!count_recalls) {
        out.push_back(e.info);
        continue;
      }
      ++e.info.recall_count;
      e.last_access_seq = next_seq_++;
      if (std::find(bumped.begin(), bumped.end(), id.round) == bumped.end()) {
        bumped.push_back(id.round);
        CountRecallLocked(key, id.round, r, now, &counters);
      }
      out.push_back(e.info);
    }
    SpillOrder<SegmentEntry>& order = spill_order_[s->pinned ? 1 : 0];
    for (const Moved& m : moved) order.Rekey(m.e, m.from, SpillKeyOf(*m.e, *m.r));
    for (RoundEntry* r : rekeyed) {
      if (r->in_drop_order) drop_order_.Insert(r, r->recall_count, r->insert_seq, r->drop_bytes);
    }
    // Queued under mu_: a drop of these rounds comes after, and takes their
    // records out of the queue (ApplyRemovals).
    QueueRecallCounters(std::move(counters));
    if (missing != nullptr) {
      // Back in request order, a default info where a segment is gone.
      std::vector<SegmentInfo> all(ids.size());
      size_t j = 0;
      for (size_t i = 0; i < ids.size(); ++i) {
        if (!gone[i]) all[i] = std::move(out[j++]);
      }
      out = std::move(all);
      *missing = std::move(gone);
    }
  }
  return out;
}

void Store::CountRecallLocked(const std::string& session_key, uint32_t round, RoundEntry& r,
                              int64_t now_ms, RecallWrites* counters) {
  ++r.recall_count;
  r.last_recall_ms = now_ms;
  internal::RecallRecord rec;
  rec.set_recall_count(r.recall_count);
  rec.set_last_recall_unix_ms(now_ms);
  counters->emplace_back(RoundDbKey(KeyKind::kRecall, session_key, round), rec.SerializeAsString());
}

void Store::QueueRecallCounters(RecallWrites counters) {
  if (counters.empty()) return;
  absl::MutexLock lock(&counters_mu_);
  // Each record holds the round's whole count: the latest one is enough.
  for (auto& [k, v] : counters) pending_recalls_[std::move(k)] = std::move(v);
}

void Store::FlushRecallCounters() {
  // One flush at a time, so that batches reach RocksDB in the order they
  // were taken from the queue (a later record of a round after an earlier).
  absl::MutexLock flush(&flush_mu_);
  absl::flat_hash_map<std::string, std::string> batch;
  {
    absl::MutexLock lock(&counters_mu_);
    batch.swap(pending_recalls_);
  }
  if (batch.empty()) return;
  rocksdb::WriteBatch wb;
  for (const auto& [k, v] : batch) wb.Put(k, v);
  rocksdb::Status st = db_->Write(rocksdb::WriteOptions(), &wb);
  if (!st.ok()) LogWarn("recall counter write failed", {{"error", st.ToString()}});
}

void Store::RecallCounterLoop() {
  for (;;) {
    bool stop = false;
    {
      absl::MutexLock lock(&counters_mu_);
      counters_mu_.AwaitWithTimeout(absl::Condition(&counters_stop_), kRecallFlushInterval);
      stop = counters_stop_;
    }
    FlushRecallCounters();
    if (stop) return;
  }
}

absl::StatusOr<Store::RecallResult> Store::RecordRecalls(const std::string& tenant,
                                                         const std::string& session,
                                                         const std::vector<uint32_t>& rounds) {
  KVT_RETURN_IF_ERROR(ValidateName("session_id", session));
  const std::string key = SessionKey(tenant, session);
  RecallResult result;
  RecallWrites counters;
  {
    absl::MutexLock lock(&mu_);
    SessionEntry* s = FindSessionLocked(key);
    if (s == nullptr) return NoSession(session);
    const int64_t now = options_.clock->NowUnixMs();
    TouchSessionLocked(*s, now);
    for (uint32_t round : rounds) {
      auto r = s->rounds.find(round);
      // Only rounds with a readable segment count, as in ListRounds.
      const bool readable =
          r != s->rounds.end() &&
          std::any_of(r->second.segments.begin(), r->second.segments.end(),
                      [](const auto& e) { return e.second.info.state != SegmentState::kWriting; });
      if (!readable) {
        result.not_found.push_back(round);
        continue;
      }
      UnindexRoundLocked(*s, r->second);
      CountRecallLocked(key, round, r->second, now, &counters);
      IndexRoundLocked(*s, r->second);
      result.counted.push_back(round);
    }
    QueueRecallCounters(std::move(counters));  // Under mu_, as in PrepareRead.
  }
  // An explicit record: written before the call returns.
  FlushRecallCounters();
  return result;
}

Store::SegmentEntry* Store::FindReadableLocked(const std::string& key, SegmentId id,
                                               RoundEntry** round_out) {
  SessionEntry* s = FindSessionLocked(key);
  if (s == nullptr) return nullptr;
  auto r = s->rounds.find(id.round);
  if (r == s->rounds.end()) return nullptr;
  auto e = r->second.segments.find(id.segment);
  if (e == r->second.segments.end() || e->second.info.state == SegmentState::kWriting) {
    return nullptr;
  }
  if (round_out != nullptr) *round_out = &r->second;
  return &e->second;
}

namespace {
absl::Status SegmentGone(const std::string& session, SegmentId id) {
  return absl::NotFoundError(absl::StrCat("session '", session, "' round ", id.round, " segment ",
                                          id.segment, " is gone"));
}
}  // namespace

std::optional<absl::StatusOr<ReadResult>> Store::TryReadSegment(const std::string& tenant,
                                                                const std::string& session,
                                                                SegmentId id) {
  const std::string key = SessionKey(tenant, session);
  absl::MutexLock lock(&mu_);
  SegmentEntry* e = FindReadableLocked(key, id);
  if (e == nullptr) return absl::StatusOr<ReadResult>(SegmentGone(session, id));
  if (e->info.state != SegmentState::kSealed) return std::nullopt;
  ++counters_.hits_ram;
  ReadResult result;
  result.info = e->info;
  result.payload = e->ram;
  result.served_from = Tier::kRam;
  return result;
}

absl::StatusOr<ReadResult> Store::ReadSegment(const std::string& tenant, const std::string& session,
                                              SegmentId id) {
  const std::string key = SessionKey(tenant, session);
  ReadResult result;
  uint64_t file_id = 0;
  PayloadFiles::ReadPin pin;  // Holds the file against reuse while it is read.
  auto gone = [&] { return SegmentGone(session, id); };
  {
    absl::MutexLock lock(&mu_);
    SegmentEntry* e = FindReadableLocked(key, id);
    if (e == nullptr) return gone();
    result.info = e->info;
    file_id = e->file_id;
    if (e->info.state == SegmentState::kSealed) {
      ++counters_.hits_ram;
      result.payload = e->ram;
      result.served_from = Tier::kRam;
      return result;
    }
    ++counters_.hits_disk;
    if (file_id != 0) pin = files_->PinForRead(file_id);
  }
  auto bytes = std::make_shared<std::string>();
  if (file_id != 0) {
    absl::StatusOr<std::string> got = files_->Read(file_id, result.info.payload_bytes);
    if (absl::IsNotFound(got.status())) return gone();  // Dropped meanwhile.
    KVT_RETURN_IF_ERROR(got.status());
    *bytes = *std::move(got);
  } else {
    rocksdb::Status st =
        db_->Get(rocksdb::ReadOptions(), db_->DefaultColumnFamily(),
                 SegmentDbKey(KeyKind::kPayload, key, id.round, id.segment), bytes.get());
    if (st.IsNotFound()) return gone();
    KVT_RETURN_IF_ERROR(FromRocks(st, "segment read"));
  }
  if (bytes->size() != result.info.payload_bytes || Crc32c(*bytes) != result.info.payload_crc32c) {
    LogError("stored segment failed its checksum",
             {{"tenant", tenant}, {"session", session}, {"round", id.round}});
    return absl::DataLossError("stored segment failed its checksum");
  }
  result.served_from = Tier::kDisk;
  result.payload = bytes;
  std::vector<std::shared_ptr<const std::string>> released;  // Freed after mu_.
  {
    absl::MutexLock lock(&mu_);
    RoundEntry* r = nullptr;
    SegmentEntry* e = FindReadableLocked(key, id, &r);
    SessionEntry* s = FindSessionLocked(key);
    if (e != nullptr && e->info.state == SegmentState::kSpilled) {
      ++e->disk_reads;
      const bool hot = s->pinned || (options_.promote_after_disk_reads != 0 &&
                                     e->disk_reads >= options_.promote_after_disk_reads);
      const uint64_t n = e->info.payload_bytes;
      if (hot && n <= options_.ram_budget_bytes) {
        SpillForRoomLocked(n, &released);
        if (ram_bytes_ + n <= options_.ram_budget_bytes) {
          e->ram = result.payload;
          e->info.state = SegmentState::kSealed;
          spill_order_[s->pinned ? 1 : 0].Insert(e, SpillKeyOf(*e, *r));
          ram_bytes_ += n;
          ++ram_segments_;
          ++counters_.promotions;
        }
      }
    }
  }
  return result;
}

absl::StatusOr<SessionInfo> Store::ListRounds(const std::string& tenant,
                                              const std::string& session) {
  KVT_RETURN_IF_ERROR(ValidateName("session_id", session));
  absl::MutexLock lock(&mu_);
  SessionEntry* s = FindSessionLocked(SessionKey(tenant, session));
  if (s == nullptr) return NoSession(session);
  TouchSessionLocked(*s, options_.clock->NowUnixMs());
  SessionInfo info;
  info.pinned = s->pinned;
  info.ttl_seconds = s->ttl_seconds;
  for (const auto& [rn, r] : s->rounds) {
    RoundInfo ri;
    ri.round = rn;
    if (r.summary != nullptr) ri.summary = *r.summary;
    uint64_t bytes = 0;
    for (const auto& [sn, e] : r.segments) {
      if (e.info.state == SegmentState::kWriting) continue;
      ri.segments.push_back(e.info);
      bytes += e.info.payload_bytes;
    }
    if (ri.segments.empty()) continue;
    ri.summary.set_stored_bytes(bytes);
    ri.summary.set_recall_count(r.recall_count);
    ri.summary.set_last_recall_unix_ms(r.last_recall_ms);
    info.rounds.push_back(std::move(ri));
  }
  return info;
}

absl::StatusOr<Store::ChainResult> Store::LookupChain(const std::string& tenant,
                                                      const std::vector<std::string>& sessions) {
  for (const std::string& name : sessions) KVT_RETURN_IF_ERROR(ValidateName("session_id", name));
  ChainResult result;
  absl::MutexLock lock(&mu_);
  const int64_t now = options_.clock->NowUnixMs();
  for (const std::string& name : sessions) {
    SessionEntry* s = FindSessionLocked(SessionKey(tenant, name));
    if (s == nullptr) break;
    uint64_t bytes = 0;
    bool readable = false;
    for (const auto& [rn, r] : s->rounds) {
      for (const auto& [sn, e] : r.segments) {
        if (e.info.state == SegmentState::kWriting) continue;
        readable = true;
        bytes += e.info.payload_bytes;
      }
    }
    if (!readable) break;
    TouchSessionLocked(*s, now);
    ++result.found;
    result.found_bytes += bytes;
  }
  return result;
}

Store::SessionPage Store::ListSessions(const std::string& tenant, int64_t min_idle_ms, size_t limit,
                                       const std::string& start_after, size_t scan_names) const {
  SessionPage page;
  absl::MutexLock lock(&mu_);
  const int64_t now = options_.clock->NowUnixMs();
  const size_t budget = limit + scan_names;
  size_t scanned = 0;
  auto it =
      by_name_.upper_bound(std::make_pair(std::string_view(tenant), std::string_view(start_after)));
  for (; it != by_name_.end() && it->first.first == tenant; ++it) {
    if (page.sessions.size() == limit || scanned == budget) break;
    ++scanned;
    const SessionEntry& s = *it->second;
    if (now - s.last_access_ms < min_idle_ms) continue;
    SessionSummary sum;
    sum.session = s.session;
    sum.idle_ms = now - s.last_access_ms;
    sum.pinned = s.pinned;
    sum.ttl_seconds = s.ttl_seconds;
    for (const auto& [rn, r] : s.rounds) {
      bool any = false;
      for (const auto& [sn, e] : r.segments) {
        if (e.info.state == SegmentState::kWriting) continue;
        sum.bytes += e.info.payload_bytes;
        any = true;
      }
      sum.rounds += any ? 1 : 0;
    }
    page.sessions.push_back(std::move(sum));
  }
  // Stopped before the tenant's last session: the next page starts after
  // the last one looked at.
  if (it != by_name_.end() && it->first.first == tenant && scanned > 0) {
    auto last = it;
    --last;
    page.next_start_after = std::string(last->first.second);
  }
  return page;
}

uint64_t Store::TenantSessions(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = tenant_sessions_.find(tenant);
  return it == tenant_sessions_.end() ? 0 : it->second;
}

}  // namespace kvtier::cachestore
