#include "cachestore/store.h"

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
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/crc32c.h"
#include "rocksdb/env.h"
#include "rocksdb/file_system.h"
#include "testing/test_util.h"
#include "tests/util/failing_fs.h"
#include "tests/util/status_matchers.h"

namespace kvtier::cachestore {
namespace {

using ::kvtier::testing::FailingFs;
using ::kvtier::testing::IsOk;
using ::kvtier::testing::MakePayload;
using ::kvtier::testing::StatusIs;
using ::kvtier::testing::TempDir;
using ::testing::ElementsAre;
using Code = absl::StatusCode;

class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    options_.path = dir_.path() + "/db";
    options_.clock = &clock_;
    options_.sync_writes = false;  // Unit tests; the crash test covers fsync.
  }

  // Opens (or reopens, like a restarted process) the store, with fresh
  // in-memory quota accounting.
  void Open() {
    store_.reset();
    quota_manager_ = std::make_unique<QuotaManager>();
    auto s = Store::Open(options_, quota_manager_.get());
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(s).value();
  }

  // Puts a disk that fails on demand under the store Open() opens next.
  std::shared_ptr<FailingFs> UseFailingDisk() {
    auto fs = std::make_shared<FailingFs>();
    env_ = rocksdb::NewCompositeEnv(fs);
    options_.env = env_.get();
    return fs;
  }

  WriteSpec Spec(const std::string& session, uint32_t round, uint32_t seg,
                 const std::string& payload, const std::string& tenant = "t1") {
    WriteSpec w;
    w.tenant = tenant;
    w.session = session;
    w.id = {round, seg};
    w.layer_begin = seg == 0 ? 0 : 3;
    w.layer_end = seg == 0 ? 3 : 8;
    w.payload_bytes = payload.size();
    w.payload_crc32c = Crc32c(payload);
    return w;
  }

  absl::StatusOr<SegmentInfo> Put(const std::string& session, uint32_t round, uint32_t seg,
                                  const std::string& payload, const std::string& tenant = "t1") {
    auto t = store_->BeginWrite(Spec(session, round, seg, payload, tenant));
    if (!t.ok()) return t.status();
    return store_->CommitWrite(std::move(t).value(), payload);
  }

  std::string Get(const std::string& session, uint32_t round, uint32_t seg, Tier* from = nullptr,
                  const std::string& tenant = "t1") {
    auto r = store_->ReadSegment(tenant, session, {round, seg});
    if (!r.ok()) return "error: " + r.status().ToString();
    if (from != nullptr) *from = r->served_from;
    return *r->payload;
  }

  TempDir dir_;
  FakeClock clock_;
  std::unique_ptr<QuotaManager> quota_manager_;
  std::unique_ptr<rocksdb::Env> env_;  // Outlives store_.
  StoreOptions options_;
  std::unique_ptr<Store> store_;
};

TEST_F(StoreTest, PutThenReadIsBitExact) {
  Open();
  std::string p0 = MakePayload(1000, 1), p1 = MakePayload(5000, 2, 3);
  ASSERT_THAT(Put("s", 0, 0, p0), IsOk());
  ASSERT_THAT(Put("s", 0, 1, p1), IsOk());
  EXPECT_EQ(Get("s", 0, 0), p0);
  EXPECT_EQ(Get("s", 0, 1), p1);
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.ram_segments, 2u);
  EXPECT_EQ(st.disk_segments, 2u);
  EXPECT_EQ(st.ram_bytes, p0.size() + p1.size());
  EXPECT_EQ(st.hits_ram, 2u);
}

// A second store on the same directory (a second kvtier-store on one
// --data_dir) is refused with a hint, not RocksDB's bare lock error.
TEST_F(StoreTest, ASecondStoreOnTheSameDirectoryIsRefusedWithAHint) {
  Open();
  QuotaManager other_quotas;
  auto second = Store::Open(options_, &other_quotas);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_NE(second.status().message().find("is in use"), std::string::npos) << second.status();
  EXPECT_NE(second.status().message().find("--data_dir"), std::string::npos) << second.status();
}

TEST_F(StoreTest, SegmentsAreImmutable) {
  Open();
  std::string p = MakePayload(100, 1);
  ASSERT_THAT(Put("s", 0, 0, p), IsOk());
  EXPECT_THAT(Put("s", 0, 0, MakePayload(100, 2)), StatusIs(Code::kAlreadyExists));
  EXPECT_EQ(Get("s", 0, 0), p);
}

TEST_F(StoreTest, BadInputChangesNothing) {
  Open();
  std::string p = MakePayload(300, 1);
  WriteSpec w = Spec("bad/name", 0, 0, p);
  EXPECT_THAT(store_->BeginWrite(w), StatusIs(Code::kInvalidArgument));
  w = Spec("s", 0, 0, p);
  w.layer_begin = 5;
  w.layer_end = 5;
  EXPECT_THAT(store_->BeginWrite(w), StatusIs(Code::kInvalidArgument));
  w = Spec("s", 0, 64, p);
  EXPECT_THAT(store_->BeginWrite(w), StatusIs(Code::kInvalidArgument));
  w = Spec("s", 0, 0, p);
  w.payload_bytes = options_.max_segment_bytes + 1;
  EXPECT_THAT(store_->BeginWrite(w), StatusIs(Code::kOutOfRange));

  // Wrong checksum in the header.
  w = Spec("s", 0, 0, p);
  w.payload_crc32c ^= 1;
  KVT_ASSERT_OK_AND_ASSIGN(WriteTicket t, store_->BeginWrite(w));
  EXPECT_THAT(store_->CommitWrite(std::move(t), p), StatusIs(Code::kDataLoss));
  // Truncated payload.
  KVT_ASSERT_OK_AND_ASSIGN(t, store_->BeginWrite(Spec("s", 0, 0, p)));
  EXPECT_THAT(store_->CommitWrite(std::move(t), p.substr(0, 10)), StatusIs(Code::kOutOfRange));
  // Bytes that are not a SegmentPayload, with a matching checksum.
  std::string junk(300, '\xff');
  KVT_ASSERT_OK_AND_ASSIGN(t, store_->BeginWrite(Spec("s", 0, 0, junk)));
  EXPECT_THAT(store_->CommitWrite(std::move(t), junk), StatusIs(Code::kInvalidArgument));

  EXPECT_THAT(store_->ListRounds("t1", "s"), StatusIs(Code::kNotFound));
  EXPECT_EQ(store_->Stats().disk_segments, 0u);
  EXPECT_EQ(quota_manager_->Usage("t1").used_bytes, 0u);
  EXPECT_EQ(quota_manager_->Usage("t1").reserved_bytes, 0u);
  // The failed attempts left the key free.
  EXPECT_THAT(Put("s", 0, 0, p), IsOk());
}

TEST_F(StoreTest, WritingSegmentsAreInvisible) {
  Open();
  std::string p = MakePayload(300, 1);
  KVT_ASSERT_OK_AND_ASSIGN(WriteTicket t, store_->BeginWrite(Spec("s", 0, 0, p)));
  EXPECT_THAT(store_->BeginWrite(Spec("s", 0, 0, p)), StatusIs(Code::kAlreadyExists));
  KVT_ASSERT_OK_AND_ASSIGN(SessionInfo info, store_->ListRounds("t1", "s"));
  EXPECT_TRUE(info.rounds.empty());
  EXPECT_THAT(store_->PrepareRead("t1", "s", {{0, 0}}), StatusIs(Code::kNotFound));
  ASSERT_THAT(store_->CommitWrite(std::move(t), p), IsOk());
  EXPECT_THAT(store_->PrepareRead("t1", "s", {{0, 0}}), IsOk());
}

// A get's recall counter is queued (written in the background, not on the
// get's path), visible at once, durable after a clean close, and never
// written back after its round was dropped.
TEST_F(StoreTest, QueuedRecallCountersAreKeptAndDieWithTheirRound) {
  Open();
  ASSERT_THAT(Put("s", 0, 0, MakePayload(300, 1)), IsOk());
  ASSERT_THAT(Put("s", 1, 0, MakePayload(300, 2)), IsOk());
  ASSERT_THAT(store_->PrepareRead("t1", "s", {{0, 0}, {1, 0}}), IsOk());
  ASSERT_THAT(store_->PrepareRead("t1", "s", {{0, 0}}), IsOk());
  KVT_ASSERT_OK_AND_ASSIGN(SessionInfo info, store_->ListRounds("t1", "s"));
  ASSERT_EQ(info.rounds.size(), 2u);
  EXPECT_EQ(info.rounds[0].summary.recall_count(), 2u);
  EXPECT_EQ(info.rounds[1].summary.recall_count(), 1u);
  // Round 1 is dropped with its counter still queued, then written anew.
  ASSERT_THAT(store_->PrepareRead("t1", "s", {{1, 0}}), IsOk());
  ASSERT_THAT(store_->DropRounds("t1", "s", {1}), IsOk());
  ASSERT_THAT(Put("s", 1, 0, MakePayload(300, 3)), IsOk());
  Open();  // A clean close writes what is queued.
  KVT_ASSERT_OK_AND_ASSIGN(info, store_->ListRounds("t1", "s"));
  ASSERT_EQ(info.rounds.size(), 2u);
  EXPECT_EQ(info.rounds[0].summary.recall_count(), 2u);
  EXPECT_EQ(info.rounds[1].summary.recall_count(), 0u);
}

// A single segment goes, durably, with its quota and its payload file; the
// round keeps its other segment, summary and counter; the round's last
// segment takes the round with it.
TEST_F(StoreTest, DropSegmentsKeepsTheRestOfTheRound) {
  Open();
  quota_manager_->SetQuota("t1", 1 << 20);
  // Segment 1 is over inline_payload_max_bytes: it has a payload file.
  const std::string p0 = MakePayload(1000, 1), p1 = MakePayload(300'000, 2, 3),
                    r1 = MakePayload(500, 3);
  ASSERT_THAT(Put("s", 0, 0, p0), IsOk());
  ASSERT_THAT(Put("s", 0, 1, p1), IsOk());
  ASSERT_THAT(Put("s", 1, 0, r1), IsOk());
  ASSERT_THAT(store_->PrepareRead("t1", "s", {{0, 0}}), IsOk());
  KVT_ASSERT_OK_AND_ASSIGN(auto d, store_->DropSegments("t1", "s", {{0, 1}, {0, 5}, {9, 0}}));
  EXPECT_THAT(d.dropped, ElementsAre(SegmentId{0, 1}));
  EXPECT_THAT(d.not_found, ElementsAre(SegmentId{0, 5}, SegmentId{9, 0}));
  EXPECT_EQ(d.freed_bytes, p1.size());
  EXPECT_EQ(quota_manager_->Usage("t1").used_bytes, p0.size() + r1.size());
  EXPECT_EQ(store_->Stats().segment_drops, 1u);
  EXPECT_EQ(store_->Stats().drops, 0u);
  EXPECT_EQ(Get("s", 0, 1).rfind("error: NOT_FOUND", 0), 0u);
  EXPECT_EQ(Get("s", 0, 0), p0);
  // A restart finds the same.
  Open();
  EXPECT_EQ(Get("s", 0, 1).rfind("error: NOT_FOUND", 0), 0u);
  KVT_ASSERT_OK_AND_ASSIGN(SessionInfo info, store_->ListRounds("t1", "s"));
  ASSERT_EQ(info.rounds.size(), 2u);
  ASSERT_EQ(info.rounds[0].segments.size(), 1u);
  EXPECT_EQ(info.rounds[0].segments[0].id, (SegmentId{0, 0}));
  EXPECT_EQ(info.rounds[0].summary.recall_count(), 1u);
  EXPECT_EQ(Get("s", 0, 0), p0);
  EXPECT_EQ(store_->Stats().disk_segments, 2u);
  // The last segment takes its round.
  KVT_ASSERT_OK_AND_ASSIGN(d, store_->DropSegments("t1", "s", {{0, 0}}));
  EXPECT_THAT(d.dropped, ElementsAre(SegmentId{0, 0}));
  EXPECT_EQ(store_->Stats().drops, 1u);
  Open();
  KVT_ASSERT_OK_AND_ASSIGN(info, store_->ListRounds("t1", "s"));
  ASSERT_EQ(info.rounds.size(), 1u);
  EXPECT_EQ(info.rounds[0].round, 1u);
  // Bad names and numbers change nothing.
  EXPECT_THAT(store_->DropSegments("t1", "s", {{1, 64}}), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(store_->DropSegments("t1", "s", {{1u << 31, 0}}), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(store_->DropSegments("t1", "nobody", {{1, 0}}), StatusIs(Code::kNotFound));
  EXPECT_THAT(store_->DropSegments("t2", "s", {{1, 0}}), StatusIs(Code::kNotFound));
  EXPECT_EQ(Get("s", 1, 0), r1);
}

TEST_F(StoreTest, AbandonedTicketRefundsEverything) {
  options_.disk_budget_bytes = 10'000;
  Open();
  quota_manager_->SetQuota("t1", 1000);
  std::string p = MakePayload(800, 1, 3);
  {
    KVT_ASSERT_OK_AND_ASSIGN(WriteTicket t, store_->BeginWrite(Spec("s", 0, 0, p)));
    EXPECT_EQ(quota_manager_->Usage("t1").reserved_bytes, p.size());
    EXPECT_THAT(store_->BeginWrite(Spec("s", 0, 1, p)), StatusIs(Code::kResourceExhausted));
  }
  EXPECT_EQ(quota_manager_->Usage("t1").reserved_bytes, 0u);
  EXPECT_THAT(Put("s", 0, 1, p), IsOk());
  EXPECT_EQ(quota_manager_->Usage("t1").used_bytes, p.size());
}

TEST_F(StoreTest, QuotaIsPerTenant) {
  Open();
  quota_manager_->SetQuota("t1", 2000);
  std::string p = MakePayload(900, 1);
  ASSERT_THAT(Put("s", 0, 0, p), IsOk());
  ASSERT_THAT(Put("s", 1, 0, p), IsOk());
  EXPECT_THAT(Put("s", 2, 0, p), StatusIs(Code::kResourceExhausted));
  EXPECT_THAT(Put("s", 2, 0, p, "t2"), IsOk());
  KVT_ASSERT_OK_AND_ASSIGN(auto dropped, store_->DropRounds("t1", "s", {0, 7}));
  EXPECT_THAT(dropped.dropped, ElementsAre(0u));
  EXPECT_THAT(dropped.not_found, ElementsAre(7u));
  EXPECT_THAT(Put("s", 2, 0, p), IsOk());
}

TEST_F(StoreTest, TenantsCannotSeeEachOther) {
  Open();
  ASSERT_THAT(Put("shared-name", 0, 0, MakePayload(100, 1), "alice"), IsOk());
  EXPECT_THAT(store_->ListRounds("bob", "shared-name"), StatusIs(Code::kNotFound));
  EXPECT_THAT(store_->PrepareRead("bob", "shared-name", {{0, 0}}), StatusIs(Code::kNotFound));
  EXPECT_THAT(store_->DeleteSession("bob", "shared-name"), StatusIs(Code::kNotFound));
  EXPECT_THAT(store_->ListRounds("alice", "shared-name"), IsOk());
}

TEST_F(StoreTest, CounterPolicySpillsFewestRecallsAmongOlderHalf) {
  options_.ram_budget_bytes = 4 * 1100;
  options_.promote_after_disk_reads = 0;
  Open();
  std::vector<std::string> p;
  for (int i = 0; i < 4; ++i) {
    p.push_back(MakePayload(1000, i));
    ASSERT_THAT(Put("s", i, 0, p[i]), IsOk());
  }
  // Rounds 0 and 1 are the older half; round 0 is recalled, so round 1 goes.
  ASSERT_THAT(store_->PrepareRead("t1", "s", {{0, 0}}), IsOk());
  ASSERT_THAT(Put("s", 4, 0, MakePayload(1000, 4)), IsOk());
  KVT_ASSERT_OK_AND_ASSIGN(SessionInfo info, store_->ListRounds("t1", "s"));
  std::vector<SegmentState> states;
  for (const auto& r : info.rounds) states.push_back(r.segments[0].state);
  EXPECT_THAT(states,
              ElementsAre(SegmentState::kSealed, SegmentState::kSpilled, SegmentState::kSealed,
                          SegmentState::kSealed, SegmentState::kSealed));
  // A spilled segment is still served, from RocksDB, bit-exact.
  Tier from;
  EXPECT_EQ(Get("s", 1, 0, &from), p[1]);
  EXPECT_EQ(from, Tier::kDisk);
  EXPECT_EQ(store_->Stats().spills, 1u);
}

TEST_F(StoreTest, LruPolicySpillsLeastRecentlyUsed) {
  options_.ram_budget_bytes = 3 * 1100;
  options_.spill_policy = SpillPolicy::kLru;
  options_.promote_after_disk_reads = 0;
  Open();
  for (int i = 0; i < 3; ++i) ASSERT_THAT(Put("s", i, 0, MakePayload(1000, i)), IsOk());
  ASSERT_THAT(store_->PrepareRead("t1", "s", {{0, 0}}), IsOk());
  ASSERT_THAT(Put("s", 3, 0, MakePayload(1000, 3)), IsOk());
  KVT_ASSERT_OK_AND_ASSIGN(SessionInfo info, store_->ListRounds("t1", "s"));
  EXPECT_EQ(info.rounds[0].segments[0].state, SegmentState::kSealed);
  EXPECT_EQ(info.rounds[1].segments[0].state, SegmentState::kSpilled);
}

TEST_F(StoreTest, HotSpilledSegmentIsPromoted) {
  options_.ram_budget_bytes = 2 * 1100;
  options_.promote_after_disk_reads = 2;
  Open();
  for (int i = 0; i < 3; ++i) ASSERT_THAT(Put("s", i, 0, MakePayload(1000, i)), IsOk());
  Tier from;
  Get("s", 0, 0, &from);
  EXPECT_EQ(from, Tier::kDisk);
  Get("s", 0, 0, &from);
  EXPECT_EQ(from, Tier::kDisk);  // This read promotes it.
  Get("s", 0, 0, &from);
  EXPECT_EQ(from, Tier::kRam);
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.promotions, 1u);
  EXPECT_LE(st.ram_bytes, options_.ram_budget_bytes);
}

TEST_F(StoreTest, SegmentLargerThanRamGoesStraightToDisk) {
  options_.ram_budget_bytes = 500;
  Open();
  std::string p = MakePayload(2000, 1);
  KVT_ASSERT_OK_AND_ASSIGN(SegmentInfo info, Put("s", 0, 0, p));
  EXPECT_EQ(info.state, SegmentState::kSpilled);
  EXPECT_EQ(Get("s", 0, 0), p);
}

// Issue 14 #5: pinning an unknown session is NOT_FOUND (it used to create
// an empty pinned record that never expired). Pinned bytes count against
// the RAM budget: they spill after every unpinned segment, never past the
// budget; they are never dropped for disk room.
TEST_F(StoreTest, PinnedSessionsSpillLastAndSurvivePressure) {
  options_.ram_budget_bytes = 2 * 1100;
  options_.disk_budget_bytes = 4 * 1100;
  Open();
  EXPECT_THAT(store_->PinSession("t1", "pinned", true), StatusIs(Code::kNotFound));
  EXPECT_EQ(store_->Stats().sessions, 0u);
  std::vector<std::string> payloads;
  for (int i = 0; i < 3; ++i) payloads.push_back(MakePayload(1000, i));
  ASSERT_THAT(Put("pinned", 0, 0, payloads[0]), IsOk());
  ASSERT_THAT(store_->PinSession("t1", "pinned", true), IsOk());
  ASSERT_THAT(Put("other", 0, 0, MakePayload(1000, 9)), IsOk());
  // RAM is full: the next pinned round spills the unpinned one first.
  ASSERT_THAT(Put("pinned", 1, 0, payloads[1]), IsOk());
  KVT_ASSERT_OK_AND_ASSIGN(SessionInfo info, store_->ListRounds("t1", "pinned"));
  for (const auto& r : info.rounds) EXPECT_EQ(r.segments[0].state, SegmentState::kSealed);
  EXPECT_EQ(store_->ListRounds("t1", "other").value().rounds[0].segments[0].state,
            SegmentState::kSpilled);
  // Only pinned segments are left in RAM: one of them spills now.
  ASSERT_THAT(Put("pinned", 2, 0, payloads[2]), IsOk());
  EXPECT_LE(store_->Stats().ram_bytes, options_.ram_budget_bytes);
  EXPECT_EQ(store_->Stats().ram_segments, 2u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(Get("pinned", i, 0), payloads[i]);
  EXPECT_LE(store_->Stats().ram_bytes, options_.ram_budget_bytes);
  // Disk is full of pinned rounds plus one unpinned: the next write may drop
  // only "other".
  ASSERT_THAT(Put("other", 1, 0, MakePayload(1000, 10)), IsOk());
  EXPECT_EQ(store_->ListRounds("t1", "pinned").value().rounds.size(), 3u);
  EXPECT_EQ(store_->ListRounds("t1", "other").value().rounds.size(), 1u);
  // With only pinned rounds and the newest write left there is no room.
  ASSERT_THAT(store_->PinSession("t1", "other", true), IsOk());
  EXPECT_THAT(Put("third", 0, 0, MakePayload(1000, 11)), StatusIs(Code::kResourceExhausted));
  EXPECT_EQ(store_->Stats().disk_segments, 4u);
}

// Memory pressure (the controller's HIGH): cold sessions lose their
// never-recalled rounds, except the newest; recalled rounds, active and
// pinned sessions keep everything; the drop survives a reopen.
TEST_F(StoreTest, ColdDropKeepsRecalledNewestActiveAndPinned) {
  Open();
  for (const char* session : {"cold", "active", "pinned"}) {
    for (int i = 0; i < 4; ++i) ASSERT_THAT(Put(session, i, 0, MakePayload(100, i)), IsOk());
  }
  ASSERT_THAT(store_->PrepareRead("t1", "cold", {{1, 0}}), IsOk());  // Round 1 was recalled.
  ASSERT_THAT(store_->PinSession("t1", "pinned", true), IsOk());
  clock_.AdvanceMs(60'000);
  ASSERT_THAT(Put("active", 4, 0, MakePayload(100, 4)), IsOk());  // Just used.
  KVT_ASSERT_OK_AND_ASSIGN(Store::ColdDropResult r, store_->DropColdRounds(30'000));
  EXPECT_EQ(r.sessions, 1u);
  EXPECT_EQ(r.rounds, 2u);
  EXPECT_GT(r.freed_bytes, 0u);
  auto rounds_of = [&](const std::string& session) {
    std::vector<uint32_t> out;
    auto info = store_->ListRounds("t1", session);
    EXPECT_TRUE(info.ok()) << info.status();
    if (info.ok()) {
      for (const auto& x : info->rounds) out.push_back(x.round);
    }
    return out;
  };
  EXPECT_THAT(rounds_of("cold"), ElementsAre(1u, 3u));
  EXPECT_THAT(rounds_of("active"), ElementsAre(0u, 1u, 2u, 3u, 4u));
  EXPECT_THAT(rounds_of("pinned"), ElementsAre(0u, 1u, 2u, 3u));
  EXPECT_EQ(store_->Stats().cold_drops, 2u);
  EXPECT_EQ(store_->Stats().pressure_drops, 0u);
  Open();  // As a restarted process.
  EXPECT_THAT(rounds_of("cold"), ElementsAre(1u, 3u));
}

TEST_F(StoreTest, DiskPressureDropsNeverRecalledRoundsFirst) {
  options_.disk_budget_bytes = 3 * 1100;
  Open();
  for (int i = 0; i < 3; ++i) ASSERT_THAT(Put("s", i, 0, MakePayload(1000, i)), IsOk());
  // Round 0 is the oldest but has been recalled; round 1 never has.
  ASSERT_THAT(store_->PrepareRead("t1", "s", {{0, 0}}), IsOk());
  ASSERT_THAT(Put("s", 3, 0, MakePayload(1000, 3)), IsOk());
  KVT_ASSERT_OK_AND_ASSIGN(SessionInfo info, store_->ListRounds("t1", "s"));
  std::vector<uint32_t> rounds;
  for (const auto& r : info.rounds) rounds.push_back(r.round);
  EXPECT_THAT(rounds, ElementsAre(0u, 2u, 3u));
  EXPECT_EQ(store_->Stats().pressure_drops, 1u);
  EXPECT_EQ(Get("s", 1, 0).rfind("error: NOT_FOUND", 0), 0u);
}

TEST_F(StoreTest, RecordedRecallsProtectRoundsLikeFetches) {
  options_.disk_budget_bytes = 3 * 1100;
  Open();
  for (int i = 0; i < 3; ++i) ASSERT_THAT(Put("s", i, 0, MakePayload(1000, i)), IsOk());
  // Round 0 was recalled without a fetch (resident in a worker), twice.
  KVT_ASSERT_OK_AND_ASSIGN(Store::RecallResult r, store_->RecordRecalls("t1", "s", {0, 7, 0}));
  EXPECT_THAT(r.counted, ElementsAre(0u, 0u));
  EXPECT_THAT(r.not_found, ElementsAre(7u));
  KVT_ASSERT_OK_AND_ASSIGN(SessionInfo info, store_->ListRounds("t1", "s"));
  EXPECT_EQ(info.rounds[0].summary.recall_count(), 2u);
  EXPECT_EQ(info.rounds[0].segments[0].recall_count, 0u);  // Nothing was fetched.
  EXPECT_GT(info.rounds[0].summary.last_recall_unix_ms(), 0);
  EXPECT_EQ(info.rounds[1].summary.recall_count(), 0u);
  // Disk pressure drops the never-recalled round 1, not the older round 0.
  ASSERT_THAT(Put("s", 3, 0, MakePayload(1000, 3)), IsOk());
  KVT_ASSERT_OK_AND_ASSIGN(info, store_->ListRounds("t1", "s"));
  std::vector<uint32_t> rounds;
  for (const auto& ri : info.rounds) rounds.push_back(ri.round);
  EXPECT_THAT(rounds, ElementsAre(0u, 2u, 3u));
  // The counters are durable.
  Open();
  KVT_ASSERT_OK_AND_ASSIGN(info, store_->ListRounds("t1", "s"));
  EXPECT_EQ(info.rounds[0].summary.recall_count(), 2u);
  // Unknown sessions, other tenants and bad names.
  EXPECT_THAT(store_->RecordRecalls("t1", "nope", {0}), StatusIs(Code::kNotFound));
  EXPECT_THAT(store_->RecordRecalls("t2", "s", {0}), StatusIs(Code::kNotFound));
  EXPECT_THAT(store_->RecordRecalls("t1", "", {0}), StatusIs(Code::kInvalidArgument));
}

TEST_F(StoreTest, TtlExpiresIdleSessionsButNotPinnedOnes) {
  options_.default_ttl_seconds = 60;
  Open();
  ASSERT_THAT(Put("idle", 0, 0, MakePayload(100, 1)), IsOk());
  ASSERT_THAT(Put("busy", 0, 0, MakePayload(100, 2)), IsOk());
  ASSERT_THAT(Put("pinned", 0, 0, MakePayload(100, 3)), IsOk());
  ASSERT_THAT(store_->PinSession("t1", "pinned", true), IsOk());
  WriteSpec longer = Spec("long", 0, 0, MakePayload(100, 4));
  longer.session_ttl_seconds = 3600;
  KVT_ASSERT_OK_AND_ASSIGN(WriteTicket t, store_->BeginWrite(longer));
  ASSERT_THAT(store_->CommitWrite(std::move(t), MakePayload(100, 4)), IsOk());
  // An explicit 0 means never, whatever the store's default.
  WriteSpec forever = Spec("forever", 0, 0, MakePayload(100, 5));
  forever.session_ttl_seconds = 0;
  KVT_ASSERT_OK_AND_ASSIGN(WriteTicket t2, store_->BeginWrite(forever));
  ASSERT_THAT(store_->CommitWrite(std::move(t2), MakePayload(100, 5)), IsOk());

  clock_.AdvanceMs(40'000);
  ASSERT_THAT(store_->ListRounds("t1", "busy"), IsOk());  // Touches it.
  clock_.AdvanceMs(40'000);
  KVT_ASSERT_OK_AND_ASSIGN(int expired, store_->ExpireSessions());
  EXPECT_EQ(expired, 1);
  EXPECT_THAT(store_->ListRounds("t1", "idle"), StatusIs(Code::kNotFound));
  EXPECT_THAT(store_->ListRounds("t1", "busy"), IsOk());
  EXPECT_THAT(store_->ListRounds("t1", "pinned"), IsOk());
  EXPECT_THAT(store_->ListRounds("t1", "long"), IsOk());
  EXPECT_EQ(quota_manager_->Usage("t1").used_bytes, store_->Stats().disk_bytes);
  clock_.AdvanceMs(int64_t{400} * 24 * 3600 * 1000);
  ASSERT_THAT(store_->ExpireSessions(), IsOk());
  EXPECT_THAT(store_->ListRounds("t1", "forever"), IsOk());
  EXPECT_THAT(store_->ListRounds("t1", "long"), StatusIs(Code::kNotFound));
}

TEST_F(StoreTest, DefaultTtlIsAWeek) { EXPECT_EQ(StoreOptions().default_ttl_seconds, 604800u); }

// What `kvtier store gc` lists: one tenant's sessions, idle ones only,
// by name, in pages.
TEST_F(StoreTest, ListSessionsByIdleTime) {
  Open();
  ASSERT_THAT(Put("b-old", 0, 0, MakePayload(100, 1)), IsOk());
  ASSERT_THAT(Put("a-old", 0, 0, MakePayload(100, 2)), IsOk());
  ASSERT_THAT(Put("a-old", 1, 0, MakePayload(100, 3)), IsOk());
  clock_.AdvanceMs(3'600'000);
  ASSERT_THAT(Put("c-new", 0, 0, MakePayload(100, 4)), IsOk());
  WriteSpec other = Spec("a-old", 0, 0, MakePayload(100, 5));
  other.tenant = "t2";
  KVT_ASSERT_OK_AND_ASSIGN(WriteTicket t, store_->BeginWrite(other));
  ASSERT_THAT(store_->CommitWrite(std::move(t), MakePayload(100, 5)), IsOk());

  std::vector<Store::SessionSummary> idle = store_->ListSessions("t1", 1'800'000, 10, "").sessions;
  ASSERT_EQ(idle.size(), 2u);
  EXPECT_EQ(idle[0].session, "a-old");
  EXPECT_EQ(idle[0].rounds, 2u);
  EXPECT_GE(idle[0].idle_ms, 3'600'000);
  EXPECT_EQ(idle[1].session, "b-old");
  Store::SessionPage all = store_->ListSessions("t1", 0, 10, "");
  EXPECT_EQ(all.sessions.size(), 3u);
  EXPECT_EQ(all.next_start_after, "");
  Store::SessionPage page = store_->ListSessions("t1", 0, 1, "a-old");
  ASSERT_EQ(page.sessions.size(), 1u);
  EXPECT_EQ(page.sessions[0].session, "b-old");
  EXPECT_EQ(page.next_start_after, "b-old");  // c-new follows.
}

// Pages walk one tenant's sessions in name order from start_after and stop
// after their limit or their scan budget: paging through gives every
// matching session once, in order, whatever the page size, the budget and
// the other tenants; deleted sessions leave the index; recovery rebuilds it.
TEST_F(StoreTest, ListSessionsPagesInNameOrderWithABoundedScan) {
  Open();
  std::vector<std::string> old_ones, all;
  for (int i = 0; i < 40; ++i) {
    const std::string name = absl::StrCat("s", (i * 7) % 40 + 100);
    for (const char* tenant : {"t0", "t1", "t2"}) {
      WriteSpec w = Spec(name, 0, 0, MakePayload(64, i));
      w.tenant = tenant;
      KVT_ASSERT_OK_AND_ASSIGN(WriteTicket t, store_->BeginWrite(w));
      ASSERT_THAT(store_->CommitWrite(std::move(t), MakePayload(64, i)), IsOk());
    }
    all.push_back(name);
    if (i < 15) old_ones.push_back(name);
    if (i == 14) clock_.AdvanceMs(3'600'000);
  }
  std::sort(all.begin(), all.end());
  std::sort(old_ones.begin(), old_ones.end());
  auto walk = [&](int64_t min_idle_ms, size_t limit, size_t scan, int* pages) {
    std::vector<std::string> got;
    std::string after;
    *pages = 0;
    do {
      Store::SessionPage p = store_->ListSessions("t1", min_idle_ms, limit, after, scan);
      EXPECT_LE(p.sessions.size(), limit);
      for (const auto& s : p.sessions) got.push_back(s.session);
      after = p.next_start_after;
      if (++*pages > 100) break;
    } while (!after.empty());
    return got;
  };
  int pages = 0;
  for (size_t limit : {1, 7, 40, 1000}) {
    SCOPED_TRACE(limit);
    EXPECT_EQ(walk(0, limit, Store::kListScanNames, &pages), all);
    EXPECT_EQ(pages, static_cast<int>((all.size() + limit - 1) / limit));
    EXPECT_EQ(walk(1'800'000, limit, Store::kListScanNames, &pages), old_ones);
  }
  // A scan budget of 3 names past the limit: pages of idle sessions come
  // short, and some empty, but the walk still finds each one once.
  EXPECT_EQ(walk(1'800'000, 2, 3, &pages), old_ones);
  // 40 names, at most 5 looked at per page, fewer when two idle ones come
  // first.
  EXPECT_EQ(pages, 9);
  ASSERT_THAT(store_->DeleteSession("t1", all[3]), IsOk());
  std::vector<std::string> left = all;
  left.erase(left.begin() + 3);
  EXPECT_EQ(walk(0, 7, Store::kListScanNames, &pages), left);
  ASSERT_THAT(store_->CheckIndex(), IsOk());
  Open();  // Recovery.
  EXPECT_EQ(walk(0, 7, Store::kListScanNames, &pages), left);
  ASSERT_THAT(store_->CheckIndex(), IsOk());
}

TEST_F(StoreTest, RecoveryRebuildsIndexCountersAndQuota) {
  Open();
  std::string p0 = MakePayload(700, 1), p1 = MakePayload(900, 2, 3);
  WriteSpec w = Spec("s", 0, 0, p0);
  w.has_round_summary = true;
  w.round_summary.set_token_begin(0);
  w.round_summary.set_token_end(42);
  w.round_summary.set_question_tokens(10);
  KVT_ASSERT_OK_AND_ASSIGN(WriteTicket t, store_->BeginWrite(w));
  ASSERT_THAT(store_->CommitWrite(std::move(t), p0), IsOk());
  ASSERT_THAT(Put("s", 0, 1, p1), IsOk());
  ASSERT_THAT(Put("gone", 0, 0, MakePayload(900, 2)), IsOk());
  ASSERT_THAT(store_->DeleteSession("t1", "gone"), IsOk());
  ASSERT_THAT(store_->PrepareRead("t1", "s", {{0, 0}, {0, 1}}), IsOk());
  // A repair's copy is not a recall: the counter stays at one.
  ASSERT_THAT(store_->PrepareRead("t1", "s", {{0, 0}, {0, 1}}, 1 << 30, /*count_recalls=*/false),
              IsOk());
  ASSERT_THAT(store_->PinSession("t1", "s", true), IsOk());

  Open();  // Reopen from disk.
  KVT_ASSERT_OK_AND_ASSIGN(SessionInfo info, store_->ListRounds("t1", "s"));
  ASSERT_EQ(info.rounds.size(), 1u);
  EXPECT_TRUE(info.pinned);
  EXPECT_EQ(info.rounds[0].summary.token_end(), 42u);
  EXPECT_EQ(info.rounds[0].summary.question_tokens(), 10u);
  EXPECT_EQ(info.rounds[0].summary.recall_count(), 1u);
  EXPECT_EQ(info.rounds[0].segments.size(), 2u);
  EXPECT_EQ(info.rounds[0].segments[0].state, SegmentState::kSpilled);
  EXPECT_THAT(store_->ListRounds("t1", "gone"), StatusIs(Code::kNotFound));
  EXPECT_EQ(Get("s", 0, 0), p0);
  EXPECT_EQ(Get("s", 0, 1), p1);
  EXPECT_EQ(quota_manager_->Usage("t1").used_bytes, p0.size() + p1.size());
  EXPECT_THAT(Put("s", 0, 1, p1), StatusIs(Code::kAlreadyExists));
}

TEST_F(StoreTest, DeleteDuringUploadAbortsIt) {
  Open();
  std::string p = MakePayload(500, 1);
  ASSERT_THAT(Put("s", 0, 0, p), IsOk());
  KVT_ASSERT_OK_AND_ASSIGN(WriteTicket t, store_->BeginWrite(Spec("s", 1, 0, p)));
  ASSERT_THAT(store_->DeleteSession("t1", "s"), IsOk());
  EXPECT_THAT(store_->CommitWrite(std::move(t), p), StatusIs(Code::kAborted));
  EXPECT_THAT(store_->ListRounds("t1", "s"), StatusIs(Code::kNotFound));
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.disk_segments, 0u);
  EXPECT_EQ(st.disk_bytes, 0u);
  EXPECT_EQ(quota_manager_->Usage("t1").used_bytes, 0u);
  Open();
  EXPECT_THAT(store_->ListRounds("t1", "s"), StatusIs(Code::kNotFound));
}

// The callback-thread variants: they decline (nothing changed, ticket and
// payload left to the waiting call) exactly where the waiting call could
// block, and otherwise give its answers.
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
  for (int i = 0; i < 1000 && store.Stats().spare_payload_files != n; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return store.Stats().spare_payload_files == n;
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

namespace kvtier::cachestore {
namespace {

// Many threads put, read, drop, delete, pin and expire at once over a small
// key space, with RAM and disk budgets small enough that spills, promotions
// and pressure drops happen throughout. Afterwards the index, the byte
// counters and the quota must agree, and every listed segment must read back
// exactly. Runs under ASan and TSan (make asan; KVTIER_SANITIZE=thread).
TEST_F(StoreTest, ConcurrentOperationsKeepTheIndexConsistent) {
  options_.ram_budget_bytes = 64 << 10;
  options_.disk_budget_bytes = 512 << 10;
  options_.inline_payload_max_bytes = 8 << 10;  // Both payload paths.
  options_.default_ttl_seconds = 5;
  Open();
  constexpr int kThreads = 6, kOps = 300, kSessions = 4, kRounds = 6;
  auto payload_for = [](int session, int round, int seg) {
    return MakePayload(2000 + 3000 * ((session + round + seg) % 5), session * 100 + round * 2 + seg,
                       seg == 0 ? 0 : 3);
  };
  std::vector<std::thread> threads;
  std::atomic<int> unexpected{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int op = 0; op < kOps; ++op) {
        const int s = rng() % kSessions, r = rng() % kRounds, g = rng() % 2;
        const std::string session = "s" + std::to_string(s);
        absl::Status st;
        switch (rng() % 10) {
          case 0:
          case 1:
          case 2:
          case 3:
            st = Put(session, r, g, payload_for(s, r, g)).status();
            if (absl::IsAlreadyExists(st) || absl::IsResourceExhausted(st) || absl::IsAborted(st)) {
              st = absl::OkStatus();
            }
            break;
          case 4:
          case 5: {
            auto got = store_->ReadSegment("t1", session,
                                           {static_cast<uint32_t>(r), static_cast<uint32_t>(g)});
            if (got.ok() && *got->payload != payload_for(s, r, g)) ++unexpected;
            st = absl::IsNotFound(got.status()) ? absl::OkStatus() : got.status();
            break;
          }
          case 6:
            st = store_->PrepareRead("t1", session, {{static_cast<uint32_t>(r), 0}}).status();
            if (absl::IsNotFound(st)) st = absl::OkStatus();
            break;
          case 7:
            st = store_->DropRounds("t1", session, {static_cast<uint32_t>(r)}).status();
            if (absl::IsNotFound(st)) st = absl::OkStatus();
            break;
          case 8:
            st = (rng() % 4 == 0) ? store_->DeleteSession("t1", session).status()
                                  : store_->PinSession("t1", session, rng() % 2 == 0);
            if (absl::IsNotFound(st)) st = absl::OkStatus();
            break;
          case 9:
            clock_.AdvanceMs(1000);
            st = store_->ExpireSessions().status();
            break;
        }
        if (!st.ok()) {
          ++unexpected;
          ADD_FAILURE() << st;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(unexpected.load(), 0);

  uint64_t listed_bytes = 0, listed_segments = 0, ram_bytes = 0;
  std::vector<std::tuple<int, uint32_t, uint32_t>> listed;
  for (int s = 0; s < kSessions; ++s) {
    auto info = store_->ListRounds("t1", "s" + std::to_string(s));
    if (!info.ok()) continue;
    for (const RoundInfo& r : info->rounds) {
      for (const SegmentInfo& seg : r.segments) {
        listed_bytes += seg.payload_bytes;
        ++listed_segments;
        if (seg.state == SegmentState::kSealed) ram_bytes += seg.payload_bytes;
        listed.emplace_back(s, r.round, seg.id.segment);
      }
    }
  }
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.disk_bytes, listed_bytes);
  EXPECT_EQ(st.disk_segments, listed_segments);
  EXPECT_EQ(st.ram_bytes, ram_bytes);
  EXPECT_EQ(quota_manager_->Usage("t1").used_bytes, listed_bytes);
  EXPECT_EQ(quota_manager_->Usage("t1").reserved_bytes, 0u);
  EXPECT_LE(listed_bytes, options_.disk_budget_bytes);
  EXPECT_GT(st.spills + st.pressure_drops, 0u);
  for (const auto& [s, round, seg] : listed) {
    EXPECT_EQ(Get("s" + std::to_string(s), round, seg), payload_for(s, round, seg))
        << "s" << s << " round " << round << " segment " << seg;
  }
  // What a restart rebuilds matches what was there.
  Open();
  EXPECT_EQ(store_->Stats().disk_bytes, listed_bytes);
  EXPECT_EQ(store_->Stats().disk_segments, listed_segments);
}

// Issue 18: the spill and drop orders are kept as entries change instead of
// being rebuilt per decision. On random workloads of every call that moves
// an entry (puts, uploads left open across other calls, abandoned uploads,
// reads and promotions, recalls, pins, drops, deletes, cold drops, expiry,
// disk pressure, reopening), after every call the orders must list exactly
// what the old planner would have chosen from, in its order.
class StoreOrderTest : public StoreTest, public ::testing::WithParamInterface<SpillPolicy> {};

TEST_P(StoreOrderTest, OrdersEqualThePlannerOnRandomWorkloads) {
  options_.spill_policy = GetParam();
  options_.ram_budget_bytes = 6 * 1000;
  options_.disk_budget_bytes = 16 * 1000;
  options_.promote_after_disk_reads = 1;
  options_.default_ttl_seconds = 100;
  Open();
  std::mt19937_64 rng(GetParam() == SpillPolicy::kLru ? 11 : 12);
  std::optional<WriteTicket> open_upload;
  std::string open_payload;
  uint64_t spills = 0, promotions = 0, pressure_drops = 0, expired = 0, cold = 0;
  auto session_name = [&] { return "s" + std::to_string(rng() % 8); };
  // A stored (round, segment) of `session`, if it has one.
  auto pick = [&](const std::string& session) -> std::optional<SegmentId> {
    auto info = store_->ListRounds("t1", session);
    if (!info.ok() || info->rounds.empty()) return std::nullopt;
    const RoundInfo& r = info->rounds[rng() % info->rounds.size()];
    return r.segments[rng() % r.segments.size()].id;
  };
  for (int step = 0; step < 1500; ++step) {
    const int op = static_cast<int>(rng() % 100);
    const std::string session = session_name();
    if (op < 35) {
      const std::string payload = MakePayload(200 + rng() % 1800, step);
      WriteSpec spec = Spec(session, static_cast<uint32_t>(rng() % 12),
                            static_cast<uint32_t>(rng() % 2), payload);
      const uint32_t ttl_choice = static_cast<uint32_t>(rng() % 3);
      if (ttl_choice != 2) spec.session_ttl_seconds = ttl_choice == 0 ? 0u : 10u;
      auto ticket = store_->BeginWrite(spec);
      if (ticket.ok()) {
        if (op < 5 && !open_upload.has_value()) {
          // Left open across the next calls; committed or abandoned later.
          open_upload.emplace(*std::move(ticket));
          open_payload = payload;
        } else {
          (void)store_->CommitWrite(*std::move(ticket), payload);
        }
      }
    } else if (op < 40 && open_upload.has_value()) {
      if (rng() % 2 == 0) {
        (void)store_->CommitWrite(std::move(*open_upload), open_payload);
      }
      open_upload.reset();  // Abandoned when not committed.
    } else if (op < 60) {
      if (auto id = pick(session)) {
        ASSERT_THAT(store_->PrepareRead("t1", session, {*id}), IsOk());
        ASSERT_THAT(store_->ReadSegment("t1", session, *id), IsOk());
      }
    } else if (op < 66) {
      if (auto id = pick(session)) {
        ASSERT_THAT(store_->RecordRecalls("t1", session, {id->round}), IsOk());
      }
    } else if (op < 72) {
      auto info = store_->ListRounds("t1", session);
      if (info.ok()) {
        ASSERT_THAT(store_->PinSession("t1", session, !info->pinned), IsOk());
      }
    } else if (op < 78) {
      if (auto id = pick(session)) {
        ASSERT_THAT(store_->DropRounds("t1", session, {id->round}), IsOk());
      }
    } else if (op < 81) {
      (void)store_->DeleteSession("t1", session);
    } else if (op < 85) {
      clock_.AdvanceMs(static_cast<int64_t>(rng() % 4000));
      KVT_ASSERT_OK_AND_ASSIGN(Store::ColdDropResult r, store_->DropColdRounds(2000));
      cold += r.rounds;
    } else if (op < 89) {
      clock_.AdvanceMs(static_cast<int64_t>(rng() % 8000));
      KVT_ASSERT_OK_AND_ASSIGN(int n, store_->ExpireSessions());
      expired += static_cast<uint64_t>(n);
    } else if (op < 90 && !open_upload.has_value()) {
      StoreStats st = store_->Stats();
      spills += st.spills;
      promotions += st.promotions;
      pressure_drops += st.pressure_drops;
      Open();  // Every segment comes back spilled.
    } else {
      (void)store_->ListRounds("t1", session);
    }
    ASSERT_THAT(store_->CheckIndex(), IsOk()) << "step " << step << ", op " << op;
    ASSERT_LE(store_->Stats().ram_bytes, options_.ram_budget_bytes) << "step " << step;
  }
  StoreStats st = store_->Stats();
  spills += st.spills;
  promotions += st.promotions;
  pressure_drops += st.pressure_drops;
  // The workload reached every path it is meant to check.
  EXPECT_GT(spills, 50u);
  EXPECT_GT(promotions, 10u);
  EXPECT_GT(pressure_drops, 10u);
  EXPECT_GT(expired, 0u);
  EXPECT_GT(cold, 0u);
}

INSTANTIATE_TEST_SUITE_P(Policies, StoreOrderTest,
                         ::testing::Values(SpillPolicy::kCounter, SpillPolicy::kLru),
                         [](const auto& info) {
                           return info.param == SpillPolicy::kLru ? "Lru" : "Counter";
                         });

}  // namespace
}  // namespace kvtier::cachestore
