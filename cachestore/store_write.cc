// Store: the two-phase write (BeginWrite, chunks, CommitWrite), spilling
// RAM for room.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "cachestore/keys.h"
#include "cachestore/names.h"
#include "cachestore/payload_files.h"
#include "cachestore/store.h"
#include "cachestore/store_internal.h"
#include "encoded/encoded_tensor.h"
#include "kernels/crc32c.h"
#include "kvtier/internal/records.pb.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "rocksdb/write_batch.h"

namespace kvtier::cachestore {

using detail::FromRocks;
using detail::NoSession;

// ---- WriteTicket ----

WriteTicket::WriteTicket(WriteTicket&& o) noexcept { *this = std::move(o); }

WriteTicket& WriteTicket::operator=(WriteTicket&& o) noexcept {
  if (this != &o) {
    if (store_ != nullptr) store_->AbortWrite(spec_, write_id_);
    store_ = o.store_;
    spec_ = std::move(o.spec_);
    write_id_ = o.write_id_;
    grant_ = std::move(o.grant_);
    to_file_ = o.to_file_;
    file_id_ = o.file_id_;
    writer_ = std::move(o.writer_);
    o.store_ = nullptr;
  }
  return *this;
}

WriteTicket::~WriteTicket() {
  if (store_ != nullptr) store_->AbortWrite(spec_, write_id_);
}

// ---- Writes ----

Store::SessionEntry* Store::FindSessionLocked(const std::string& key) {
  auto it = sessions_.find(key);
  return it == sessions_.end() ? nullptr : &it->second;
}

absl::StatusOr<WriteTicket> Store::BeginWrite(const WriteSpec& spec) {
  absl::MutexLock order(&removal_mu_);
  std::vector<Removal> removals;
  bool declined = false;
  absl::StatusOr<WriteTicket> ticket = BeginWriteLocked(spec, true, &removals, &declined);
  if (absl::Status st = ApplyRemovals(removals); !st.ok()) {
    LogError("dropping rounds under disk pressure failed", {{"error", st.ToString()}});
  }
  return ticket;
}

std::optional<absl::StatusOr<WriteTicket>> Store::TryBeginWrite(const WriteSpec& spec) {
  if (!removal_mu_.TryLock()) return std::nullopt;
  std::vector<Removal> removals;  // Stays empty: no room is made here.
  bool declined = false;
  absl::StatusOr<WriteTicket> ticket = BeginWriteLocked(spec, false, &removals, &declined);
  removal_mu_.Unlock();
  if (declined) return std::nullopt;
  return ticket;
}

absl::StatusOr<WriteTicket> Store::BeginWriteLocked(const WriteSpec& spec, bool may_make_room,
                                                    std::vector<Removal>* removals,
                                                    bool* declined) {
  KVT_RETURN_IF_ERROR(ValidateName("tenant", spec.tenant));
  KVT_RETURN_IF_ERROR(ValidateName("session_id", spec.session));
  if (spec.id.round > kMaxRound) return absl::InvalidArgumentError("round out of range");
  if (spec.id.segment >= kMaxSegmentsPerRound) {
    return absl::InvalidArgumentError(
        absl::StrCat("segment must be below ", kMaxSegmentsPerRound, ", got ", spec.id.segment));
  }
  if (spec.layer_begin >= spec.layer_end || spec.layer_end > kMaxLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad layer range [", spec.layer_begin, ", ", spec.layer_end, ")"));
  }
  if (spec.payload_bytes == 0 || spec.payload_bytes > options_.max_segment_bytes) {
    return absl::OutOfRangeError(absl::StrCat("payload_bytes ", spec.payload_bytes, " outside [1, ",
                                              options_.max_segment_bytes, "]"));
  }
  WriteTicket ticket;
  {
    absl::MutexLock lock(&mu_);
    const std::string key = SessionKey(spec.tenant, spec.session);
    SessionEntry* s = FindSessionLocked(key);
    if (s != nullptr) {
      auto r = s->rounds.find(spec.id.round);
      if (r != s->rounds.end() && r->second.segments.count(spec.id.segment) != 0) {
        return absl::AlreadyExistsError(
            absl::StrCat("round ", spec.id.round, " segment ", spec.id.segment, " already exists"));
      }
    }
    const bool needs_room =
        options_.disk_budget_bytes != 0 &&
        disk_bytes_ + disk_reserved_ + spec.payload_bytes > options_.disk_budget_bytes;
    if (needs_room && !may_make_room) {
      *declined = true;
      return absl::UnavailableError("BeginWrite would make disk room");
    }
    KVT_ASSIGN_OR_RETURN(QuotaGrant grant, quotas_->Reserve(spec.tenant, spec.payload_bytes));
    if (needs_room) {
      KVT_RETURN_IF_ERROR(MakeDiskRoomLocked(
          disk_bytes_ + disk_reserved_ + spec.payload_bytes - options_.disk_budget_bytes, key,
          removals));
    }
    const int64_t now = options_.clock->NowUnixMs();
    if (s == nullptr) {
      s = &AddSessionLocked(key, spec.tenant, spec.session,
                            spec.session_ttl_seconds.value_or(options_.default_ttl_seconds), now);
    }
    TouchSessionLocked(*s, now);
    RoundEntry& r = s->rounds[spec.id.round];
    if (r.insert_seq == 0) {
      r.insert_seq = next_seq_++;
      r.session = s;
      r.number = spec.id.round;
    }
    UnindexRoundLocked(*s, r);
    ++r.writing;
    SegmentEntry& e = r.segments[spec.id.segment];
    e.info.id = spec.id;
    e.info.layer_begin = spec.layer_begin;
    e.info.layer_end = spec.layer_end;
    e.info.payload_bytes = spec.payload_bytes;
    e.info.payload_crc32c = spec.payload_crc32c;
    e.info.state = SegmentState::kWriting;
    e.write_id = next_seq_++;
    IndexRoundLocked(*s, r);
    disk_reserved_ += spec.payload_bytes;
    ticket.store_ = this;
    ticket.spec_ = spec;
    ticket.write_id_ = e.write_id;
    ticket.to_file_ = spec.payload_bytes > options_.inline_payload_max_bytes;
    ticket.grant_ = std::move(grant);
  }
  return ticket;
}

absl::Status Store::WriteChunk(WriteTicket& ticket, std::string_view bytes) {
  if (!ticket.valid()) return absl::FailedPreconditionError("empty write ticket");
  if (!ticket.to_file_) return absl::OkStatus();  // Inline: RocksDB takes it at commit.
  KVT_RETURN_IF_ERROR(StartPayloadFile(ticket));
  if (ticket.writer_->written() + bytes.size() > ticket.spec_.payload_bytes) {
    return absl::OutOfRangeError(
        absl::StrCat("chunks pass the declared ", ticket.spec_.payload_bytes, " payload bytes"));
  }
  return ticket.writer_->Append(bytes);
}

absl::Status Store::StartPayloadFile(WriteTicket& ticket) {
  if (ticket.writer_ != nullptr) return absl::OkStatus();
  KVT_ASSIGN_OR_RETURN(ticket.writer_,
                       files_->NewWriter(options_.sync_writes, ticket.spec_.payload_bytes));
  ticket.file_id_ = ticket.writer_->id();
  return absl::OkStatus();
}

void Store::AbortWrite(const WriteSpec& spec, uint64_t write_id) {
  absl::MutexLock lock(&mu_);
  const std::string key = SessionKey(spec.tenant, spec.session);
  SessionEntry* s = FindSessionLocked(key);
  if (s == nullptr) return;
  auto r = s->rounds.find(spec.id.round);
  if (r == s->rounds.end()) return;
  auto e = r->second.segments.find(spec.id.segment);
  if (e == r->second.segments.end() || e->second.write_id != write_id) return;
  disk_reserved_ -= e->second.info.payload_bytes;
  UnindexRoundLocked(*s, r->second);
  --r->second.writing;
  r->second.segments.erase(e);
  if (r->second.segments.empty()) {
    s->rounds.erase(r);
  } else {
    IndexRoundLocked(*s, r->second);
  }
  if (s->rounds.empty() && !s->persisted && !s->pinned) EraseSessionLocked(key);
}

absl::StatusOr<SegmentInfo> Store::CommitWrite(WriteTicket ticket, std::string payload,
                                               std::optional<uint32_t> computed_crc32c,
                                               bool defer_sync) {
  // On an error the ticket still holds the write: its destructor aborts it.
  // Here, before this returns: a parameter itself may live until the end of
  // the caller's full expression (GCC's ABI destroys it there), so a caller
  // that answers its client within that expression would answer before the
  // abort, and a retry would meet the failed write's reservation
  // (ALREADY_EXISTS).
  WriteTicket held = std::move(ticket);
  bool declined = false;
  return CommitWriteImpl(held, payload, computed_crc32c, false, defer_sync, &declined);
}

std::optional<absl::StatusOr<SegmentInfo>> Store::TryCommitWrite(
    WriteTicket& ticket, std::string& payload, std::optional<uint32_t> computed_crc32c,
    bool defer_sync) {
  if (!ticket.valid() || (options_.sync_writes && !defer_sync) || ticket.to_file_) {
    return std::nullopt;
  }
  bool declined = false;
  absl::StatusOr<SegmentInfo> info =
      CommitWriteImpl(ticket, payload, computed_crc32c, true, defer_sync, &declined);
  if (declined) return std::nullopt;
  WriteTicket consumed = std::move(ticket);  // Aborts the write on an error.
  return info;
}

absl::Status Store::SyncWrites() {
  if (!options_.sync_writes) return absl::OkStatus();
  // Every write of the caller's completed before this: its sequence number
  // is at most `mine`.
  const uint64_t mine = db_->GetLatestSequenceNumber();
  absl::MutexLock lock(&sync_mu_);
  for (;;) {
    if (synced_seq_ >= mine) return absl::OkStatus();
    if (!syncing_) break;
    // A sync runs: it may cover these writes (when they completed before it
    // began); look again once it is done.
    const auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(sync_mu_) { return !syncing_; };
    sync_mu_.Await(absl::Condition(&done));
  }
  syncing_ = true;
  const uint64_t covers = db_->GetLatestSequenceNumber();  // At least `mine`.
  sync_mu_.Unlock();
  const rocksdb::Status st = db_->SyncWAL();
  sync_mu_.Lock();
  syncing_ = false;
  if (st.ok()) synced_seq_ = std::max(synced_seq_, covers);
  return FromRocks(st, "WAL sync");
}

absl::StatusOr<SegmentInfo> Store::CommitWriteImpl(WriteTicket& ticket, std::string& payload,
                                                   std::optional<uint32_t> computed_crc32c,
                                                   bool try_only, bool defer_sync, bool* declined) {
  if (!ticket.valid()) return absl::FailedPreconditionError("empty write ticket");
  const WriteSpec& spec = ticket.spec_;
  if (payload.size() != spec.payload_bytes) {
    return absl::OutOfRangeError(absl::StrCat("payload has ", payload.size(),
                                              " bytes, header declared ", spec.payload_bytes));
  }
  const uint32_t crc = computed_crc32c.has_value() ? *computed_crc32c : Crc32c(payload);
  if (crc != spec.payload_crc32c) {
    return absl::DataLossError("payload crc32c does not match the header");
  }
  {
    KVT_ASSIGN_OR_RETURN(std::vector<TensorParts> parts, SplitPayload(payload, true));
    if (parts.empty()) return absl::InvalidArgumentError("segment payload holds no tensors");
    for (size_t i = 0; i < parts.size(); ++i) {
      const uint32_t lb = parts[i].meta.layer_begin();
      if (lb < spec.layer_begin || lb >= spec.layer_end) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", i, " starts at layer ", lb, ", outside the segment's layers [",
                         spec.layer_begin, ", ", spec.layer_end, ")"));
      }
    }
  }

  const std::string key = SessionKey(spec.tenant, spec.session);
  bool write_session_record = false;
  bool write_round_record = false;
  uint32_t ttl = 0;
  bool pinned = false;
  {
    absl::MutexLock lock(&mu_);
    SessionEntry* s = FindSessionLocked(key);
    if (s == nullptr) return absl::AbortedError("session deleted during upload");
    auto ri = s->rounds.find(spec.id.round);
    if (ri == s->rounds.end()) return absl::AbortedError("round deleted during upload");
    RoundEntry& r = ri->second;
    auto e = r.segments.find(spec.id.segment);
    if (e == r.segments.end() || e->second.write_id != ticket.write_id_ || e->second.cancelled) {
      return absl::AbortedError("session or round deleted during upload");
    }
    write_session_record = !s->persisted;
    ttl = s->ttl_seconds;
    pinned = s->pinned;
    if (try_only && (write_session_record || (spec.has_round_summary && r.summary == nullptr))) {
      // A first record of the session or round is claimed here and must be
      // given back if the write then stalls: left to CommitWrite.
      *declined = true;
      return absl::UnavailableError("commit records a new session or round");
    }
    if (spec.has_round_summary && r.summary == nullptr) {
      write_round_record = true;
      // Claimed; reverted below on failure.
      r.summary = std::make_unique<v1::RoundSummary>(spec.round_summary);
    }
  }

  rocksdb::WriteBatch batch;
  internal::SegmentRecord rec;
  rec.set_layer_begin(spec.layer_begin);
  rec.set_layer_end(spec.layer_end);
  rec.set_payload_bytes(spec.payload_bytes);
  rec.set_payload_crc32c(spec.payload_crc32c);
  rec.set_written_unix_ms(options_.clock->NowUnixMs());
  absl::Status written;
  if (ticket.to_file_) {
    // The file first (what WriteChunk did not write yet): the index record
    // below is the commit point.
    written = StartPayloadFile(ticket);
    if (written.ok() && ticket.writer_->written() < payload.size()) {
      written = ticket.writer_->Append(std::string_view(payload).substr(ticket.writer_->written()));
    }
    if (written.ok()) written = ticket.writer_->Finish();
  } else {
    batch.Put(SegmentDbKey(KeyKind::kPayload, key, spec.id.round, spec.id.segment), payload);
  }
  const uint64_t file_id = ticket.file_id_;  // 0 when inline (or the file failed).
  rec.set_file_id(file_id);
  batch.Put(SegmentDbKey(KeyKind::kSegment, key, spec.id.round, spec.id.segment),
            rec.SerializeAsString());
  if (write_round_record) {
    internal::RoundRecord rr;
    *rr.mutable_summary() = spec.round_summary;
    batch.Put(RoundDbKey(KeyKind::kRound, key, spec.id.round), rr.SerializeAsString());
  }
  if (write_session_record) {
    internal::SessionRecord sr;
    sr.set_pinned(pinned);
    sr.set_ttl_seconds(ttl);
    batch.Put(SessionDbKey(key), sr.SerializeAsString());
  }
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync_writes && !defer_sync;
  // A stall would block the caller: decline instead (nothing is written).
  wo.no_slowdown = try_only;
  if (written.ok()) {
    const rocksdb::Status st = db_->Write(wo, &batch);
    if (try_only && st.IsIncomplete()) {
      *declined = true;
      return absl::UnavailableError("RocksDB would stall the write");
    }
    written = FromRocks(st, "segment write");
    // Never committed, but the record may have reached the WAL: not reused.
    if (!written.ok() && file_id != 0) (void)files_->Remove(file_id);
  }

  Removal undo;
  SegmentInfo info;
  std::vector<std::shared_ptr<const std::string>> released;  // Freed after mu_.
  {
    absl::MutexLock lock(&mu_);
    SessionEntry* s = FindSessionLocked(key);
    SegmentEntry* e = nullptr;
    RoundEntry* r = nullptr;
    if (s != nullptr) {
      auto ri = s->rounds.find(spec.id.round);
      if (ri != s->rounds.end()) {
        r = &ri->second;
        auto ei = r->segments.find(spec.id.segment);
        if (ei != r->segments.end() && ei->second.write_id == ticket.write_id_) e = &ei->second;
      }
    }
    if (!written.ok() || e == nullptr || e->cancelled) {
      if (r != nullptr && write_round_record) r->summary.reset();
      if (written.ok()) {
        // Deleted while we wrote: take our bytes back out of RocksDB.
        undo.session_key = key;
        undo.tenant = spec.tenant;
        // The round's summary and counters stay unless nothing else is left.
        const bool round_empty = r == nullptr || r->segments.size() <= 1;
        undo.rounds.push_back({spec.id.round, {{spec.id.segment, file_id}}, round_empty});
      }
    } else {
      if (write_session_record) s->persisted = true;
      disk_reserved_ -= spec.payload_bytes;
      disk_bytes_ += spec.payload_bytes;
      ++disk_segments_;
      // Still kWriting, so in no order: these fields are free to change.
      e->write_id = 0;
      e->file_id = file_id;
      e->insert_seq = next_seq_++;
      e->last_access_seq = e->insert_seq;
      const bool fits = spec.payload_bytes <= options_.ram_budget_bytes;
      if (fits) SpillForRoomLocked(spec.payload_bytes, &released);
      UnindexRoundLocked(*s, *r);
      --r->writing;
      if (fits && ram_bytes_ + spec.payload_bytes <= options_.ram_budget_bytes) {
        e->ram = std::make_shared<const std::string>(std::move(payload));
        e->info.state = SegmentState::kSealed;
        ram_bytes_ += spec.payload_bytes;
        ++ram_segments_;
      } else {
        e->info.state = SegmentState::kSpilled;
      }
      IndexRoundLocked(*s, *r);
      ticket.grant_.Commit();
      ticket.store_ = nullptr;  // Finished: the ticket must not abort.
      info = e->info;
    }
  }
  if (!written.ok()) return written;  // The ticket's destructor aborts the write.
  if (!undo.rounds.empty()) {
    if (absl::Status st = ApplyRemovals({undo}); !st.ok()) {
      LogError("undoing a cancelled write failed", {{"error", st.ToString()}});
    }
    return absl::AbortedError("session or round deleted during upload");
  }
  return info;
}

void Store::SpillForRoomLocked(uint64_t bytes_needed,
                               std::vector<std::shared_ptr<const std::string>>* released) {
  // Unpinned segments first; pinned ones only when those are not enough.
  for (bool pinned : {false, true}) {
    if (ram_bytes_ + bytes_needed <= options_.ram_budget_bytes) return;
    const uint64_t excess = ram_bytes_ + bytes_needed - options_.ram_budget_bytes;
    SpillOrder<SegmentEntry>& order = spill_order_[pinned ? 1 : 0];
    std::vector<std::pair<SegmentEntry*, SpillKey>> chosen;
    uint64_t freed = 0;
    order.Walk([&](SegmentEntry* e, const SpillKey& k) {
      if (freed >= excess) return false;
      chosen.push_back({e, k});
      freed += e->info.payload_bytes;
      return true;
    });
    for (auto& [e, k] : chosen) {
      order.Erase(e, k);
      released->push_back(std::move(e->ram));
      e->ram.reset();
      e->info.state = SegmentState::kSpilled;
      e->disk_reads = 0;
      ram_bytes_ -= e->info.payload_bytes;
      --ram_segments_;
      ++counters_.spills;
    }
  }
}

}  // namespace kvtier::cachestore
