// Uploads to a real kvtier-store process on 127.0.0.1:0: PutSegments'
// per-segment outcomes, streamed uploads that fail cleanly or commit whole,
// cancelled and capped uploads that store nothing, and idle uploads that
// cannot starve other tenants.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "base/version.h"
#include "client/store_client.h"
#include "encoded/encoded_tensor.h"
#include "gmock/gmock.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "kernels/crc32c.h"
#include "testing/store_process.h"
#include "testing/test_util.h"
#include "tests/util/grpc_health.h"
#include "tests/util/raw_unary.h"
#include "tests/util/status_matchers.h"
#include "tests/util/store_stack_fixture.h"

namespace kvtier {
namespace {

using ::kvtier::testing::IsOk;
using ::kvtier::testing::MakePayload;
using ::kvtier::testing::StatusIs;
using ::kvtier::testing::StoreProcess;
using ::kvtier::testing::TempDir;
using ::testing::HasSubstr;
using Code = absl::StatusCode;
using ::kvtier::store_test::kAliceReader;
using ::kvtier::store_test::kAliceToken;
using ::kvtier::store_test::kBobToken;
using ::kvtier::store_test::kCarolToken;
using ::kvtier::store_test::StoreIntegrationTest;

TEST_F(StoreIntegrationTest, PutSegmentsStoresEachSegmentWithItsOwnStatus) {
  StartStore({"--max_segment_mb=4"});
  const std::string small = MakePayload(5000, 1);
  const std::string file = MakePayload(400 << 10, 2, 2);  // Over 256 KiB: a payload file.
  const std::string big = MakePayload(3 << 20, 3);        // Several chunks.
  const std::string too_big = MakePayload(5 << 20, 4);
  v1::SegmentPayload flipped;
  ASSERT_TRUE(flipped.ParseFromString(MakePayload(6000, 5)));
  (*flipped.mutable_tensors(0)->mutable_buffers(0)->mutable_data())[7] ^= 0x10;
  const std::string corrupt = flipped.SerializeAsString();
  const std::string after = MakePayload(7000, 6);
  std::vector<PutSegmentsItem> items = {
      {Args("s", 0, 0), small},         {Args("s", 0, 1), file}, {Args("s", 1, 0), big},
      {Args("s", 0, 0), after},          // ALREADY_EXISTS (the first item)
      {Args("s", 2, 0), corrupt},        // DATA_LOSS at its commit
      {Args("bad name!", 3, 0), small},  // INVALID_ARGUMENT at its header
      {Args("s", 4, 0), too_big},        // OUT_OF_RANGE at its header; 5 chunks dropped
      {Args("t", 0, 0), after},
  };
  auto results = alice_->PutSegments(items);
  ASSERT_THAT(results, IsOk());
  ASSERT_EQ(results->size(), items.size());
  const std::vector<Code> want = {Code::kOk,         Code::kOk,
                                  Code::kOk,         Code::kAlreadyExists,
                                  Code::kDataLoss,   Code::kInvalidArgument,
                                  Code::kOutOfRange, Code::kOk};
  for (size_t i = 0; i < items.size(); ++i) {
    EXPECT_EQ((*results)[i].status().code(), want[i])
        << "item " << i << ": " << (*results)[i].status();
  }
  EXPECT_EQ((*results)[1]->segment().payload_bytes(), file.size());
  EXPECT_EQ((*results)[2]->charged_bytes(), big.size());
  EXPECT_EQ(Stats().tenant_bytes(), small.size() + file.size() + big.size() + after.size());
  auto got = alice_->GetSegments("s", {Ref(0, 0), Ref(0, 1), Ref(1, 0)});
  ASSERT_THAT(got, IsOk());
  EXPECT_TRUE((*got)[0].payload == small);
  EXPECT_TRUE((*got)[1].payload == file);
  EXPECT_TRUE((*got)[2].payload == big);
  EXPECT_THAT(alice_->GetSegments("s", {Ref(2, 0)}), StatusIs(Code::kNotFound));

  // Many small segments, most committed on the callback thread.
  std::vector<std::string> many;
  std::vector<PutSegmentsItem> batch;
  for (uint32_t r = 0; r < 300; ++r) many.push_back(MakePayload(3000 + r, 100 + r));
  for (uint32_t r = 0; r < 300; ++r) batch.push_back({Args("m", r), many[r]});
  auto all = alice_->PutSegments(batch);
  ASSERT_THAT(all, IsOk());
  for (const auto& r : *all) ASSERT_THAT(r.status(), IsOk());
  auto listed = alice_->ListRounds("m");
  ASSERT_THAT(listed, IsOk());
  EXPECT_EQ(listed->rounds_size(), 300);

  // Per segment: a quota that fills, and a reader's token for the whole call.
  auto carol = Client(kCarolToken);
  const std::string c1 = MakePayload(60'000, 7), c2 = MakePayload(60'000, 8);
  auto quota = carol->PutSegments({{Args("c", 0), c1}, {Args("c", 1), c2}});
  ASSERT_THAT(quota, IsOk());
  EXPECT_THAT((*quota)[0], IsOk());
  EXPECT_THAT((*quota)[1].status(), StatusIs(Code::kResourceExhausted));
  EXPECT_THAT(Client(kAliceReader)->PutSegments({{Args("s", 9), small}}).status(),
              StatusIs(Code::kPermissionDenied));
  EXPECT_THAT(alice_->PutSegments({}).status(), StatusIs(Code::kInvalidArgument));

  // Errors of the stream: each ends the call with its own status; the
  // segments before the error stay stored.
  const std::string x = MakePayload(4000, 9);
  EXPECT_THAT(RawPuts({}), StatusIs(Code::kInvalidArgument, HasSubstr("without a header")));
  EXPECT_THAT(RawPuts({Chunk(x)}), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(RawPuts({Header("u", 0, x), Chunk(x), Chunk("y")}),
              StatusIs(Code::kInvalidArgument, HasSubstr("must be a header")));
  EXPECT_THAT(RawPuts({Header("u", 1, x), Chunk(x.substr(0, 10)), Header("u", 2, x)}),
              StatusIs(Code::kInvalidArgument, HasSubstr("before segment 1's last byte")));
  EXPECT_THAT(RawPuts({Header("u", 3, x), Chunk(x + "z")}),
              StatusIs(Code::kOutOfRange, HasSubstr("oversize")));
  EXPECT_THAT(RawPuts({Header("u", 4, x), Chunk(x), Header("u", 5, x), Chunk(x.substr(0, 100))}),
              StatusIs(Code::kOutOfRange, HasSubstr("truncated stream: segment 2")));
  v1::PutSegmentRequest refused = Header("bad name!", 6, x);
  EXPECT_THAT(RawPuts({refused, Chunk(x.substr(0, 100)), Chunk(x)}),
              StatusIs(Code::kOutOfRange, HasSubstr("oversize")));
  EXPECT_THAT(RawPuts({refused, Chunk(x.substr(0, 100))}),
              StatusIs(Code::kOutOfRange, HasSubstr("truncated")));
  auto u = alice_->ListRounds("u");
  ASSERT_THAT(u, IsOk());
  std::vector<uint32_t> rounds;
  for (const auto& r : u->rounds()) rounds.push_back(r.round());
  EXPECT_THAT(rounds, ::testing::ElementsAre(0, 4));
  // Over 4096 headers (each refused: a zero size) is refused as a whole.
  v1::PutSegmentRequest empty = Header("u", 7, "");
  std::vector<v1::PutSegmentRequest> headers(4097, empty);
  v1::PutSegmentsResponse resp;
  EXPECT_THAT(
      RawPuts(std::vector<v1::PutSegmentRequest>(headers.begin(), headers.end() - 1), &resp),
      IsOk());
  EXPECT_EQ(resp.results_size(), 4096);
  EXPECT_EQ(resp.results(4095).code(), static_cast<int>(Code::kOutOfRange));
  EXPECT_THAT(RawPuts(headers), StatusIs(Code::kInvalidArgument, HasSubstr("at most 4096")));

  // Nothing is left reserved, and what was acknowledged survives kill -9.
  auto stats = Stats();
  EXPECT_EQ(
      stats.tenant_bytes(), small.size() + file.size() + big.size() + after.size() + [&] {
        uint64_t n = 0;
        for (const auto& m : many) n += m.size();
        return n;
      }() + 2 * x.size());
  store_->Kill();
  ASSERT_THAT(store_->Start(), IsOk());
  auto back = Client(kAliceToken)->GetSegments("s", {Ref(0, 1), Ref(1, 0)});
  ASSERT_THAT(back, IsOk());
  EXPECT_TRUE((*back)[0].payload == file);
  EXPECT_TRUE((*back)[1].payload == big);
}

// Issue 18: a payload over 256 KiB is written to its file as its chunks
// arrive. A stream that fails after some were written (truncated, oversize,
// corrupt, cancelled) stores nothing and leaves no file behind; one that
// completes reads back bit-exact, also after a restart.
TEST_F(StoreIntegrationTest, StreamedUploadsFailCleanlyAndCommitWhole) {
  StartStore();
  const std::string p = MakePayload(6 << 20, 7);
  auto chunks = [&](size_t bytes) {
    std::vector<v1::PutSegmentRequest> out;
    for (size_t at = 0; at < bytes; at += 1 << 20) {
      out.push_back(Chunk(p.substr(at, std::min<size_t>(1 << 20, bytes - at))));
    }
    return out;
  };
  auto with_header = [&](v1::PutSegmentRequest h, std::vector<v1::PutSegmentRequest> body) {
    body.insert(body.begin(), std::move(h));
    return body;
  };
  const std::string payloads = dir_.path() + "/db/payloads";
  // Payload files that hold bytes (the store keeps empty spares ready). The
  // store removes files while this looks (the loop below polls as it tears
  // an upload down): a file gone between the listing and its size is not
  // counted, rather than thrown as an exception that fails the test.
  auto files = [&] {
    int n = 0;
    std::error_code ec;
    for (auto it = std::filesystem::recursive_directory_iterator(payloads, ec);
         !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
      std::error_code gone;
      const bool regular = it->is_regular_file(gone);
      const uintmax_t size = regular ? it->file_size(gone) : 0;
      n += !gone && regular && size > 0 ? 1 : 0;
    }
    return n;
  };
  EXPECT_THAT(RawPut(with_header(Header("s", 0, p), chunks(5 << 20))),
              StatusIs(Code::kOutOfRange, HasSubstr("truncated")));
  auto oversize = with_header(Header("s", 0, p), chunks(p.size()));
  oversize.push_back(Chunk("x"));
  EXPECT_THAT(RawPut(oversize), StatusIs(Code::kOutOfRange, HasSubstr("oversize")));
  v1::PutSegmentRequest bad_crc = Header("s", 0, p);
  bad_crc.mutable_header()->set_payload_crc32c(bad_crc.header().payload_crc32c() ^ 1);
  EXPECT_THAT(RawPut(with_header(bad_crc, chunks(p.size()))), StatusIs(Code::kDataLoss));
  {
    auto c = Client(kAliceToken);
    auto ctx = c->NewContext();
    v1::PutSegmentResponse resp;
    auto w = c->stub()->PutSegment(ctx.get(), &resp);
    ASSERT_TRUE(w->Write(Header("s", 0, p)));
    w->WaitForInitialMetadata();
    for (const auto& m : chunks(3 << 20)) {
      if (!w->Write(m)) {
        const grpc::Status st = w->Finish();
        std::ifstream log(store_->log_path());
        std::string all((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
        FAIL() << "the store ended the upload: " << st.error_code() << " " << st.error_message()
               << "\n"
               << all.substr(all.size() > 3000 ? all.size() - 3000 : 0);
      }
    }
    ctx->TryCancel();
    EXPECT_EQ(w->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  // The store tears a cancelled upload down after the client hears of it:
  // the round, then its file, then the quota it held, each a moment apart.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((files() != 0 || alice_->ListRounds("s").ok() || Stats().tenant_bytes() != 0) &&
         std::chrono::steady_clock::now() < deadline) {
    // Timed: the store process tears the upload down after the client hears of it.
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(files(), 0);
  EXPECT_THAT(alice_->ListRounds("s"), StatusIs(Code::kNotFound));
  EXPECT_EQ(Stats().tenant_bytes(), 0u);

  ASSERT_THAT(alice_->PutSegment(Args("s", 0), p), IsOk());
  EXPECT_EQ(files(), 1);
  store_->Kill();  // kill -9: what was acknowledged must be there.
  ASSERT_THAT(store_->Start(), IsOk());
  auto got = Client(kAliceToken)->GetSegments("s", {Ref(0)});
  ASSERT_THAT(got, IsOk());
  EXPECT_TRUE((*got)[0].payload == p);
}

TEST_F(StoreIntegrationTest, CancelledAndCappedUploadsStoreNothing) {
  // Four tenants may write: each has 1 MiB of the 4 MiB in flight.
  StartStore({"--max_inflight_upload_mb=4"});
  const std::string p = MakePayload(700'000, 1);
  // An upload that stalls after its first chunk holds 700 KB of the 1 MiB cap.
  auto c = Client(kAliceToken);
  auto ctx = c->NewContext();
  v1::PutSegmentResponse resp;
  auto stalled = c->stub()->PutSegment(ctx.get(), &resp);
  ASSERT_TRUE(stalled->Write(Header("s", 0, p)));
  stalled->WaitForInitialMetadata();  // The store accepted the header.
  ASSERT_TRUE(stalled->Write(Chunk(p.substr(0, 100'000))));
  EXPECT_THAT(alice_->PutSegment(Args("other", 0), MakePayload(500'000, 2)),
              StatusIs(Code::kResourceExhausted, HasSubstr("its share")));
  // Her share is hers alone: bob's upload of the same size goes through.
  EXPECT_THAT(Client(kBobToken)->PutSegment(Args("other", 0), MakePayload(500'000, 2)), IsOk());
  ctx->TryCancel();
  EXPECT_EQ(stalled->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The client sees CANCELLED before the store has torn the upload down; the
  // store must get there, so wait for it (bounded) rather than race it.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((alice_->ListRounds("s").ok() || Stats().tenant_bytes() != 0) &&
         std::chrono::steady_clock::now() < deadline) {
    // Timed: the store process tears the cancelled upload down on its own threads.
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_THAT(alice_->ListRounds("s"), StatusIs(Code::kNotFound));
  EXPECT_EQ(Stats().tenant_bytes(), 0u);
}

// Issue 14 #1: eight uploads that send a header and then nothing used to
// fill the shared in-flight budget and refuse every tenant's puts. Now a
// tenant gets only its share (RESOURCE_EXHAUSTED names it), the others put
// at once, and idle uploads are cancelled and refunded.
TEST_F(StoreIntegrationTest, IdleUploadsCannotStarveOtherTenants) {
  StartStore({"--max_inflight_upload_mb=8", "--upload_idle_timeout_ms=2000"});
  const absl::Time t0 = absl::Now();
  auto c = Client(kAliceToken);
  struct Stalled {
    std::unique_ptr<grpc::ClientContext> ctx;
    v1::PutSegmentResponse resp;
    std::unique_ptr<grpc::ClientWriter<v1::PutSegmentRequest>> w;
  };
  std::vector<Stalled> stalled(8);
  for (int i = 0; i < 8; ++i) {
    stalled[i].ctx = c->NewContext(CallOptions::Within(absl::Seconds(30)));
    stalled[i].w = c->stub()->PutSegment(stalled[i].ctx.get(), &stalled[i].resp);
    ASSERT_TRUE(
        stalled[i].w->Write(Header("idle-" + std::to_string(i), 0, MakePayload(1 << 20, i))));
    stalled[i].w->WaitForInitialMetadata();
  }
  // While alice's uploads still hold her share, bob and carol put at once.
  EXPECT_THAT(Client(kBobToken)->PutSegment(Args("b", 0), MakePayload(1 << 20, 10)), IsOk());
  EXPECT_THAT(Client(kCarolToken)->PutSegment(Args("c", 0), MakePayload(50'000, 11)), IsOk());
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2)) << "too slow to tell; the idle timeout passed";
  int admitted = 0, refused = 0;
  for (Stalled& st : stalled) {
    const grpc::Status s = st.w->Finish();
    if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      EXPECT_THAT(s.error_message(), HasSubstr("its share"));
      ++refused;
    } else {
      // The store ended the idle upload after its timeout, and says so.
      EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
      EXPECT_THAT(s.error_message(), HasSubstr("upload idle for 2s"));
      EXPECT_GE(absl::Now() - t0, absl::Milliseconds(1900));
      ++admitted;
    }
  }
  EXPECT_EQ(admitted, 2);  // 2 MiB of her 8 MiB / 4 tenants.
  EXPECT_EQ(refused, 6);
  // The idle uploads' share came back before their callers heard the
  // status (the store refunds, then finishes the call), and they stored
  // nothing.
  EXPECT_THAT(alice_->PutSegment(Args("after", 0), MakePayload(1 << 20, 12)), IsOk());
  EXPECT_THAT(alice_->ListRounds("idle-0"), StatusIs(Code::kNotFound));
}

}  // namespace
}  // namespace kvtier
