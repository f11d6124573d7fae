// Store: opening and recovery, the index's bookkeeping, stats.
#include "cachestore/store.h"

#include <filesystem>
#include <system_error>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "cachestore/keys.h"
#include "cachestore/payload_files.h"
#include "cachestore/rocksdb_crc32c.h"
#include "cachestore/store_internal.h"
#include "kernels/crc32c.h"
#include "kvtier/internal/records.pb.h"
#include "rocksdb/db.h"
#include "rocksdb/env.h"
#include "rocksdb/filter_policy.h"
#include "rocksdb/options.h"
#include "rocksdb/table.h"

// Lock order: Store::mu_, then QuotaManager's mutex. RocksDB is never called
// with mu_ held.

namespace kvtier::cachestore {

using detail::FromRocks;
using detail::NoSession;

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

// ---- The index ----

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

bool Store::WaitForSparePayloadFiles(uint64_t n, absl::Duration timeout) const {
  return files_->WaitForSpares(static_cast<size_t>(n), timeout);
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

}  // namespace kvtier::cachestore
