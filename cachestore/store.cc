#include "cachestore/store.h"

#include <algorithm>
#include <filesystem>
#include <iterator>
#include <system_error>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "cachestore/keys.h"
#include "cachestore/names.h"
#include "cachestore/payload_files.h"
#include "cachestore/rocksdb_crc32c.h"
#include "kernels/crc32c.h"
#include "kernels/encoded_tensor.h"
#include "kvtier/internal/records.pb.h"
#include "rocksdb/db.h"
#include "rocksdb/env.h"
#include "rocksdb/filter_policy.h"
#include "rocksdb/options.h"
#include "rocksdb/table.h"
#include "rocksdb/write_batch.h"

// Lock order: Store::mu_, then QuotaManager's mutex. RocksDB is never called
// with mu_ held.

namespace kvtier::cachestore {
namespace {

absl::Status FromRocks(const rocksdb::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  if (s.IsNotFound()) return absl::NotFoundError(absl::StrCat(what, ": not found"));
  if (s.IsCorruption()) return absl::DataLossError(absl::StrCat(what, ": ", s.ToString()));
  return absl::InternalError(absl::StrCat(what, ": ", s.ToString()));
}

absl::Status NoSession(const std::string& session) {
  return absl::NotFoundError(absl::StrCat("session '", session, "' not found"));
}

}  // namespace

const char* SegmentStateName(SegmentState s) {
  switch (s) {
    case SegmentState::kWriting:
      return "writing";
    case SegmentState::kSealed:
      return "sealed";
    case SegmentState::kSpilled:
      return "spilled";
    case SegmentState::kDropped:
      return "dropped";
  }
  return "unknown";
}

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

// ---- Open and recovery ----

Store::Store(StoreOptions options, QuotaManager* quotas, std::unique_ptr<rocksdb::DB> db,
             std::unique_ptr<PayloadFiles> files)
    : options_(std::move(options)),
      quotas_(quotas),
      db_(std::move(db)),
      files_(std::move(files)),
      spill_order_{SpillOrder<SegmentEntry>(options_.spill_policy),
                   SpillOrder<SegmentEntry>(options_.spill_policy)} {
  recall_thread_ = std::thread([this] { RecallCounterLoop(); });
}

Store::~Store() {
  {
    absl::MutexLock lock(&counters_mu_);
    counters_stop_ = true;
  }
  recall_thread_.join();  // It writes what is queued before it returns.
}

absl::StatusOr<std::unique_ptr<Store>> Store::Open(StoreOptions options, QuotaManager* quotas) {
  if (options.path.empty()) return absl::InvalidArgumentError("StoreOptions.path is empty");
  if (quotas == nullptr) return absl::InvalidArgumentError("a QuotaManager is required");
  if (options.clock == nullptr) return absl::InvalidArgumentError("StoreOptions.clock is null");
  if (options.max_segment_bytes == 0 || options.max_segment_bytes > (uint64_t{1} << 31)) {
    return absl::InvalidArgumentError("max_segment_bytes must be in [1, 2 GiB]");
  }
  if (options.env == nullptr) {
    // RocksDB creates the directory but not its parents.
    std::error_code ec;
    std::filesystem::create_directories(options.path, ec);
    if (ec) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot create the data directory ", options.path, ": ", ec.message()));
    }
  }
  rocksdb::Options ro;
  ro.create_if_missing = true;
  // Segments are large and immutable: keep them in blob files so compaction
  // moves only the small index records.
  ro.enable_blob_files = true;
  ro.min_blob_size = 4096;
  ro.blob_file_size = uint64_t{256} << 20;
  ro.enable_blob_garbage_collection = true;
  ro.write_buffer_size = uint64_t{64} << 20;
  ro.max_total_wal_size = uint64_t{512} << 20;
  ro.IncreaseParallelism(2);
  // A read of a spilled segment looks up one key: bloom filters spare it
  // the SST files that do not hold it, so a get does not slow down as the
  // store grows levels (kvtier-bench store-scale).
  rocksdb::BlockBasedTableOptions table;
  table.filter_policy.reset(rocksdb::NewBloomFilterPolicy(10));
  ro.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  if (options.env != nullptr) ro.env = options.env;
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(ro, options.path, &raw);
  if (!s.ok() && s.IsIOError() && absl::StrContains(absl::AsciiStrToLower(s.ToString()), "lock")) {
    return absl::FailedPreconditionError(
        absl::StrCat(options.path,
                     " is in use: another kvtier-store (or this one) holds its "
                     "RocksDB lock; give each store a --data_dir of its own (",
                     s.ToString(), ")"));
  }
  if (!s.ok()) {
    return absl::InternalError(
        absl::StrCat("cannot open RocksDB at ", options.path, ": ", s.ToString()));
  }
  std::unique_ptr<rocksdb::DB> db(raw);
  rocksdb::Env* env = options.env != nullptr ? options.env : rocksdb::Env::Default();
  KVT_ASSIGN_OR_RETURN(
      std::unique_ptr<PayloadFiles> files,
      PayloadFiles::Open(env->GetFileSystem().get(), options.path + "/payloads",
                         options.spare_payload_files, options.sync_writes,
                         options.recycle_payload_bytes,
                         // files_ goes before db_ (member order).
                         [db = db.get()] { return FromRocks(db->SyncWAL(), "sync deletions"); }));
  std::unique_ptr<Store> store(
      new Store(std::move(options), quotas, std::move(db), std::move(files)));
  KVT_RETURN_IF_ERROR(store->Recover());
  return store;
}

absl::Status Store::Recover() {
  absl::MutexLock lock(&mu_);
  absl::flat_hash_set<uint64_t> referenced_files;
  const int64_t now = options_.clock->NowUnixMs();
  // Entries are indexed once the scan is done (below): records found later
  // change their pinned, ttl and counters.
  auto session_for = [&](const ParsedKey& k) -> SessionEntry& {
    mu_.AssertHeld();  // Runs under the lock above; tells clang's analysis.
    SessionEntry& s = sessions_[SessionKey(k.tenant, k.session)];
    if (s.tenant.empty()) {
      s.tenant = k.tenant;
      s.session = k.session;
      s.ttl_seconds = options_.default_ttl_seconds;
      s.last_access_ms = now;
    }
    return s;
  };
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  // Payload keys ('d') are skipped: recovery reads only the small records.
  for (char kind : {'i', 'm', 'r', 'c'}) {
    for (it->Seek(std::string(1, kind)); it->Valid() && it->key()[0] == kind; it->Next()) {
      std::optional<ParsedKey> k = ParseDbKey(it->key().ToStringView());
      if (!k.has_value()) {
        LogWarn("recovery: skipping malformed key", {{"kind", std::string(1, kind)}});
        continue;
      }
      if (kind == 'i') {
        internal::SegmentRecord rec;
        if (!rec.ParseFromArray(it->value().data(), static_cast<int>(it->value().size()))) {
          return absl::DataLossError("recovery: unreadable segment record");
        }
        SessionEntry& s = session_for(*k);
        RoundEntry& r = s.rounds[k->round];
        SegmentEntry& e = r.segments[k->segment];
        e.info.id = {k->round, k->segment};
        e.info.layer_begin = rec.layer_begin();
        e.info.layer_end = rec.layer_end();
        e.info.payload_bytes = rec.payload_bytes();
        e.info.payload_crc32c = rec.payload_crc32c();
        e.info.state = SegmentState::kSpilled;
        e.file_id = rec.file_id();
        if (rec.file_id() != 0) referenced_files.insert(rec.file_id());
        e.insert_seq = next_seq_++;
        e.last_access_seq = e.insert_seq;
        if (r.insert_seq == 0) r.insert_seq = e.insert_seq;
        disk_bytes_ += rec.payload_bytes();
        ++disk_segments_;
        quotas_->Charge(k->tenant, rec.payload_bytes());
      } else {
        auto found = sessions_.find(SessionKey(k->tenant, k->session));
        if (kind != 'm' && found == sessions_.end()) continue;  // Orphan of a dropped round.
        SessionEntry& s = session_for(*k);
        if (kind == 'm') {
          internal::SessionRecord rec;
          if (rec.ParseFromArray(it->value().data(), static_cast<int>(it->value().size()))) {
            s.pinned = rec.pinned();
            s.ttl_seconds = rec.ttl_seconds();
            s.persisted = true;
          }
          continue;
        }
        auto r = s.rounds.find(k->round);
        if (r == s.rounds.end()) continue;
        if (kind == 'r') {
          internal::RoundRecord rec;
          if (rec.ParseFromArray(it->value().data(), static_cast<int>(it->value().size()))) {
            r->second.summary = std::make_unique<v1::RoundSummary>(rec.summary());
          }
        } else {
          internal::RecallRecord rec;
          if (rec.ParseFromArray(it->value().data(), static_cast<int>(it->value().size()))) {
            r->second.recall_count = rec.recall_count();
            r->second.last_recall_ms = rec.last_recall_unix_ms();
          }
        }
      }
    }
  }
  KVT_RETURN_IF_ERROR(FromRocks(it->status(), "recovery scan"));
  for (auto& [key, s] : sessions_) {
    ++tenant_sessions_[s.tenant];
    by_name_.emplace(std::make_pair(std::string_view(s.tenant), std::string_view(s.session)), &s);
    IndexSessionTimesLocked(s);
    for (auto& [rn, r] : s.rounds) {
      r.session = &s;
      r.number = rn;
      IndexRoundLocked(s, r);
    }
  }
  // Payload files that no index record names were written by uploads that
  // never committed (a crash between the file and the record): deleted, or
  // kept as spares when empty.
  KVT_ASSIGN_OR_RETURN(const int orphans, files_->Recover(referenced_files));
  LogInfo("store recovered",
          {{"path", options_.path},
           {"rocksdb_crc32c",
            RocksDbUsesKvtierCrc32c() ? Crc32cPathName(Crc32cActivePath()) : "rocksdb's own"},
           {"orphan_payload_files_removed", orphans},
           {"sessions", sessions_.size()},
           {"segments", disk_segments_},
           {"bytes", disk_bytes_}});
  return absl::OkStatus();
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

void Store::UnindexRoundLocked(SessionEntry& s, RoundEntry& r) {
  if (r.in_drop_order) {
    drop_order_.Erase(&r, r.recall_count, r.insert_seq, r.drop_bytes);
    r.in_drop_order = false;
  }
  SpillOrder<SegmentEntry>& order = spill_order_[s.pinned ? 1 : 0];
  for (auto& [sn, e] : r.segments) {
    if (e.info.state == SegmentState::kSealed) order.Erase(&e, SpillKeyOf(e, r));
  }
}

void Store::IndexRoundLocked(SessionEntry& s, RoundEntry& r) {
  SpillOrder<SegmentEntry>& order = spill_order_[s.pinned ? 1 : 0];
  uint64_t bytes = 0;
  for (auto& [sn, e] : r.segments) {
    bytes += e.info.payload_bytes;
    if (e.info.state == SegmentState::kSealed) order.Insert(&e, SpillKeyOf(e, r));
  }
  if (!s.pinned && r.writing == 0 && bytes != 0) {
    r.drop_bytes = bytes;
    r.in_drop_order = true;
    drop_order_.Insert(&r, r.recall_count, r.insert_seq, bytes);
  }
}

Store::SessionEntry& Store::AddSessionLocked(const std::string& key, const std::string& tenant,
                                             const std::string& session, uint32_t ttl_seconds,
                                             int64_t now_ms) {
  SessionEntry& s = sessions_[key];
  s.tenant = tenant;
  s.session = session;
  s.ttl_seconds = ttl_seconds;
  s.last_access_ms = now_ms;
  ++tenant_sessions_[tenant];
  by_name_.emplace(std::make_pair(std::string_view(s.tenant), std::string_view(s.session)), &s);
  IndexSessionTimesLocked(s);
  return s;
}

void Store::EraseSessionLocked(const std::string& key) {
  auto it = sessions_.find(key);
  if (it == sessions_.end()) return;
  SessionEntry& s = it->second;
  for (auto& [rn, r] : s.rounds) UnindexRoundLocked(s, r);
  UnindexSessionTimesLocked(s);
  auto t = tenant_sessions_.find(s.tenant);
  if (t != tenant_sessions_.end() && --t->second == 0) tenant_sessions_.erase(t);
  by_name_.erase(std::make_pair(std::string_view(s.tenant), std::string_view(s.session)));
  sessions_.erase(it);
}

void Store::UnindexSessionTimesLocked(SessionEntry& s) {
  by_idle_.erase({s.last_access_ms, &s});
  if (s.indexed_deadline_ms >= 0) by_deadline_.erase({s.indexed_deadline_ms, &s});
  s.indexed_deadline_ms = -1;
}

void Store::IndexSessionTimesLocked(SessionEntry& s) {
  by_idle_.insert({s.last_access_ms, &s});
  if (!s.pinned && s.ttl_seconds != 0) {
    s.indexed_deadline_ms = s.last_access_ms + int64_t{s.ttl_seconds} * 1000;
    by_deadline_.insert({s.indexed_deadline_ms, &s});
  }
}

void Store::TouchSessionLocked(SessionEntry& s, int64_t now_ms) {
  UnindexSessionTimesLocked(s);
  s.last_access_ms = now_ms;
  IndexSessionTimesLocked(s);
}

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

// ---- Reads ----

absl::StatusOr<std::vector<SegmentInfo>> Store::PrepareRead(const std::string& tenant,
                                                            const std::string& session,
                                                            const std::vector<SegmentId>& ids,
                                                            uint64_t max_bytes,
                                                            bool count_recalls) {
  KVT_RETURN_IF_ERROR(ValidateName("session_id", session));
  const std::string key = SessionKey(tenant, session);
  std::vector<SegmentInfo> out;
  RecallWrites counters;
  {
    absl::MutexLock lock(&mu_);
    SessionEntry* s = FindSessionLocked(key);
    if (s == nullptr) return NoSession(session);
    uint64_t total = 0;
    for (const SegmentId& id : ids) {
      auto r = s->rounds.find(id.round);
      const SegmentEntry* e = nullptr;
      if (r != s->rounds.end()) {
        auto it = r->second.segments.find(id.segment);
        if (it != r->second.segments.end() && it->second.info.state != SegmentState::kWriting) {
          e = &it->second;
        }
      }
      if (e == nullptr) {
        return absl::NotFoundError(absl::StrCat("session '", session, "' has no round ", id.round,
                                                " segment ", id.segment));
      }
      total += e->info.payload_bytes;
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
      for (const SegmentId& id : ids) {
        RoundEntry* r = &s->rounds[id.round];
        if (std::find(rekeyed.begin(), rekeyed.end(), r) != rekeyed.end()) continue;
        rekeyed.push_back(r);
        if (r->in_drop_order) drop_order_.Erase(r, r->recall_count, r->insert_seq, r->drop_bytes);
        for (auto& [sn, e] : r->segments) {
          if (e.info.state == SegmentState::kSealed) moved.push_back({&e, r, SpillKeyOf(e, *r)});
        }
      }
    }
    for (const SegmentId& id : ids) {
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

StoreStats Store::Stats() const {
  absl::MutexLock lock(&mu_);
  StoreStats s = counters_;
  s.ram_bytes = ram_bytes_;
  s.ram_segments = ram_segments_;
  s.disk_bytes = disk_bytes_;
  s.disk_segments = disk_segments_;
  s.ram_budget_bytes = options_.ram_budget_bytes;
  s.disk_budget_bytes = options_.disk_budget_bytes;
  s.sessions = sessions_.size();
  s.spare_payload_files = files_->spares();
  s.spare_misses = files_->spare_misses();
  s.recycled_payload_files = files_->recycled();
  s.recycled_payload_bytes = files_->recycled_bytes();
  s.recycle_hits = files_->recycle_hits();
  return s;
}

absl::Status Store::CheckIndex() const {
  absl::MutexLock lock(&mu_);
  absl::flat_hash_map<std::string, uint64_t> tenants;
  size_t deadlines = 0;
  for (bool pinned : {false, true}) {
    // What the old planner read: every sealed segment of the class.
    std::vector<SpillCandidate> cands;
    std::vector<const SegmentEntry*> entries;
    uint64_t total = 0;
    for (const auto& [k, s] : sessions_) {
      if (s.pinned != pinned) continue;
      for (const auto& [rn, r] : s.rounds) {
        for (const auto& [sn, e] : r.segments) {
          if (e.info.state != SegmentState::kSealed) continue;
          cands.push_back({e.info.payload_bytes, e.insert_seq, e.last_access_seq, r.recall_count});
          entries.push_back(&e);
          total += e.info.payload_bytes;
        }
      }
    }
    std::vector<const SegmentEntry*> planned;
    for (size_t i : PlanSpill(cands, total, options_.spill_policy)) planned.push_back(entries[i]);
    std::vector<const SegmentEntry*> walked;
    spill_order_[pinned ? 1 : 0].Walk([&](SegmentEntry* e, const SpillKey&) {
      walked.push_back(e);
      return true;
    });
    if (walked != planned) {
      return absl::InternalError(absl::StrCat("spill order (", pinned ? "pinned" : "unpinned",
                                              ") lists ", walked.size(), " segments, the planner ",
                                              planned.size(), ", or their order differs"));
    }
  }
  std::vector<DropCandidate> drops;
  std::vector<const RoundEntry*> rounds;
  uint64_t droppable = 0;
  for (const auto& [k, s] : sessions_) {
    ++tenants[s.tenant];
    if (by_idle_.count({s.last_access_ms, const_cast<SessionEntry*>(&s)}) == 0) {
      return absl::InternalError(absl::StrCat("session ", s.session, " is not in by_idle"));
    }
    const bool expires = !s.pinned && s.ttl_seconds != 0;
    const int64_t deadline = s.last_access_ms + int64_t{s.ttl_seconds} * 1000;
    if (expires != (s.indexed_deadline_ms >= 0) || (expires && s.indexed_deadline_ms != deadline) ||
        (expires && by_deadline_.count({deadline, const_cast<SessionEntry*>(&s)}) == 0)) {
      return absl::InternalError(absl::StrCat("session ", s.session, " has a stale TTL deadline"));
    }
    deadlines += expires ? 1 : 0;
    for (const auto& [rn, r] : s.rounds) {
      if (r.session != &s || r.number != rn) {
        return absl::InternalError(
            absl::StrCat("round ", rn, " of ", s.session, " does not point back at its session"));
      }
      uint64_t bytes = 0;
      uint32_t writing = 0;
      for (const auto& [sn, e] : r.segments) {
        bytes += e.info.payload_bytes;
        writing += e.info.state == SegmentState::kWriting ? 1 : 0;
      }
      if (writing != r.writing) {
        return absl::InternalError(absl::StrCat("round ", rn, " of ", s.session, " counts ",
                                                r.writing, " uploads, holds ", writing));
      }
      if (s.pinned || writing != 0 || bytes == 0) continue;
      drops.push_back({bytes, r.insert_seq, r.recall_count});
      rounds.push_back(&r);
      droppable += bytes;
    }
  }
  if (by_idle_.size() != sessions_.size() || by_deadline_.size() != deadlines) {
    return absl::InternalError("session time indexes hold entries of no session");
  }
  if (tenants != tenant_sessions_) return absl::InternalError("tenant session counts differ");
  if (by_name_.size() != sessions_.size()) {
    return absl::InternalError("the name index holds entries of no session");
  }
  for (const auto& [name, s] : by_name_) {
    if (name.first != s->tenant || name.second != s->session) {
      return absl::InternalError(absl::StrCat("the name index's ", std::string(name.second),
                                              " names session ", s->session));
    }
  }
  if (drop_order_.bytes() != droppable) {
    return absl::InternalError(
        absl::StrCat("drop order holds ", drop_order_.bytes(), " bytes, the rounds ", droppable));
  }
  std::vector<const RoundEntry*> planned;
  if (!drops.empty()) {
    const std::optional<std::vector<size_t>> plan = PlanDrop(drops, droppable);
    for (size_t i : plan.value()) planned.push_back(rounds[i]);
  }
  std::vector<const RoundEntry*> walked;
  drop_order_.Walk([&](RoundEntry* r) {
    walked.push_back(r);
    return true;
  });
  if (walked != planned) {
    return absl::InternalError(absl::StrCat("drop order lists ", walked.size(),
                                            " rounds, the planner ", planned.size(),
                                            ", or their order differs"));
  }
  return absl::OkStatus();
}

uint64_t Store::DbMemoryBytes() const {
  uint64_t total = 0;
  for (const char* property : {"rocksdb.cur-size-all-mem-tables",
                               "rocksdb.estimate-table-readers-mem", "rocksdb.block-cache-usage"}) {
    uint64_t v = 0;
    if (db_->GetIntProperty(property, &v)) total += v;
  }
  return total;
}

bool Store::DbBusy() const {
  for (const char* property : {"rocksdb.num-running-flushes", "rocksdb.num-running-compactions",
                               "rocksdb.mem-table-flush-pending", "rocksdb.compaction-pending"}) {
    uint64_t v = 0;
    if (db_->GetIntProperty(property, &v) && v > 0) return true;
  }
  return false;
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
