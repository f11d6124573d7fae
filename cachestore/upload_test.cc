// cachestore/upload.h without gRPC: a recording UploadCall whose scheduled
// tasks run when the test says, over a real Store (a fake clock, and a disk
// that fails on demand).
#include "cachestore/upload.h"

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/clock.h"
#include "gtest/gtest.h"
#include "kernels/crc32c.h"
#include "rocksdb/env.h"
#include "testing/test_util.h"
#include "tests/util/failing_fs.h"
#include "tests/util/status_matchers.h"
#include "tests/util/store_fixture.h"

namespace kvtier::cachestore {
namespace {

using ::kvtier::testing::FailingFs;
using ::kvtier::testing::MakePayload;
using ::kvtier::testing::StatusIs;
using ::testing::HasSubstr;
using Code = absl::StatusCode;
using State = Upload::State;

// Records what the upload asks of its transport; tasks wait in `tasks`.
class RecordingCall : public UploadCall {
 public:
  void Read() override { ++reads; }
  void HeaderAccepted() override { ++accepted; }
  void Schedule(std::function<void()> task) override { tasks.push_back(std::move(task)); }
  absl::Status Admit(uint64_t bytes) override {
    if (inflight + bytes > budget) return absl::ResourceExhaustedError("over the test's budget");
    inflight += bytes;
    return absl::OkStatus();
  }
  void Refund(uint64_t bytes) override { inflight -= bytes; }
  void SegmentDone(const absl::Status& s) override { segments.push_back(s.code()); }
  void Finish(const absl::Status& s, std::vector<UploadResult> r) override {
    ++finished;
    status = s;
    results = std::move(r);
  }

  // Runs scheduled tasks (and those they schedule) until none is left.
  void RunTasks() {
    while (!tasks.empty()) {
      std::function<void()> t = std::move(tasks.front());
      tasks.pop_front();
      t();
    }
  }

  int reads = 0, accepted = 0, finished = 0;
  uint64_t budget = uint64_t{1} << 40, inflight = 0;
  std::deque<std::function<void()>> tasks;
  std::vector<Code> segments;
  absl::Status status;
  std::vector<UploadResult> results;
};

class UploadTest : public StoreTest {
 protected:
  void SetUp() override {
    StoreTest::SetUp();
    options_.inline_payload_max_bytes = 4096;
  }

  std::unique_ptr<Upload> MakeUpload(bool batch) {
    auto u =
        std::make_unique<Upload>(store_.get(), &call_,
                                 Upload::Options{.batch = batch,
                                                 .method = batch ? "PutSegments" : "PutSegment",
                                                 .max_chunk_bytes = 1 << 20});
    u->Start();
    return u;
  }

  // Sends `payload` as chunks of `chunk` bytes, running scheduled tasks
  // after each when `run_tasks`.
  void SendPayload(Upload* u, const std::string& payload, size_t chunk, bool run_tasks = true) {
    for (size_t at = 0; at < payload.size(); at += chunk) {
      const std::string_view piece = std::string_view(payload).substr(at, chunk);
      u->OnChunk(piece.size(), [&](std::string* out) { out->append(piece); });
      if (run_tasks) call_.RunTasks();
    }
  }

  RecordingCall call_;
};

// An inline payload into a session that exists: reserved and committed on
// the event's own thread, no task scheduled at all. (The session's first
// commit records the session, which the store does on a task.)
TEST_F(UploadTest, SmallPutNeedsNoOtherThread) {
  Open();
  const std::string first = MakePayload(1000, 9);
  auto u0 = MakeUpload(false);
  u0->OnHeader(Spec("s", 0, 0, first));
  SendPayload(u0.get(), first, 1000);
  u0->OnHalfClose();
  EXPECT_EQ(u0->state(), State::kCommitting);
  ASSERT_EQ(call_.tasks.size(), 1u);
  call_.RunTasks();
  KVT_ASSERT_OK(call_.status);

  call_ = RecordingCall();
  const std::string p = MakePayload(1000, 1);
  auto u = MakeUpload(false);
  EXPECT_EQ(call_.reads, 1);
  u->OnHeader(Spec("s", 1, 0, p));
  EXPECT_EQ(u->state(), State::kPayload);
  EXPECT_EQ(call_.accepted, 1);
  SendPayload(u.get(), p, 300, /*run_tasks=*/false);
  u->OnHalfClose();
  EXPECT_TRUE(call_.tasks.empty());
  ASSERT_EQ(call_.finished, 1);
  KVT_EXPECT_OK(call_.status);
  ASSERT_EQ(call_.results.size(), 1u);
  ASSERT_TRUE(call_.results[0].info.has_value());
  EXPECT_EQ(call_.results[0].charged_bytes, p.size());
  EXPECT_EQ(u->state(), State::kDone);
  EXPECT_EQ(Get("s", 1, 0), p);
  EXPECT_EQ(call_.inflight, 0u);
  EXPECT_EQ(call_.segments, std::vector<Code>{Code::kOk});
}

// A payload over inline_payload_max_bytes goes to its file as it arrives:
// writer tasks run while chunks still come, the commit waits for them.
TEST_F(UploadTest, LargePayloadIsWrittenWhileItArrives) {
  Open();
  const std::string p = MakePayload(3 << 20, 2);
  auto u = MakeUpload(false);
  u->OnHeader(Spec("s", 0, 0, p));
  int writer_runs = 0;
  for (size_t at = 0; at < p.size(); at += 256 << 10) {
    const std::string_view piece = std::string_view(p).substr(at, 256 << 10);
    u->OnChunk(piece.size(), [&](std::string* out) { out->append(piece); });
    if (!call_.tasks.empty()) ++writer_runs;
    call_.RunTasks();
  }
  EXPECT_GE(writer_runs, 3);  // One per MiB received, at least.
  u->OnHalfClose();
  EXPECT_EQ(u->state(), State::kCommitting);
  EXPECT_EQ(call_.finished, 0);
  call_.RunTasks();
  ASSERT_EQ(call_.finished, 1);
  KVT_EXPECT_OK(call_.status);
  EXPECT_EQ(Get("s", 0, 0), p);
}

// The commit waits for a writer task still running, and a failure after the
// header (the watchdog's) waits for it too before finishing.
TEST_F(UploadTest, FailureAfterTheHeaderWaitsForTheWriter) {
  Open();
  const std::string p = MakePayload(2 << 20, 3);
  auto u = MakeUpload(false);
  u->OnHeader(Spec("s", 0, 0, p));
  SendPayload(u.get(), p.substr(0, 1 << 20), 1 << 20, /*run_tasks=*/false);
  ASSERT_EQ(call_.tasks.size(), 1u);  // The writer task, not yet run.
  u->Fail(absl::DeadlineExceededError("idle"));
  EXPECT_EQ(u->state(), State::kFailing);
  EXPECT_EQ(call_.finished, 0);
  call_.RunTasks();
  ASSERT_EQ(call_.finished, 1);
  EXPECT_THAT(call_.status, StatusIs(Code::kDeadlineExceeded));
  EXPECT_TRUE(call_.results.empty());
  EXPECT_EQ(call_.inflight, 0u);
  // Nothing of it is kept, and the key is free for a retry.
  EXPECT_EQ(quota_manager_->Usage("t1").reserved_bytes, 0u);
  RecordingCall again;
  Upload retry(store_.get(), &again, {.method = "PutSegment", .max_chunk_bytes = 1 << 20});
  retry.Start();
  retry.OnHeader(Spec("s", 0, 0, p));
  for (size_t at = 0; at < p.size(); at += 1 << 20) {
    const std::string_view piece = std::string_view(p).substr(at, 1 << 20);
    retry.OnChunk(piece.size(), [&](std::string* out) { out->append(piece); });
    again.RunTasks();
  }
  retry.OnHalfClose();
  again.RunTasks();
  KVT_EXPECT_OK(again.status);
  EXPECT_EQ(Get("s", 0, 0), p);
}

// PutSegments: each segment commits when its last byte arrives; a refused
// one (over max_segment_bytes, or over the caller's budget) is recorded and
// its bytes dropped; the others are kept.
TEST_F(UploadTest, BatchRecordsEverySegmentAndDropsRefusedBytes) {
  options_.max_segment_bytes = 64 << 10;
  Open();
  const std::string a = MakePayload(2000, 4), big = std::string(100 << 10, 'x'),
                    b = MakePayload(3000, 5), c = MakePayload(5000, 6);
  call_.budget = 4000;
  auto u = MakeUpload(true);
  u->OnHeader(Spec("s", 0, 0, a));
  EXPECT_EQ(call_.accepted, 0);  // A batch's client does not wait for it.
  SendPayload(u.get(), a, 700);
  EXPECT_EQ(u->state(), State::kHeader);
  u->OnHeader(Spec("s", 1, 0, big));
  EXPECT_EQ(u->state(), State::kSkipping);
  SendPayload(u.get(), big, 30 << 10);
  u->OnHeader(Spec("s", 2, 0, b));
  SendPayload(u.get(), b, 3000);
  u->OnHeader(Spec("s", 3, 0, c));  // 5000: over the budget of 4000.
  SendPayload(u.get(), c, 5000);
  u->OnHalfClose();
  ASSERT_EQ(call_.finished, 1);
  KVT_EXPECT_OK(call_.status);
  ASSERT_EQ(call_.results.size(), 4u);
  EXPECT_EQ(call_.results[0].status.code(), Code::kOk);
  EXPECT_EQ(call_.results[1].status.code(), Code::kOutOfRange);
  EXPECT_FALSE(call_.results[1].info.has_value());
  EXPECT_EQ(call_.results[2].status.code(), Code::kOk);
  EXPECT_EQ(call_.results[3].status.code(), Code::kResourceExhausted);
  EXPECT_EQ(call_.results[2].id.round, 2u);
  EXPECT_EQ(Get("s", 0, 0), a);
  EXPECT_EQ(Get("s", 2, 0), b);
  EXPECT_THAT(store_->ReadSegment("t1", "s", {3, 0}).status(), StatusIs(Code::kNotFound));
  EXPECT_EQ(call_.inflight, 0u);
  EXPECT_EQ(call_.segments,
            (std::vector<Code>{Code::kOk, Code::kOutOfRange, Code::kOk, Code::kResourceExhausted}));
}

// With sync_writes, a batch's commits are synced once, at the half-close, on
// a task: the call finishes after that sync.
TEST_F(UploadTest, BatchIsSyncedOnceAtTheHalfClose) {
  std::shared_ptr<FailingFs> fs = UseFailingDisk();
  options_.sync_writes = true;
  Open();
  const int before = fs->wal_syncs.load();
  auto u = MakeUpload(true);
  for (uint32_t r = 0; r < 3; ++r) {
    const std::string p = MakePayload(1000, 10 + r);
    u->OnHeader(Spec("s", r, 0, p));
    SendPayload(u.get(), p, 1000);
  }
  EXPECT_EQ(fs->wal_syncs.load(), before);
  u->OnHalfClose();
  EXPECT_EQ(u->state(), State::kSyncing);
  EXPECT_EQ(call_.finished, 0);
  call_.RunTasks();
  ASSERT_EQ(call_.finished, 1);
  KVT_EXPECT_OK(call_.status);
  EXPECT_EQ(call_.results.size(), 3u);
  EXPECT_EQ(fs->wal_syncs.load(), before + 1);
}

// A disk that fails while a large payload streams to its file: the segment
// fails with the disk's error, and everything it held is given back.
TEST_F(UploadTest, FailingDiskFailsTheSegment) {
  std::shared_ptr<FailingFs> fs = UseFailingDisk();
  Open();
  const std::string p = MakePayload(2 << 20, 7);
  auto u = MakeUpload(false);
  u->OnHeader(Spec("s", 0, 0, p));
  fs->fail = true;
  SendPayload(u.get(), p, 1 << 20);
  u->OnHalfClose();
  call_.RunTasks();
  fs->fail = false;
  ASSERT_EQ(call_.finished, 1);
  EXPECT_FALSE(call_.status.ok());
  EXPECT_EQ(call_.inflight, 0u);
  EXPECT_EQ(quota_manager_->Usage("t1").reserved_bytes, 0u);
  EXPECT_EQ(call_.segments, std::vector<Code>{call_.status.code()});
}

// The stream's own errors end the call with a precise status, once.
TEST_F(UploadTest, MalformedStreamsEndTheCall) {
  Open();
  const std::string p = MakePayload(1000, 8);
  struct Case {
    const char* name;
    bool batch;
    std::function<void(Upload*)> events;
    Code code;
    const char* message;
  };
  auto chunk = [](Upload* u, const std::string& bytes) {
    u->OnChunk(bytes.size(), [&](std::string* out) { out->append(bytes); });
  };
  const std::vector<Case> cases = {
      {"chunk first", false, [&](Upload* u) { chunk(u, "abc"); }, Code::kInvalidArgument,
       "the first PutSegment message must be the header"},
      {"no header", false, [](Upload* u) { u->OnHalfClose(); }, Code::kInvalidArgument,
       "PutSegment stream ended without a header"},
      {"empty batch", true, [](Upload* u) { u->OnHalfClose(); }, Code::kInvalidArgument,
       "PutSegments stream ended without a header"},
      {"bad header", false,
       [](Upload* u) { u->OnHeader(absl::InvalidArgumentError("not a PutSegmentHeader")); },
       Code::kInvalidArgument, "PutSegment header does not parse: not a PutSegmentHeader"},
      {"two headers", false,
       [&](Upload* u) {
         u->OnHeader(Spec("s", 0, 0, p));
         u->OnHeader(Spec("s", 0, 0, p));
       },
       Code::kInvalidArgument, "only one header is allowed per PutSegment stream"},
      {"header mid-segment", true,
       [&](Upload* u) {
         u->OnHeader(Spec("s", 0, 0, p));
         chunk(u, p.substr(0, 10));
         u->OnHeader(Spec("s", 1, 0, p));
       },
       Code::kInvalidArgument, "a header came before segment 1's last byte"},
      {"oversize", false,
       [&](Upload* u) {
         u->OnHeader(Spec("s", 0, 0, p));
         chunk(u, p + "x");
       },
       Code::kOutOfRange, "oversize stream: more than the declared"},
      {"truncated", false,
       [&](Upload* u) {
         u->OnHeader(Spec("s", 0, 0, p));
         chunk(u, p.substr(0, 10));
         u->OnHalfClose();
       },
       Code::kOutOfRange, "truncated stream: got 10 of"},
      {"truncated batch", true,
       [&](Upload* u) {
         u->OnHeader(Spec("s", 0, 0, p));
         chunk(u, p.substr(0, 10));
         u->OnHalfClose();
       },
       Code::kOutOfRange, "truncated stream: segment 1 got 10 of"},
      {"chunk too large", false,
       [&](Upload* u) {
         u->OnHeader(Spec("s", 0, 0, p));
         chunk(u, std::string((1 << 20) + 1, 'x'));
       },
       Code::kInvalidArgument, "exceeds 1048576"},
      {"neither", true,
       [&](Upload* u) {
         u->OnHeader(Spec("s", 0, 0, p));
         u->OnOtherMessage();
       },
       Code::kInvalidArgument, "neither header nor chunk"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    call_ = RecordingCall();
    auto u = MakeUpload(c.batch);
    c.events(u.get());
    call_.RunTasks();
    ASSERT_EQ(call_.finished, 1);
    EXPECT_THAT(call_.status, StatusIs(c.code, HasSubstr(c.message)));
    EXPECT_EQ(call_.inflight, 0u);
  }
  // None of them left a reservation behind: the key takes a put.
  EXPECT_EQ(quota_manager_->Usage("t1").reserved_bytes, 0u);
  call_ = RecordingCall();
  auto u = MakeUpload(false);
  u->OnHeader(Spec("s", 0, 0, p));
  SendPayload(u.get(), p, 1000);
  u->OnHalfClose();
  KVT_EXPECT_OK(call_.status);
}

TEST(UploadStateTest, EveryStateHasAName) {
  for (State s : {State::kHeader, State::kBeginning, State::kPayload, State::kSkipping,
                  State::kCommitting, State::kSyncing, State::kFailing, State::kDone}) {
    EXPECT_STRNE(UploadStateName(s), "?");
  }
}

}  // namespace
}  // namespace kvtier::cachestore
