// The store's write paths and payload files: the calls that must not wait
// (TryBeginWrite, TryCommitWrite, TryReadSegment), a failing disk under
// every kind of write, deferred and concurrent syncs, and payload files
// streamed, recycled, kept spare and recovered.
#include <atomic>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>

#include "cachestore/payload_files.h"
#include "cachestore/store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/crc32c.h"
#include "rocksdb/env.h"
#include "rocksdb/file_system.h"
#include "testing/test_util.h"
#include "tests/util/status_matchers.h"
#include "tests/util/store_fixture.h"

namespace kvtier::cachestore {
namespace {

using ::kvtier::testing::FailingFs;
using ::kvtier::testing::IsOk;
using ::kvtier::testing::MakePayload;
using ::kvtier::testing::StatusIs;
using ::kvtier::testing::TempDir;
using ::testing::ElementsAre;
using Code = absl::StatusCode;

TEST_F(StoreTest, TryBeginWriteDeclinesOnlyWhereDiskRoomIsToBeMade) {
  options_.disk_budget_bytes = 3 * 1100;
  Open();
  for (int i = 0; i < 3; ++i) ASSERT_THAT(Put("s", i, 0, MakePayload(1000, i)), IsOk());
  const std::string p = MakePayload(1000, 3);
  EXPECT_FALSE(store_->TryBeginWrite(Spec("s", 3, 0, p)).has_value());
  EXPECT_EQ(store_->Stats().pressure_drops, 0u);
  EXPECT_EQ(quota_manager_->Usage("t1").used_bytes, 3 * p.size());
  KVT_ASSERT_OK_AND_ASSIGN(WriteTicket t, store_->BeginWrite(Spec("s", 3, 0, p)));
  EXPECT_EQ(store_->Stats().pressure_drops, 1u);
  ASSERT_THAT(store_->CommitWrite(std::move(t), p), IsOk());
  // Room enough: a ticket; and BeginWrite's errors come through as they are.
  options_.disk_budget_bytes = 0;
  Open();
  std::optional<absl::StatusOr<WriteTicket>> fresh =
      store_->TryBeginWrite(Spec("s", 4, 0, MakePayload(10, 4)));
  ASSERT_TRUE(fresh.has_value());
  EXPECT_THAT(*fresh, IsOk());
  std::optional<absl::StatusOr<WriteTicket>> dup = store_->TryBeginWrite(Spec("s", 3, 0, p));
  ASSERT_TRUE(dup.has_value());
  EXPECT_THAT(*dup, StatusIs(Code::kAlreadyExists));
}

TEST_F(StoreTest, TryCommitWriteCommitsPlainWritesAndDeclinesTheRest) {
  options_.inline_payload_max_bytes = 2000;
  Open();
  ASSERT_THAT(Put("s", 0, 0, MakePayload(1000, 1)), IsOk());
  // A further segment of a stored session and round: committed here. (Spec
  // gives segment 0 layers [0, 3), the others [3, 8).)
  const std::string p = MakePayload(1000, 2, 3), p0 = MakePayload(1000, 2);
  KVT_ASSERT_OK_AND_ASSIGN(WriteTicket t, store_->BeginWrite(Spec("s", 0, 1, p)));
  std::string payload = p;
  std::optional<absl::StatusOr<SegmentInfo>> done = store_->TryCommitWrite(t, payload);
  ASSERT_TRUE(done.has_value());
  ASSERT_THAT(*done, IsOk());
  EXPECT_EQ((*done)->state, SegmentState::kSealed);
  EXPECT_FALSE(t.valid());
  EXPECT_EQ(Get("s", 0, 1), p);

  // Declined, with ticket and payload intact for CommitWrite: a new session
  // (its record), a new round's summary, a payload file of its own.
  auto declined_then_committed = [&](WriteSpec spec, const std::string& bytes) {
    SCOPED_TRACE(spec.session + " round " + std::to_string(spec.id.round));
    KVT_ASSERT_OK_AND_ASSIGN(WriteTicket w, store_->BeginWrite(spec));
    std::string copy = bytes;
    EXPECT_FALSE(store_->TryCommitWrite(w, copy).has_value());
    EXPECT_TRUE(w.valid());
    EXPECT_EQ(copy, bytes);
    EXPECT_THAT(store_->CommitWrite(std::move(w), copy), IsOk());
    EXPECT_EQ(Get(spec.session, spec.id.round, spec.id.segment), bytes);
  };
  declined_then_committed(Spec("new", 0, 0, p0), p0);
  WriteSpec summary = Spec("s", 1, 0, p0);
  summary.has_round_summary = true;
  summary.round_summary.set_token_end(7);
  declined_then_committed(summary, p0);
  const std::string big = MakePayload(5000, 3);
  declined_then_committed(Spec("s", 2, 0, big), big);

  // Errors come through, and the write is abandoned (its quota refunded).
  const uint64_t used = quota_manager_->Usage("t1").used_bytes;
  KVT_ASSERT_OK_AND_ASSIGN(WriteTicket bad, store_->BeginWrite(Spec("s", 0, 2, p)));
  std::string wrong = MakePayload(1000, 9, 3);
  std::optional<absl::StatusOr<SegmentInfo>> lost = store_->TryCommitWrite(bad, wrong);
  ASSERT_TRUE(lost.has_value());
  EXPECT_THAT(*lost, StatusIs(Code::kDataLoss));
  EXPECT_FALSE(bad.valid());
  EXPECT_EQ(quota_manager_->Usage("t1").used_bytes, used);
  KVT_ASSERT_OK_AND_ASSIGN(WriteTicket gone, store_->BeginWrite(Spec("s", 0, 3, p)));
  ASSERT_THAT(store_->DeleteSession("t1", "s"), IsOk());
  std::string copy = p;
  std::optional<absl::StatusOr<SegmentInfo>> aborted = store_->TryCommitWrite(gone, copy);
  ASSERT_TRUE(aborted.has_value());
  EXPECT_THAT(*aborted, StatusIs(Code::kAborted));

  // With fsync, every commit waits on the disk: always declined.
  options_.sync_writes = true;
  Open();
  ASSERT_THAT(Put("f", 0, 0, p0), IsOk());
  KVT_ASSERT_OK_AND_ASSIGN(WriteTicket synced, store_->BeginWrite(Spec("f", 0, 1, p)));
  copy = p;
  EXPECT_FALSE(store_->TryCommitWrite(synced, copy).has_value());
  EXPECT_THAT(store_->CommitWrite(std::move(synced), copy), IsOk());
}

TEST_F(StoreTest, TryReadSegmentServesRamAndDeclinesDisk) {
  options_.ram_budget_bytes = 1500;
  Open();
  const std::string small = MakePayload(1000, 1), big = MakePayload(2000, 2);
  ASSERT_THAT(Put("s", 0, 0, small), IsOk());
  ASSERT_THAT(Put("s", 1, 0, big), IsOk());  // Over the RAM budget: on disk only.
  std::optional<absl::StatusOr<ReadResult>> ram = store_->TryReadSegment("t1", "s", {0, 0});
  ASSERT_TRUE(ram.has_value());
  ASSERT_THAT(*ram, IsOk());
  EXPECT_EQ(*(*ram)->payload, small);
  EXPECT_EQ((*ram)->served_from, Tier::kRam);
  EXPECT_FALSE(store_->TryReadSegment("t1", "s", {1, 0}).has_value());
  std::optional<absl::StatusOr<ReadResult>> gone = store_->TryReadSegment("t1", "s", {2, 0});
  ASSERT_TRUE(gone.has_value());
  EXPECT_THAT(*gone, StatusIs(Code::kNotFound));
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.hits_ram, 1u);
  EXPECT_EQ(st.hits_disk, 0u);  // The declined read counted nothing.
  EXPECT_EQ(Get("s", 1, 0), big);
  EXPECT_EQ(store_->Stats().hits_disk, 1u);
}

TEST_F(StoreTest, PrepareReadChecksEveryRefFirst) {
  Open();
  ASSERT_THAT(Put("s", 0, 0, MakePayload(100, 1)), IsOk());
  EXPECT_THAT(store_->PrepareRead("t1", "s", {{0, 0}, {5, 0}}), StatusIs(Code::kNotFound));
  KVT_ASSERT_OK_AND_ASSIGN(SessionInfo info, store_->ListRounds("t1", "s"));
  EXPECT_EQ(info.rounds[0].summary.recall_count(), 0u);  // The failed call counted nothing.
  // With `missing`: the absent segment is marked in its place, the present
  // one counted; an unknown session is still NOT_FOUND.
  std::vector<bool> missing;
  KVT_ASSERT_OK_AND_ASSIGN(
      std::vector<SegmentInfo> infos,
      store_->PrepareRead("t1", "s", {{5, 0}, {0, 0}, {0, 1}}, UINT64_MAX, true, &missing));
  EXPECT_EQ(missing, (std::vector<bool>{true, false, true}));
  ASSERT_EQ(infos.size(), 3u);
  EXPECT_EQ(infos[1].id, (SegmentId{0, 0}));
  EXPECT_EQ(infos[1].payload_bytes, MakePayload(100, 1).size());
  KVT_ASSERT_OK_AND_ASSIGN(info, store_->ListRounds("t1", "s"));
  EXPECT_EQ(info.rounds.size(), 1u);  // No round was made for the absent ones.
  EXPECT_EQ(info.rounds[0].summary.recall_count(), 1u);
  EXPECT_THAT(store_->PrepareRead("t1", "nobody", {{0, 0}}, UINT64_MAX, true, &missing),
              StatusIs(Code::kNotFound));
}

TEST_F(StoreTest, FailingDiskRejectsTheWriteAndChangesNothing) {
  std::shared_ptr<FailingFs> fs = UseFailingDisk();
  Open();
  quota_manager_->SetQuota("t1", 1 << 20);
  std::string p = MakePayload(2000, 1);
  ASSERT_THAT(Put("s", 0, 0, p), IsOk());
  const StoreStats before = store_->Stats();
  fs->fail = true;
  EXPECT_THAT(Put("s", 1, 0, MakePayload(2000, 2)), StatusIs(Code::kInternal));
  StoreStats after = store_->Stats();
  EXPECT_EQ(after.disk_segments, before.disk_segments);
  EXPECT_EQ(after.disk_bytes, before.disk_bytes);
  EXPECT_EQ(quota_manager_->Usage("t1").used_bytes, p.size());
  EXPECT_EQ(quota_manager_->Usage("t1").reserved_bytes, 0u);
  KVT_ASSERT_OK_AND_ASSIGN(SessionInfo info, store_->ListRounds("t1", "s"));
  EXPECT_EQ(info.rounds.size(), 1u);
  EXPECT_EQ(Get("s", 0, 0), p);  // What was stored is still served.
}

// PutSegments' group commit: with sync_writes, a deferred commit leaves the
// WAL unsynced (readable at once), and SyncWrites syncs it; a plain commit
// syncs on its own.
TEST_F(StoreTest, DeferredSyncCommitsAreDurableAfterSyncWrites) {
  std::shared_ptr<FailingFs> fs = UseFailingDisk();
  options_.sync_writes = true;
  Open();
  const std::string a = MakePayload(2000, 1), b = MakePayload(3000, 2), c = MakePayload(4000, 3);
  ASSERT_THAT(Put("s", 0, 0, a), IsOk());  // Records the session: its own sync.
  const int before = fs->wal_syncs.load();
  KVT_ASSERT_OK_AND_ASSIGN(WriteTicket tb, store_->BeginWrite(Spec("s", 1, 0, b)));
  ASSERT_THAT(store_->CommitWrite(std::move(tb), b, std::nullopt, /*defer_sync=*/true), IsOk());
  KVT_ASSERT_OK_AND_ASSIGN(WriteTicket tc, store_->BeginWrite(Spec("s", 2, 0, c)));
  std::string cp = c;
  auto tried = store_->TryCommitWrite(tc, cp, std::nullopt, /*defer_sync=*/true);
  ASSERT_TRUE(tried.has_value()) << "a deferred commit need not wait: it is not declined";
  ASSERT_THAT(*tried, IsOk());
  EXPECT_EQ(fs->wal_syncs.load(), before);
  EXPECT_EQ(Get("s", 1, 0), b);  // Readable before it is durable.
  EXPECT_EQ(Get("s", 2, 0), c);
  ASSERT_THAT(store_->SyncWrites(), IsOk());
  EXPECT_GT(fs->wal_syncs.load(), before);
  const int synced = fs->wal_syncs.load();
  // Nothing written since: the last sync covers it (no WAL sync of its own).
  ASSERT_THAT(store_->SyncWrites(), IsOk());
  EXPECT_EQ(fs->wal_syncs.load(), synced);
  ASSERT_THAT(Put("s", 3, 0, MakePayload(1000, 4)), IsOk());
  EXPECT_GT(fs->wal_syncs.load(), synced);
  // Without the deferral, TryCommitWrite declines a synced commit.
  KVT_ASSERT_OK_AND_ASSIGN(WriteTicket td, store_->BeginWrite(Spec("s", 4, 0, a)));
  std::string dp = a;
  EXPECT_FALSE(store_->TryCommitWrite(td, dp).has_value());
  // And the failing disk fails the sync.
  KVT_ASSERT_OK_AND_ASSIGN(WriteTicket te, store_->BeginWrite(Spec("s", 5, 0, b)));
  ASSERT_THAT(store_->CommitWrite(std::move(te), b, std::nullopt, /*defer_sync=*/true), IsOk());
  fs->fail = true;
  EXPECT_THAT(store_->SyncWrites(), StatusIs(Code::kInternal));
  fs->fail = false;
}

// SyncWrites from many threads at once (the group commit's waits): every
// call completes and succeeds, and no call runs more than one sync.
TEST_F(StoreTest, ConcurrentSyncWritesAllComplete) {
  std::shared_ptr<FailingFs> fs = UseFailingDisk();
  options_.sync_writes = true;
  Open();
  ASSERT_THAT(Put("s", 0, 0, MakePayload(1000, 1)), IsOk());
  constexpr int kThreads = 8, kRounds = 20;
  const int before = fs->wal_syncs.load();
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        const std::string p = MakePayload(500 + t, 100 * t + r);
        const uint32_t round = 1 + t * kRounds + r;
        auto ticket = store_->BeginWrite(Spec("s", round, 0, p));
        if (!ticket.ok() ||
            !store_->CommitWrite(*std::move(ticket), p, std::nullopt, /*defer_sync=*/true).ok() ||
            !store_->SyncWrites().ok()) {
          ++failures;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  // At most one sync a call (fewer where calls overlapped).
  EXPECT_LE(fs->wal_syncs.load() - before, kThreads * kRounds);
  EXPECT_GT(fs->wal_syncs.load(), before);
  KVT_ASSERT_OK_AND_ASSIGN(SessionInfo info, store_->ListRounds("t1", "s"));
  EXPECT_EQ(info.rounds.size(), 1u + kThreads * kRounds);
}

// Payload files that hold bytes (spares are empty).
int CountPayloadFiles(const std::string& db, bool spares_too = false) {
  int n = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(db + "/payloads")) {
    n += e.is_regular_file() && (spares_too || e.file_size() > 0) ? 1 : 0;
  }
  return n;
}

// A dropped segment's file is kept and overwritten in place by a later put
// that fits; the overwritten file serves the new segment after a restart;
// crash leftovers are kept for reuse up to the cap.
TEST_F(StoreTest, DroppedPayloadFilesAreRecycled) {
  options_.inline_payload_max_bytes = 1000;
  options_.sync_writes = true;
  options_.spare_payload_files = 0;
  options_.recycle_payload_bytes = 12'000;
  Open();
  const std::string first = MakePayload(5000, 1);
  ASSERT_THAT(Put("s", 0, 0, first), IsOk());
  ASSERT_THAT(Put("s", 1, 0, MakePayload(9000, 2)), IsOk());
  ASSERT_THAT(store_->DropRounds("t1", "s", {0, 1}), IsOk());
  // The first fits under the cap, then the second does not: deleted.
  EXPECT_EQ(store_->Stats().recycled_payload_files, 1u);
  EXPECT_EQ(store_->Stats().recycled_payload_bytes, first.size());
  EXPECT_EQ(CountPayloadFiles(options_.path, true), 1);
  const std::string smaller = MakePayload(4000, 3);
  ASSERT_THAT(Put("s", 2, 0, smaller), IsOk());
  EXPECT_EQ(store_->Stats().recycle_hits, 1u);
  EXPECT_EQ(store_->Stats().recycled_payload_files, 0u);
  EXPECT_EQ(CountPayloadFiles(options_.path, true), 1);  // The same file, overwritten.
  for (const auto& e : std::filesystem::recursive_directory_iterator(options_.path + "/payloads")) {
    if (e.is_regular_file()) {
      EXPECT_EQ(e.file_size(), smaller.size());  // Overwritten in place and cut to size.
    }
  }
  const std::string larger = MakePayload(6000, 4);
  ASSERT_THAT(Put("s", 3, 0, larger), IsOk());  // Nothing fits: a new file.
  EXPECT_EQ(store_->Stats().recycle_hits, 1u);
  Open();
  EXPECT_EQ(Get("s", 2, 0), smaller);
  EXPECT_EQ(Get("s", 3, 0), larger);
  // A crash leftover (an upload that never committed) is kept for reuse.
  store_.reset();
  std::ofstream(options_.path + "/payloads/77/0000000000000777.seg") << std::string(3000, 'x');
  Open();
  EXPECT_EQ(store_->Stats().recycled_payload_files, 1u);
  ASSERT_THAT(Put("s", 4, 0, MakePayload(2000, 5)), IsOk());
  EXPECT_EQ(store_->Stats().recycle_hits, 1u);
  Open();
  EXPECT_EQ(Get("s", 4, 0), MakePayload(2000, 5));
  EXPECT_EQ(Get("s", 2, 0), smaller);
  // Without synchronous writes a released file waits for a WAL sync, which
  // the first put that could reuse it does.
  options_.sync_writes = false;
  Open();
  ASSERT_THAT(store_->DropRounds("t1", "s", {2}), IsOk());
  EXPECT_EQ(store_->Stats().recycled_payload_files, 1u);
  const std::string unsynced = MakePayload(3000, 6);
  ASSERT_THAT(Put("s", 5, 0, unsynced), IsOk());
  EXPECT_EQ(store_->Stats().recycle_hits, 1u);
  EXPECT_EQ(store_->Stats().recycled_payload_files, 0u);
  Open();
  EXPECT_EQ(Get("s", 5, 0), unsynced);
  EXPECT_THAT(store_->ReadSegment("t1", "s", {2, 0}), StatusIs(Code::kNotFound));
}

// Files of any size are recycled (they are written like new ones, with
// early writeback under sync_writes): a dropped 6 MiB segment's file takes a
// later 5 MiB put, cut to its size, and serves it after a restart.
TEST_F(StoreTest, LargePayloadFilesAreRecycledAndCutToSize) {
  options_.inline_payload_max_bytes = 1000;
  options_.sync_writes = true;
  options_.spare_payload_files = 0;
  options_.recycle_payload_bytes = uint64_t{64} << 20;
  Open();
  ASSERT_THAT(Put("s", 0, 0, MakePayload(6 << 20, 1)), IsOk());
  ASSERT_THAT(store_->DropRounds("t1", "s", {0}), IsOk());
  EXPECT_EQ(store_->Stats().recycled_payload_files, 1u);
  const std::string next = MakePayload(5 << 20, 2);
  ASSERT_THAT(Put("s", 1, 0, next), IsOk());
  EXPECT_EQ(store_->Stats().recycle_hits, 1u);
  EXPECT_EQ(CountPayloadFiles(options_.path, true), 1);
  for (const auto& e : std::filesystem::recursive_directory_iterator(options_.path + "/payloads")) {
    if (e.is_regular_file()) {
      EXPECT_EQ(e.file_size(), next.size());
    }
  }
  Open();
  EXPECT_EQ(Get("s", 1, 0), next);
}

TEST_F(StoreTest, FailingDiskUnderARecycledFileFailsThePut) {
  std::shared_ptr<FailingFs> fs = UseFailingDisk();
  options_.inline_payload_max_bytes = 1000;
  options_.sync_writes = true;
  options_.spare_payload_files = 0;
  Open();
  ASSERT_THAT(Put("s", 0, 0, MakePayload(5000, 1)), IsOk());
  ASSERT_THAT(store_->DropRounds("t1", "s", {0}), IsOk());
  ASSERT_EQ(store_->Stats().recycled_payload_files, 1u);
  fs->fail = true;
  EXPECT_THAT(Put("s", 1, 0, MakePayload(4000, 2)), StatusIs(Code::kInternal));
  fs->fail = false;
  EXPECT_EQ(store_->Stats().recycle_hits, 1u);
  EXPECT_EQ(store_->Stats().recycled_payload_files, 0u);  // A file that failed is not reused.
  EXPECT_EQ(CountPayloadFiles(options_.path, true), 0);
  KVT_ASSERT_OK_AND_ASSIGN(SessionInfo info, store_->ListRounds("t1", "s"));
  EXPECT_TRUE(info.rounds.empty());
  ASSERT_THAT(Put("s", 1, 0, MakePayload(4000, 2)), IsOk());
  EXPECT_EQ(Get("s", 1, 0), MakePayload(4000, 2));
}

// A file released while a read holds it is recycled only when the read ends.
TEST(PayloadFilesTest, ReadPinDefersRecycling) {
  TempDir dir;
  KVT_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<PayloadFiles> files,
      PayloadFiles::Open(rocksdb::FileSystem::Default().get(), dir.path(), 0, true, 1 << 20));
  ASSERT_THAT(files->Recover({}), IsOk());
  auto read = [&](uint64_t id, uint64_t n) {
    absl::StatusOr<std::string> r = files->Read(id, n);
    return r.ok() ? *r : r.status().ToString();
  };
  KVT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<PayloadFiles::Writer> w, files->NewWriter(true, 10));
  const uint64_t id = w->id();
  ASSERT_THAT(w->Append("0123456789"), IsOk());
  ASSERT_THAT(w->Finish(), IsOk());
  {
    PayloadFiles::ReadPin pin = files->PinForRead(id);
    ASSERT_THAT(files->Release(id), IsOk());
    EXPECT_EQ(files->recycled(), 0u);
    KVT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<PayloadFiles::Writer> other,
                             files->NewWriter(true, 4));
    EXPECT_NE(other->id(), id);  // Not handed out while read.
    EXPECT_EQ(read(id, 10), "0123456789");
  }
  EXPECT_EQ(files->recycled(), 1u);
  KVT_ASSERT_OK_AND_ASSIGN(w, files->NewWriter(true, 4));
  EXPECT_EQ(w->id(), id);
  ASSERT_THAT(w->Append("abcd"), IsOk());
  ASSERT_THAT(w->Finish(), IsOk());
  EXPECT_EQ(read(id, 4), "abcd");
  // Overwritten in place, then cut to the new payload's size.
  EXPECT_THAT(files->Read(id, 10),
              StatusIs(Code::kDataLoss, ::testing::HasSubstr("holds 4 bytes")));
}

// Waits (up to 10 s) until the store's spare thread has `n` files ready.
bool WaitForSpares(const Store& store, uint64_t n) {
  return store.WaitForSparePayloadFiles(n, absl::Seconds(10));
}

// A put takes an empty spare file instead of creating one (no directory
// entry to sync on its path); the spare thread refills the pool in batches;
// recovery keeps empty orphans as spares and deletes the rest.
TEST_F(StoreTest, SparePayloadFilesAreTakenRefilledAndAdopted) {
  options_.inline_payload_max_bytes = 1000;
  options_.sync_writes = true;
  options_.spare_payload_files = 4;
  Open();
  ASSERT_TRUE(WaitForSpares(*store_, 4));
  EXPECT_EQ(CountPayloadFiles(options_.path, true), 4);
  const std::string big = MakePayload(5000, 2);
  ASSERT_THAT(Put("s", 0, 0, big), IsOk());
  // One spare became the payload file; 3 left is above the refill mark (2).
  EXPECT_EQ(store_->Stats().spare_payload_files, 3u);
  EXPECT_EQ(store_->Stats().spare_misses, 0u);
  EXPECT_EQ(CountPayloadFiles(options_.path), 1);
  EXPECT_EQ(CountPayloadFiles(options_.path, true), 4);
  ASSERT_THAT(Put("s", 1, 0, MakePayload(5000, 3)), IsOk());  // 2 left: refilled to 4.
  ASSERT_TRUE(WaitForSpares(*store_, 4));
  EXPECT_EQ(CountPayloadFiles(options_.path, true), 6);

  // A clean close removes the spares; what a crash leaves is sorted out at
  // recovery: an empty orphan is kept as a spare, a partial one deleted.
  store_.reset();
  EXPECT_EQ(CountPayloadFiles(options_.path, true), 2);
  const std::string empty = options_.path + "/payloads/77/0000000000000777.seg";
  const std::string partial = options_.path + "/payloads/78/0000000000000778.seg";
  std::ofstream(empty).flush();
  std::ofstream(partial) << "partial";
  options_.spare_payload_files = 2;
  options_.recycle_payload_bytes = 0;
  Open();
  EXPECT_TRUE(std::filesystem::exists(empty));
  EXPECT_FALSE(std::filesystem::exists(partial));
  ASSERT_TRUE(WaitForSpares(*store_, 2));
  EXPECT_EQ(CountPayloadFiles(options_.path, true), 4);  // The adopted one and one new.
  EXPECT_EQ(Get("s", 0, 0), big);
  // Without a pool, empty orphans are deleted too, and puts create files.
  store_.reset();
  std::ofstream(empty).flush();
  options_.spare_payload_files = 0;
  Open();
  EXPECT_FALSE(std::filesystem::exists(empty));
  ASSERT_THAT(Put("s", 2, 0, MakePayload(5000, 4)), IsOk());
  EXPECT_EQ(store_->Stats().spare_misses, 0u);
  EXPECT_EQ(CountPayloadFiles(options_.path, true), 3);
  Open();
  EXPECT_EQ(Get("s", 2, 0), MakePayload(5000, 4));
  EXPECT_EQ(Get("s", 1, 0), MakePayload(5000, 3));
}

TEST_F(StoreTest, LargePayloadsLiveInFilesAndSurviveRecovery) {
  options_.inline_payload_max_bytes = 1000;
  options_.recycle_payload_bytes = 0;  // Files deleted, not kept (see below).
  Open();
  std::string small = MakePayload(800, 1), big = MakePayload(50'000, 2, 3);
  ASSERT_THAT(Put("s", 0, 0, small), IsOk());
  ASSERT_THAT(Put("s", 0, 1, big), IsOk());
  EXPECT_EQ(CountPayloadFiles(options_.path), 1);
  Open();
  Tier from;
  EXPECT_EQ(Get("s", 0, 1, &from), big);
  EXPECT_EQ(from, Tier::kDisk);
  EXPECT_EQ(Get("s", 0, 0), small);
  ASSERT_THAT(store_->DropRounds("t1", "s", {0}), IsOk());
  EXPECT_EQ(CountPayloadFiles(options_.path), 0);
}

TEST_F(StoreTest, RecoveryRemovesOrphanPayloadFiles) {
  options_.inline_payload_max_bytes = 1000;
  options_.recycle_payload_bytes = 0;  // Files deleted, not kept (see below).
  Open();
  std::string big = MakePayload(5000, 2);
  ASSERT_THAT(Put("s", 0, 0, big), IsOk());
  // A file whose upload crashed before its index record was written.
  std::ofstream(options_.path + "/payloads/77/0000000000000777.seg") << "partial";
  EXPECT_EQ(CountPayloadFiles(options_.path), 2);
  Open();
  EXPECT_EQ(CountPayloadFiles(options_.path), 1);
  EXPECT_EQ(Get("s", 0, 0), big);
  // New files never reuse an id that existed.
  ASSERT_THAT(Put("s", 1, 0, MakePayload(5000, 3)), IsOk());
  EXPECT_EQ(CountPayloadFiles(options_.path), 2);
}

// Issue 18: a payload in a file of its own is written as its chunks arrive
// (WriteChunk); CommitWrite writes only what was not streamed.
TEST_F(StoreTest, StreamedPayloadFilesCommitAbandonAndFinishTheRest) {
  options_.inline_payload_max_bytes = 1000;
  options_.sync_writes = true;  // The writeback path too.
  Open();
  const std::string big = MakePayload(50'000, 2);
  // Streamed whole, in uneven chunks.
  {
    KVT_ASSERT_OK_AND_ASSIGN(WriteTicket t, store_->BeginWrite(Spec("s", 0, 0, big)));
    for (size_t at = 0; at < big.size(); at += 7'001) {
      ASSERT_THAT(store_->WriteChunk(t, std::string_view(big).substr(at, 7'001)), IsOk());
    }
    EXPECT_EQ(CountPayloadFiles(options_.path), 1);  // Written before the commit.
    EXPECT_THAT(store_->WriteChunk(t, "x"), StatusIs(Code::kOutOfRange));
    ASSERT_THAT(store_->CommitWrite(std::move(t), big), IsOk());
  }
  // Streamed in part: the commit writes the rest.
  const std::string big2 = MakePayload(30'000, 3);
  {
    KVT_ASSERT_OK_AND_ASSIGN(WriteTicket t, store_->BeginWrite(Spec("s", 1, 0, big2)));
    ASSERT_THAT(store_->WriteChunk(t, std::string_view(big2).substr(0, 12'345)), IsOk());
    ASSERT_THAT(store_->CommitWrite(std::move(t), big2), IsOk());
  }
  // Streamed, then abandoned: its file goes with the ticket.
  {
    KVT_ASSERT_OK_AND_ASSIGN(WriteTicket t,
                             store_->BeginWrite(Spec("s", 2, 0, MakePayload(20'000, 4))));
    ASSERT_THAT(store_->WriteChunk(t, std::string(10'000, 'a')), IsOk());
    EXPECT_EQ(CountPayloadFiles(options_.path), 3);
  }
  EXPECT_EQ(CountPayloadFiles(options_.path), 2);
  // An inline payload is left to the commit.
  const std::string small = MakePayload(800, 5);
  {
    KVT_ASSERT_OK_AND_ASSIGN(WriteTicket t, store_->BeginWrite(Spec("s", 3, 0, small)));
    ASSERT_THAT(store_->WriteChunk(t, small), IsOk());
    ASSERT_THAT(store_->CommitWrite(std::move(t), small), IsOk());
  }
  EXPECT_EQ(CountPayloadFiles(options_.path), 2);
  Open();  // Durable, and read back from the files.
  EXPECT_EQ(Get("s", 0, 0), big);
  EXPECT_EQ(Get("s", 1, 0), big2);
  EXPECT_EQ(Get("s", 3, 0), small);
  EXPECT_THAT(store_->ListRounds("t1", "s"), IsOk());
  EXPECT_EQ(store_->Stats().disk_segments, 3u);
}

TEST_F(StoreTest, FailingDiskWhileStreamingFailsTheCommitAndLeavesNoFile) {
  std::shared_ptr<FailingFs> fs = UseFailingDisk();
  options_.inline_payload_max_bytes = 1000;
  Open();
  const std::string big = MakePayload(50'000, 2);
  KVT_ASSERT_OK_AND_ASSIGN(WriteTicket t, store_->BeginWrite(Spec("s", 0, 0, big)));
  ASSERT_THAT(store_->WriteChunk(t, std::string_view(big).substr(0, 10'000)), IsOk());
  fs->fail = true;
  EXPECT_THAT(store_->WriteChunk(t, std::string_view(big).substr(10'000, 10'000)),
              StatusIs(Code::kInternal));
  fs->fail = false;
  // The error sticks: the commit fails even though the disk is back.
  EXPECT_THAT(store_->CommitWrite(std::move(t), big), StatusIs(Code::kInternal));
  EXPECT_EQ(CountPayloadFiles(options_.path), 0);
  EXPECT_THAT(store_->ListRounds("t1", "s"), StatusIs(Code::kNotFound));
  EXPECT_EQ(quota_manager_->Usage("t1").reserved_bytes, 0u);
}

TEST_F(StoreTest, FailingDiskUnderPayloadFilesLeavesNoFile) {
  std::shared_ptr<FailingFs> fs = UseFailingDisk();
  options_.inline_payload_max_bytes = 1000;
  Open();
  fs->fail = true;
  EXPECT_THAT(Put("s", 0, 0, MakePayload(5000, 1)), StatusIs(Code::kInternal));
  fs->fail = false;
  EXPECT_EQ(CountPayloadFiles(options_.path), 0);
  EXPECT_THAT(store_->ListRounds("t1", "s"), StatusIs(Code::kNotFound));
  EXPECT_EQ(quota_manager_->Usage("t1").reserved_bytes, 0u);
  EXPECT_THAT(Put("s", 0, 0, MakePayload(5000, 1)), IsOk());
}

}  // namespace
}  // namespace kvtier::cachestore
