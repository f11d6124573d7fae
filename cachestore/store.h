// The round-granular KV store engine: tenant / session / round / segment
// keys, a RAM tier with a byte budget over a RocksDB tier that holds every
// acknowledged segment.
//
// Durability model: a segment is written to RocksDB (payload and index record
// in one atomic WriteBatch, WAL fsync'd when StoreOptions::sync_writes) before
// its write is acknowledged. The RAM tier is a hot copy of durable data, so
// "spilling" a segment releases its RAM copy and costs no I/O, and a kill -9
// loses nothing that was acknowledged.
//
// Segment lifecycle (SegmentState):
//   kWriting --CommitWrite--> kSealed (in RAM and on disk)
//   kWriting --CommitWrite--> kSpilled (too big for RAM, or RAM held by pins)
//   kSealed  --spill-->       kSpilled (RAM copy released)
//   kSpilled --promote-->     kSealed  (read often enough from disk)
//   any      --drop/delete/expire--> kDropped (removed from the index)
#ifndef KVTIER_CACHESTORE_STORE_H_
#define KVTIER_CACHESTORE_STORE_H_

#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/clock.h"
#include "cachestore/orders.h"
#include "cachestore/payload_files.h"
#include "cachestore/planner.h"
#include "cachestore/quota.h"
#include "cachestore/stable_map.h"
#include "kvtier/v1/tensor.pb.h"

namespace rocksdb {
class DB;
class Env;
class WriteBatch;
}  // namespace rocksdb

namespace kvtier::cachestore {

enum class SegmentState { kWriting, kSealed, kSpilled, kDropped };
enum class Tier { kRam, kDisk };

const char* SegmentStateName(SegmentState s);

struct StoreOptions {
  // RocksDB directory. Created if missing. Required.
  std::string path;
  // Bytes of segment payload the RAM tier may hold. Pinned sessions may push
  // it over. Default: 1 GiB.
  uint64_t ram_budget_bytes = uint64_t{1} << 30;
  // Bytes of segment payload the RocksDB tier may hold; 0 = unlimited. Under
  // pressure, never-recalled rounds are dropped first. Default: 0.
  uint64_t disk_budget_bytes = 0;
  // Which RAM-resident segments to spill first. Default: kCounter.
  SpillPolicy spill_policy = SpillPolicy::kCounter;
  // fsync the WAL before acknowledging a write. Default: true.
  bool sync_writes = true;
  // A spilled segment read this many times from disk is promoted back into
  // RAM. 0 = never promote. Default: 2.
  uint32_t promote_after_disk_reads = 2;
  // Payloads up to this size are stored inside RocksDB; larger ones go to
  // payload files beside it (cachestore/payload_files.h). Default: 256 KiB.
  uint64_t inline_payload_max_bytes = uint64_t{256} << 10;
  // Empty payload files kept ready, so that a put does not wait for a new
  // file's directory entry to become durable (cachestore/payload_files.h).
  // 0 = none. Default: 32.
  uint32_t spare_payload_files = 32;
  // Bytes of dropped segments' payload files kept to be overwritten in place
  // by later puts (faster than a new file: no inode, no allocation, data-only
  // fdatasync). Beyond disk_budget_bytes. Without sync_writes, a reuse first
  // syncs the WAL once for the files released before it. 0 = none.
  // Default: 1 GiB.
  uint64_t recycle_payload_bytes = uint64_t{1} << 30;
  // Largest accepted segment payload. Default: 256 MiB.
  uint64_t max_segment_bytes = uint64_t{256} << 20;
  // TTL of a session without its own (after its last access); 0 = such
  // sessions never expire. Default: 7 days, so that sessions nobody closes
  // (a client or worker that died) do not stay forever.
  uint32_t default_ttl_seconds = 7 * 24 * 3600;
  // Time source. Default: the real clock. Not owned.
  Clock* clock = Clock::Real();
  // RocksDB environment (tests inject a failing one). Default: nullptr, the
  // default Env. Not owned.
  rocksdb::Env* env = nullptr;
};

struct SegmentId {
  uint32_t round = 0;
  uint32_t segment = 0;
  friend bool operator==(const SegmentId&, const SegmentId&) = default;
};

// Everything a caller may know about a stored segment, without its bytes.
struct SegmentInfo {
  SegmentId id;
  uint32_t layer_begin = 0;
  uint32_t layer_end = 0;
  uint64_t payload_bytes = 0;
  uint32_t payload_crc32c = 0;
  SegmentState state = SegmentState::kWriting;
  uint64_t recall_count = 0;
};

struct RoundInfo {
  uint32_t round = 0;
  v1::RoundSummary summary;  // Store-filled fields set.
  std::vector<SegmentInfo> segments;
};

struct SessionInfo {
  bool pinned = false;
  uint32_t ttl_seconds = 0;
  std::vector<RoundInfo> rounds;  // Ascending; writing segments omitted.
};

// What a write declares before its bytes arrive.
struct WriteSpec {
  std::string tenant;
  std::string session;
  SegmentId id;
  uint32_t layer_begin = 0;
  uint32_t layer_end = 0;
  uint64_t payload_bytes = 0;
  uint32_t payload_crc32c = 0;
  bool has_round_summary = false;
  v1::RoundSummary round_summary;
  // Unset: the store's default_ttl_seconds; 0: never expires.
  std::optional<uint32_t> session_ttl_seconds;
};

struct ReadResult {
  SegmentInfo info;
  std::shared_ptr<const std::string> payload;
  Tier served_from = Tier::kRam;
};

struct StoreStats {
  uint64_t ram_bytes = 0;
  uint64_t ram_segments = 0;
  uint64_t disk_bytes = 0;
  uint64_t disk_segments = 0;
  uint64_t ram_budget_bytes = 0;
  uint64_t disk_budget_bytes = 0;
  uint64_t sessions = 0;
  uint64_t hits_ram = 0;
  uint64_t hits_disk = 0;
  uint64_t spills = 0;
  uint64_t promotions = 0;
  uint64_t drops = 0;           // Rounds dropped (explicit and under pressure).
  uint64_t pressure_drops = 0;  // For disk room (the disk budget).
  uint64_t cold_drops = 0;      // Under memory pressure (DropColdRounds).
  uint64_t segment_drops = 0;   // Single segments (DropSegments).
  uint64_t expired_sessions = 0;
  uint64_t spare_payload_files = 0;     // Empty payload files ready now.
  uint64_t spare_misses = 0;            // Payload files created on a put (none ready).
  uint64_t recycled_payload_files = 0;  // Dropped segments' files kept for reuse.
  uint64_t recycled_payload_bytes = 0;
  uint64_t recycle_hits = 0;  // Puts that overwrote a recycled file.
};

class Store;

// An upload in progress: reserved quota and disk room, and the index entry in
// kWriting state. Move-only; destroyed without Commit it aborts the write and
// refunds everything.
class WriteTicket {
 public:
  WriteTicket() = default;
  WriteTicket(WriteTicket&&) noexcept;
  WriteTicket& operator=(WriteTicket&&) noexcept;
  ~WriteTicket();
  const WriteSpec& spec() const { return spec_; }
  bool valid() const { return store_ != nullptr; }

 private:
  friend class Store;
  Store* store_ = nullptr;
  WriteSpec spec_;
  uint64_t write_id_ = 0;
  QuotaGrant grant_;
  bool to_file_ = false;  // The payload goes to a file of its own.
  uint64_t file_id_ = 0;  // That file's id, once started.
  // The file, once WriteChunk has started it; removed unless committed.
  std::unique_ptr<PayloadFiles::Writer> writer_;
};

// Thread-safe. All methods may be called concurrently. RocksDB I/O runs
// outside mu_; mu_ guards the index only.
//
// Cost: a put, a read, a spill, a promotion and a drop for disk room take
// O(log n) in the n stored segments (plus O(k log n) for k segments spilled
// or rounds dropped): RAM-resident segments are kept in spill order and
// droppable rounds in drop order as they change (cachestore/orders.h), and
// sessions by last access and by TTL deadline, so expiry and cold drops
// visit only the sessions they act on. ListSessions walks every session.
//
// Calls that remove or
// recreate keys are ordered by removal_mu_ (see below), so a delete applied late can never hit a
// newer write of the same key.
class Store {
 public:
  // Opens (or creates) the store at options.path and rebuilds the index from
  // RocksDB: every segment found comes back kSpilled with its counters, and
  // each tenant's usage is charged to `quotas`. `quotas` is not owned and must
  // outlive the store. Returns INVALID_ARGUMENT for bad options, INTERNAL
  // when RocksDB cannot open.
  static absl::StatusOr<std::unique_ptr<Store>> Open(StoreOptions options, QuotaManager* quotas);
  ~Store();

  // Phase one of a write. Returns a ticket, or:
  //   INVALID_ARGUMENT    bad names, layer range, segment or round number.
  //   OUT_OF_RANGE        payload_bytes is 0 or over max_segment_bytes.
  //   ALREADY_EXISTS      that segment exists or is being written.
  //   RESOURCE_EXHAUSTED  over the tenant quota, or the disk budget cannot
  //                       make room even by dropping every droppable round.
  absl::StatusOr<WriteTicket> BeginWrite(const WriteSpec& spec);
  // BeginWrite for a thread that must not wait (a gRPC callback thread):
  // nullopt, with nothing changed, where BeginWrite would wait on another
  // call's removals (removal_mu_ held) or would drop rounds to make disk
  // room; else BeginWrite's answer.
  std::optional<absl::StatusOr<WriteTicket>> TryBeginWrite(const WriteSpec& spec);

  // Optional, between BeginWrite and CommitWrite: the payload's next bytes,
  // as they arrive. A payload stored in a file of its own (over
  // inline_payload_max_bytes) is written as it comes, with its writeback
  // started, so that CommitWrite waits only for the tail; an inline one is
  // left to CommitWrite. The chunks must be a prefix of the payload later
  // given to CommitWrite (which writes whatever was not streamed). One
  // caller per ticket at a time. OUT_OF_RANGE past payload_bytes; INTERNAL
  // on I/O errors (the upload should then be abandoned).
  absl::Status WriteChunk(WriteTicket& ticket, std::string_view bytes);

  // Phase two: checks the bytes, makes them durable, seals the segment.
  // Returns its info, or:
  //   OUT_OF_RANGE      payload size differs from the declared payload_bytes.
  //   DATA_LOSS         the payload's crc32c or a tensor's crc32c is wrong.
  //   INVALID_ARGUMENT  the payload is not a valid SegmentPayload.
  //   ABORTED           the session was deleted meanwhile.
  //   INTERNAL          RocksDB failed.
  // On any error nothing is stored and the reservation is refunded.
  // `computed_crc32c`, when set, is the caller's CRC-32C of exactly these
  // bytes (computed as they arrived), which spares a pass over them.
  // `defer_sync` (with sync_writes): the RocksDB write is not synced here,
  // so the segment is readable at once but durable only after SyncWrites;
  // a caller that commits several segments syncs them all with one call
  // before it acknowledges any (PutSegments). Payload files are synced as
  // always, before their record.
  absl::StatusOr<SegmentInfo> CommitWrite(WriteTicket ticket, std::string payload,
                                          std::optional<uint32_t> computed_crc32c = {},
                                          bool defer_sync = false);
  // CommitWrite for a thread that must not wait. It declines (nullopt;
  // `ticket` and `payload` untouched, nothing changed) unless the commit is
  // one RocksDB write without fsync (sync_writes off, an inline payload)
  // that records no new session or round summary, and when RocksDB would
  // stall that write (WriteOptions::no_slowdown). Otherwise it consumes
  // both and returns CommitWrite's answer.
  // With `defer_sync`, sync_writes does not make it decline.
  std::optional<absl::StatusOr<SegmentInfo>> TryCommitWrite(
      WriteTicket& ticket, std::string& payload, std::optional<uint32_t> computed_crc32c = {},
      bool defer_sync = false);
  // Makes every write committed so far durable (a WAL sync): what commits
  // with `defer_sync` wait for. Concurrent callers share syncs: one whose
  // writes completed before a sync began waits for that sync instead of
  // running its own. OK at once without sync_writes; INTERNAL when RocksDB
  // fails.
  absl::Status SyncWrites();

  // Checks that every id exists and is readable, bumps each distinct
  // round's recall counter once (unless `count_recalls` is false: a copy
  // for repair, not a use), and returns their infos in order. NOT_FOUND
  // if the session or any segment is missing; INVALID_ARGUMENT on bad names;
  // OUT_OF_RANGE (nothing counted) when the payloads together pass
  // `max_bytes`. With `missing`, a segment that is not stored is marked
  // there (one flag per id; its info left default, nothing counted for it)
  // instead of failing the call; the session must still exist.
  absl::StatusOr<std::vector<SegmentInfo>> PrepareRead(
      const std::string& tenant, const std::string& session, const std::vector<SegmentId>& ids,
      uint64_t max_bytes = std::numeric_limits<uint64_t>::max(), bool count_recalls = true,
      std::vector<bool>* missing = nullptr);

  // Returns one segment's bytes from RAM or RocksDB, promoting it when hot.
  // NOT_FOUND when it is gone; DATA_LOSS when the stored bytes fail their
  // checksum; INTERNAL on RocksDB errors.
  absl::StatusOr<ReadResult> ReadSegment(const std::string& tenant, const std::string& session,
                                         SegmentId id);
  // ReadSegment for a thread that must not wait: the segment when it is in
  // RAM, NOT_FOUND when it is gone; nullopt (nothing counted) when it would
  // be read from disk.
  std::optional<absl::StatusOr<ReadResult>> TryReadSegment(const std::string& tenant,
                                                           const std::string& session,
                                                           SegmentId id);

  // NOT_FOUND for an unknown session.
  absl::StatusOr<SessionInfo> ListRounds(const std::string& tenant, const std::string& session);

  struct DropResult {
    std::vector<uint32_t> dropped;
    std::vector<uint32_t> not_found;
    uint64_t freed_bytes = 0;
  };
  // NOT_FOUND for an unknown session. Rounds with a segment being written
  // are dropped once the write finishes (it is aborted).
  absl::StatusOr<DropResult> DropRounds(const std::string& tenant, const std::string& session,
                                        const std::vector<uint32_t>& rounds);

  struct SegmentDropResult {
    std::vector<SegmentId> dropped;
    std::vector<SegmentId> not_found;
    uint64_t freed_bytes = 0;
  };
  // Drops single segments, keeping their rounds' other segments and
  // summaries; a round whose last segment goes is dropped whole. A segment
  // being written is aborted (its write finishes with ABORTED) and reported
  // dropped. NOT_FOUND for an unknown session; INVALID_ARGUMENT for a round
  // outside [0, 2^31) or a segment outside [0, kMaxSegmentsPerRound).
  absl::StatusOr<SegmentDropResult> DropSegments(const std::string& tenant,
                                                 const std::string& session,
                                                 const std::vector<SegmentId>& segments);

  struct ColdDropResult {
    uint32_t sessions = 0;  // Sessions that lost rounds.
    uint32_t rounds = 0;
    uint64_t freed_bytes = 0;
  };
  // Memory pressure (the controller's HIGH level): drops every round never
  // recalled (recall counter 0) of each unpinned session idle at least
  // `min_idle_ms`, except the session's newest round, which its next answer
  // is the likeliest to recall. Rounds with a segment being written stay.
  // INTERNAL on RocksDB errors.
  absl::StatusOr<ColdDropResult> DropColdRounds(int64_t min_idle_ms);

  struct RecallResult {
    std::vector<uint32_t> counted;
    std::vector<uint32_t> not_found;
  };
  // Bumps the recall counter of each listed round (a round listed twice
  // counts twice), as GetSegments does, for recalls served without a fetch
  // (a worker's resident rounds). Segment fetch counts are untouched. NOT_FOUND for an unknown
  // session, INVALID_ARGUMENT on bad names.
  absl::StatusOr<RecallResult> RecordRecalls(const std::string& tenant, const std::string& session,
                                             const std::vector<uint32_t>& rounds);

  struct ChainResult {
    uint32_t found = 0;        // sessions[0, found) are stored.
    uint64_t found_bytes = 0;  // Their readable segments' bytes.
  };
  // The prefix lookup of a chain of content-addressed blocks (one session
  // each): walks `sessions` in order, stopping at the first unknown session
  // or one without a readable segment. The ones found count as accessed
  // (idle time and TTL restart). INVALID_ARGUMENT on a bad name (nothing
  // touched). Thread-safe.
  absl::StatusOr<ChainResult> LookupChain(const std::string& tenant,
                                          const std::vector<std::string>& sessions);

  // NOT_FOUND for an unknown session.
  absl::StatusOr<DropResult> DeleteSession(const std::string& tenant, const std::string& session);

  // Pins or unpins an existing session: a pinned one never expires and is
  // never dropped for disk room; it still counts against quota and the RAM
  // budget, and spills after every unpinned segment. NOT_FOUND for an
  // unknown session; INVALID_ARGUMENT on bad names; INTERNAL on RocksDB
  // errors.
  absl::Status PinSession(const std::string& tenant, const std::string& session, bool pinned);

  struct SessionSummary {
    std::string session;
    int64_t idle_ms = 0;
    uint32_t rounds = 0;
    uint64_t bytes = 0;
    bool pinned = false;
    uint32_t ttl_seconds = 0;
  };
  struct SessionPage {
    std::vector<SessionSummary> sessions;
    // Set when more of the tenant's sessions may follow: the next page's
    // start_after.
    std::string next_start_after;
  };
  // Names a page looks at beyond its `limit`, at most.
  static constexpr size_t kListScanNames = 10000;
  // Up to `limit` of the tenant's sessions idle for at least `min_idle_ms`,
  // ascending by name, after `start_after`. A page walks the tenant's
  // sessions in name order from there and stops after `limit` results or
  // `limit + scan_names` names looked at, whichever comes first, so that
  // its cost (under the store's lock) does not grow with the sessions
  // stored; a page cut short by the scan may hold fewer than `limit`
  // sessions, with next_start_after set.
  SessionPage ListSessions(const std::string& tenant, int64_t min_idle_ms, size_t limit,
                           const std::string& start_after,
                           size_t scan_names = kListScanNames) const;

  // Deletes every unpinned session idle for longer than its TTL. Returns how
  // many were deleted.
  absl::StatusOr<int> ExpireSessions();

  StoreStats Stats() const;
  // Waits until exactly `n` empty payload files are ready (the spare thread
  // refills them on its own schedule): true, or false after `timeout`. For
  // tests.
  bool WaitForSparePayloadFiles(uint64_t n, absl::Duration timeout) const;
  // Checks the ordered indexes against a walk of every entry: the spill and
  // drop orders list exactly the candidates PlanSpill and PlanDrop would
  // choose from, in their order, and the session time indexes and tenant
  // counts match. O(n log n); for tests. INTERNAL names the first mismatch.
  absl::Status CheckIndex() const;
  // Bytes RocksDB holds in memory: memtables, table readers (index and
  // filter blocks) and block cache. What the store's own index costs is the
  // process heap less this and the RAM tier.
  uint64_t DbMemoryBytes() const;
  // Whether RocksDB has a flush or a compaction running or waiting (for
  // benchmarks that time reads once the writes' background work is done).
  bool DbBusy() const;
  // Sessions of one tenant.
  uint64_t TenantSessions(const std::string& tenant) const;
  const StoreOptions& options() const { return options_; }

 private:
  struct SessionEntry;
  // In spill_order_[pinned] iff info.state is kSealed, under the key
  // SpillKeyOf gives; changes to that key's fields are bracketed by
  // UnindexRoundLocked / IndexRoundLocked.
  struct SegmentEntry {
    SegmentInfo info;
    uint64_t write_id = 0;                   // Nonzero while kWriting.
    uint64_t file_id = 0;                    // Payload file, or 0 when the payload is inline.
    std::shared_ptr<const std::string> ram;  // Non-null iff kSealed.
    uint64_t insert_seq = 0;
    uint64_t last_access_seq = 0;
    uint32_t disk_reads = 0;
    bool cancelled = false;  // Set when deleted while kWriting.
  };
  // In drop_order_ iff its session is unpinned, it has segments and none
  // is being written (in_drop_order), under (recall_count, insert_seq)
  // with drop_bytes.
  struct RoundEntry {
    SessionEntry* session = nullptr;  // Owner.
    uint32_t number = 0;
    // Segments in kWriting (at most kMaxSegmentsPerRound). 16 bits so that
    // the flag shares its word: the entry stays 80 bytes, one 96-byte
    // allocation with its key.
    uint16_t writing = 0;
    bool in_drop_order = false;
    uint64_t drop_bytes = 0;
    StableMap<SegmentEntry, 2> segments;  // A round has two (lower, upper).
    // Null until a write brings one: most of the index's rounds are
    // recovered or summary-less, and the message is 72 bytes.
    std::unique_ptr<v1::RoundSummary> summary;
    uint64_t recall_count = 0;
    int64_t last_recall_ms = 0;
    uint64_t insert_seq = 0;
  };
  static_assert(sizeof(RoundEntry) <= 80 || sizeof(void*) != 8);
  struct SessionEntry {
    std::string tenant;
    std::string session;
    StableMap<RoundEntry, 0> rounds;
    bool pinned = false;
    uint32_t ttl_seconds = 0;
    int64_t last_access_ms = 0;  // Change through TouchSessionLocked.
    bool persisted = false;      // Its SessionRecord is in RocksDB.
    // Its key in by_deadline_, or -1 when it never expires.
    int64_t indexed_deadline_ms = -1;
  };
  // A planned removal of stored rounds, applied to RocksDB outside mu_.
  struct Removal {
    std::string session_key;
    std::string tenant;
    struct Segment {
      uint32_t segment;
      uint64_t file_id;
    };
    struct Round {
      uint32_t round;
      std::vector<Segment> segments;
      bool round_keys;  // Also delete the round's summary and counters.
    };
    std::vector<Round> rounds;
    bool whole_session = false;
  };

  friend class WriteTicket;
  Store(StoreOptions options, QuotaManager* quotas, std::unique_ptr<rocksdb::DB> db,
        std::unique_ptr<PayloadFiles> files);
  absl::Status Recover();
  void AbortWrite(const WriteSpec& spec, uint64_t write_id);
  // Segment `id` of session `key` when it can be read (not being written),
  // with its round in *round_out when asked; else null.
  SegmentEntry* FindReadableLocked(const std::string& key, SegmentId id,
                                   RoundEntry** round_out = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // BeginWrite's work once removal_mu_ is held. `may_make_room` false: sets
  // *declined instead of dropping rounds for disk room (into *removals).
  absl::StatusOr<WriteTicket> BeginWriteLocked(const WriteSpec& spec, bool may_make_room,
                                               std::vector<Removal>* removals, bool* declined)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(removal_mu_);
  // CommitWrite's work; consumes neither argument when it sets *declined
  // (only with `try_only`, see TryCommitWrite).
  absl::StatusOr<SegmentInfo> CommitWriteImpl(WriteTicket& ticket, std::string& payload,
                                              std::optional<uint32_t> computed_crc32c,
                                              bool try_only, bool defer_sync, bool* declined);
  // Creates the ticket's payload file unless WriteChunk already did.
  absl::Status StartPayloadFile(WriteTicket& ticket);

  // Recall counter records (RocksDB key, serialized record).
  using RecallWrites = std::vector<std::pair<std::string, std::string>>;
  // Bumps round `round`'s recall counter and adds its record to `counters`.
  void CountRecallLocked(const std::string& session_key, uint32_t round, RoundEntry& r,
                         int64_t now_ms, RecallWrites* counters) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counter records are advisory (no fsync; a failure is logged and only
  // undercounts), so a get does not wait on RocksDB for them: they are
  // queued, the latest per round, and written in batches by a background
  // thread every kRecallFlushInterval. FlushRecallCounters writes what is
  // queued now (RecordRecalls, the destructor).
  static constexpr absl::Duration kRecallFlushInterval = absl::Milliseconds(20);
  void QueueRecallCounters(RecallWrites counters);
  void FlushRecallCounters();
  void RecallCounterLoop();

  // Index mutations. REQUIRES: mu_ held.
  // Spills RAM copies in spill order until `bytes_needed` more fit in the
  // budget; the released copies go to `released`, to be freed after mu_.
  void SpillForRoomLocked(uint64_t bytes_needed,
                          std::vector<std::shared_ptr<const std::string>>* released)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static SpillKey SpillKeyOf(const SegmentEntry& e, const RoundEntry& r) {
    return {e.insert_seq, e.last_access_seq, r.recall_count};
  }
  // Take a round (its sealed segments and itself) out of the orders before
  // changing what their keys or membership read, and put it back after.
  void UnindexRoundLocked(SessionEntry& s, RoundEntry& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void IndexRoundLocked(SessionEntry& s, RoundEntry& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Creates a session entry and indexes it.
  SessionEntry& AddSessionLocked(const std::string& key, const std::string& tenant,
                                 const std::string& session, uint32_t ttl_seconds, int64_t now_ms)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseSessionLocked(const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets last_access_ms, or re-reads pinned and ttl_seconds when called
  // around their change (UnindexSessionTimesLocked first).
  void TouchSessionLocked(SessionEntry& s, int64_t now_ms) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnindexSessionTimesLocked(SessionEntry& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void IndexSessionTimesLocked(SessionEntry& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t RemoveRoundLocked(SessionEntry& s, uint32_t round, Removal* removal)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One segment of round `r` (taken out of the orders by the caller): a
  // sealed or spilled one leaves the index and the tier counters, is added
  // to `removed` and returns its bytes (the caller releases the quota); one
  // being written is marked cancelled (CommitWrite removes it), returns 0 and
  // stays. Returns the iterator past it.
  using SegmentIt = decltype(std::declval<RoundEntry&>().segments.begin());
  SegmentIt RemoveSegmentLocked(RoundEntry& r, SegmentIt it, Removal::Round* removed,
                                uint64_t* freed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes every round and marks the removal whole-session; erases the
  // entry unless uploads still run. Returns the freed bytes and the rounds.
  std::pair<uint64_t, std::vector<uint32_t>> RemoveSessionLocked(const std::string& key,
                                                                 Removal* removal)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status MakeDiskRoomLocked(uint64_t bytes, const std::string& skip_session_key,
                                  std::vector<Removal>* removals)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  SessionEntry* FindSessionLocked(const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Applies removals to RocksDB. REQUIRES: mu_ not held.
  absl::Status ApplyRemovals(const std::vector<Removal>& removals);
  absl::Status WriteSessionRecord(const std::string& session_key, bool pinned, uint32_t ttl);

  const StoreOptions options_;
  QuotaManager* const quotas_;
  std::unique_ptr<rocksdb::DB> db_;
  std::unique_ptr<PayloadFiles> files_;

  // SyncWrites' group commit: the RocksDB sequence number that the last
  // completed WAL sync covers, and whether one runs now. A caller whose
  // writes a sync covers (they completed before it began) shares its result.
  absl::Mutex sync_mu_;
  uint64_t synced_seq_ ABSL_GUARDED_BY(sync_mu_) = 0;
  bool syncing_ ABSL_GUARDED_BY(sync_mu_) = false;

  // Queued recall counter records. Lock order: mu_ or flush_mu_, then
  // counters_mu_; flush_mu_ is never taken under mu_. Records are queued
  // under mu_ with the count they hold; flush_mu_ is held by a flush from
  // taking the queue until its write is done, and by ApplyRemovals around
  // its delete, so that no counter record outlives its round.
  absl::Mutex flush_mu_ ABSL_ACQUIRED_BEFORE(counters_mu_);
  absl::Mutex counters_mu_ ABSL_ACQUIRED_AFTER(mu_);
  absl::flat_hash_map<std::string, std::string> pending_recalls_ ABSL_GUARDED_BY(counters_mu_);
  bool counters_stop_ ABSL_GUARDED_BY(counters_mu_) = false;
  std::thread recall_thread_;

  // Orders index removals with their RocksDB deletes against writes that
  // could recreate the same keys: held by BeginWrite, DropRounds,
  // DeleteSession, PinSession and ExpireSessions from their index change
  // until their RocksDB batch is applied. Lock order: removal_mu_, then mu_.
  absl::Mutex removal_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  // Node-based: the orders below hold pointers to entries.
  absl::node_hash_map<std::string, SessionEntry> sessions_ ABSL_GUARDED_BY(mu_);
  // [pinned]: unpinned segments spill before any pinned one.
  SpillOrder<SegmentEntry> spill_order_[2] ABSL_GUARDED_BY(mu_);
  DropOrder<RoundEntry> drop_order_ ABSL_GUARDED_BY(mu_);
  // Sessions by (last_access_ms) and, for those that can expire, by
  // (last_access_ms + ttl).
  absl::btree_set<std::pair<int64_t, SessionEntry*>> by_idle_ ABSL_GUARDED_BY(mu_);
  absl::btree_set<std::pair<int64_t, SessionEntry*>> by_deadline_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uint64_t> tenant_sessions_ ABSL_GUARDED_BY(mu_);
  // Sessions by (tenant, name), for ListSessions' pages; the views point
  // into the entries' own strings.
  absl::btree_map<std::pair<std::string_view, std::string_view>, SessionEntry*> by_name_
      ABSL_GUARDED_BY(mu_);
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t ram_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t ram_segments_ ABSL_GUARDED_BY(mu_) = 0;
  // Sealed + spilled segments, plus the disk room reserved by writes.
  uint64_t disk_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t disk_segments_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t disk_reserved_ ABSL_GUARDED_BY(mu_) = 0;
  StoreStats counters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier::cachestore

#endif  // KVTIER_CACHESTORE_STORE_H_
