// Integration tests against a real kvtier-store process on 127.0.0.1:0.
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
using ::kvtier::store_test::kNodeToken;
using ::kvtier::store_test::StoreIntegrationTest;

// GetSegments with missing_ok answers a segment the store does not hold in
// its place, flagged, in the same call; without it the call is NOT_FOUND;
// an unknown session is NOT_FOUND either way. The missing ones come batched,
// beside a large segment sent as a header and chunks.
TEST_F(StoreIntegrationTest, MissingSegmentsAnswerInTheirPlace) {
  StartStore();
  const std::string small = MakePayload(2000, 1), large = MakePayload(3 << 20, 2);
  ASSERT_THAT(alice_->PutSegment(Args("s", 0), small), IsOk());
  ASSERT_THAT(alice_->PutSegment(Args("s", 2), large), IsOk());
  const std::vector<v1::SegmentRef> refs = {Ref(0), Ref(1), Ref(2), Ref(2, 1)};
  EXPECT_THAT(alice_->GetSegments("s", refs), StatusIs(Code::kNotFound));
  auto got = alice_->GetSegments("s", refs, {}, /*uncounted=*/false, /*missing_ok=*/true);
  ASSERT_THAT(got, IsOk());
  ASSERT_EQ(got->size(), 4u);
  EXPECT_FALSE((*got)[0].missing);
  EXPECT_EQ((*got)[0].payload, small);
  EXPECT_TRUE((*got)[1].missing);
  EXPECT_EQ((*got)[1].info.ref().round(), 1u);
  EXPECT_TRUE((*got)[1].payload.empty());
  EXPECT_FALSE((*got)[2].missing);
  EXPECT_EQ((*got)[2].payload, large);
  EXPECT_TRUE((*got)[3].missing);
  EXPECT_EQ((*got)[3].info.ref().segment(), 1u);
  EXPECT_THAT(alice_->GetSegments("nobody", refs, {}, false, /*missing_ok=*/true),
              StatusIs(Code::kNotFound));
}

TEST_F(StoreIntegrationTest, RoundTripsFrom1KiBTo64MiBInOneBatchedCall) {
  StartStore();
  const std::vector<uint64_t> sizes = {1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20};
  std::vector<std::string> payloads;
  std::vector<v1::SegmentRef> refs;
  for (size_t i = 0; i < sizes.size(); ++i) {
    payloads.push_back(MakePayload(sizes[i], i));
    auto r = alice_->PutSegment(Args("big", i), payloads.back());
    ASSERT_THAT(r, IsOk());
    EXPECT_EQ(r->segment().payload_bytes(), payloads.back().size());
    refs.push_back(Ref(i));
  }
  auto got = alice_->GetSegments("big", refs);
  ASSERT_THAT(got, IsOk());
  ASSERT_EQ(got->size(), sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ((*got)[i].info.ref().round(), i);
    EXPECT_TRUE((*got)[i].payload == payloads[i]) << "segment " << i << " differs";
    EXPECT_THAT(ParseAndValidatePayload((*got)[i].payload), IsOk());
  }
  auto list = alice_->ListRounds("big");
  ASSERT_THAT(list, IsOk());
  ASSERT_EQ(list->rounds_size(), 5);
  EXPECT_EQ(list->rounds(4).summary().recall_count(), 1u);
}

// A client that accepts batches gets segments up to 256 KiB whole, several
// to a message, in request order among larger ones and ones read from disk;
// a client that does not (the default of the raw request) gets a header and
// chunks per segment, as before batches existed.
TEST_F(StoreIntegrationTest, SmallSegmentsComeBatchedInRequestOrder) {
  StartStore({"--ram_budget_mb=1"});
  const std::vector<uint64_t> sizes = {4 << 10,  64 << 10, 300 << 10, 1 << 10,  200 << 10,
                                       2 << 20,  8 << 10,  256 << 10, 16 << 10, 100 << 10,
                                       32 << 10, 1000,     48 << 10,  5 << 10};
  std::vector<std::string> payloads;
  std::vector<v1::SegmentRef> refs;
  for (size_t i = 0; i < sizes.size(); ++i) {
    payloads.push_back(MakePayload(sizes[i], static_cast<int>(i) + 1));
    ASSERT_THAT(alice_->PutSegment(Args("mixed", static_cast<uint32_t>(i)), payloads.back()),
                IsOk());
    refs.push_back(Ref(static_cast<uint32_t>(i)));
  }
  // A 1 MiB RAM tier: the first segments were spilled and are read from
  // disk, in between ones in RAM.
  auto got = alice_->GetSegments("mixed", refs);
  ASSERT_THAT(got, IsOk());
  ASSERT_EQ(got->size(), sizes.size());
  int from_disk = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ((*got)[i].info.ref().round(), i);
    EXPECT_TRUE((*got)[i].payload == payloads[i]) << "segment " << i << " differs";
    from_disk += (*got)[i].served_from == v1::TIER_DISK ? 1 : 0;
  }
  EXPECT_GE(from_disk, 3);

  // The messages themselves, both ways.
  auto messages = [&](bool batches) {
    auto c = Client(kAliceToken);
    auto ctx = c->NewContext();
    v1::GetSegmentsRequest req;
    req.set_session_id("mixed");
    for (const auto& r : refs) *req.add_refs() = r;
    req.set_accept_batches(batches);
    auto reader = c->stub()->GetSegments(ctx.get(), req);
    std::map<v1::GetSegmentsResponse::MsgCase, int> count;
    std::vector<uint32_t> order;  // Rounds as they start.
    std::string bytes;            // Every payload byte, in order.
    v1::GetSegmentsResponse m;
    while (reader->Read(&m)) {
      ++count[m.msg_case()];
      if (m.has_header()) order.push_back(m.header().segment().ref().round());
      if (m.has_chunk()) bytes += m.chunk();
      for (const auto& item : m.batch().segments()) {
        order.push_back(item.header().segment().ref().round());
        EXPECT_EQ(item.payload().size(), item.header().segment().payload_bytes());
        bytes += item.payload();
      }
    }
    EXPECT_TRUE(reader->Finish().ok());
    std::vector<uint32_t> want(sizes.size());
    for (size_t i = 0; i < want.size(); ++i) want[i] = static_cast<uint32_t>(i);
    EXPECT_EQ(order, want);
    std::string all;
    for (const std::string& p : payloads) all += p;
    EXPECT_TRUE(bytes == all);
    return count;
  };
  auto plain = messages(false);
  EXPECT_EQ(plain[v1::GetSegmentsResponse::kHeader], static_cast<int>(sizes.size()));
  EXPECT_EQ(plain[v1::GetSegmentsResponse::kBatch], 0);
  auto batched = messages(true);
  // Two segments are over 256 KiB: a header and chunks each. The other
  // twelve (under 1 MiB together) come in batches, split where a larger
  // segment or a read from disk falls between them.
  EXPECT_EQ(batched[v1::GetSegmentsResponse::kHeader], 2);
  EXPECT_GE(batched[v1::GetSegmentsResponse::kBatch], 1);
  EXPECT_LE(batched[v1::GetSegmentsResponse::kBatch], 9);
}

TEST_F(StoreIntegrationTest, ManyConcurrentSessions) {
  StartStore();
  constexpr int kThreads = 8, kSessionsPerThread = 6, kRounds = 4;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto c = Client(kAliceToken);
      for (int s = 0; s < kSessionsPerThread; ++s) {
        std::string session = "chat-" + std::to_string(t) + "-" + std::to_string(s);
        for (int r = 0; r < kRounds; ++r) {
          for (uint32_t seg = 0; seg < 2; ++seg) {
            std::string p =
                MakePayload(20'000 + 1000 * r, t * 1000 + s * 10 + r * 2 + seg, seg == 0 ? 0 : 2);
            if (!c->PutSegment(Args(session, r, seg), p).ok()) ++failures;
          }
        }
        std::vector<v1::SegmentRef> refs;
        for (int r = 0; r < kRounds; ++r) refs.push_back(Ref(r, 1));
        auto got = c->GetSegments(session, refs);
        if (!got.ok()) {
          ++failures;
          continue;
        }
        for (int r = 0; r < kRounds; ++r) {
          if ((*got)[r].payload !=
              MakePayload(20'000 + 1000 * r, t * 1000 + s * 10 + r * 2 + 1, 2)) {
            ++failures;
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  v1::StatsResponse st = Stats();
  EXPECT_EQ(st.sessions(), uint64_t{kThreads * kSessionsPerThread});
  EXPECT_EQ(st.tiers(1).segments(), uint64_t{kThreads * kSessionsPerThread * kRounds * 2});
}

TEST_F(StoreIntegrationTest, RamOverflowSpillsToRocksDbAndComesBack) {
  StartStore({"--ram_budget_mb=1", "--promote_after_reads=2"});
  std::vector<std::string> payloads;
  for (int r = 0; r < 8; ++r) {
    payloads.push_back(MakePayload(300 << 10, r));
    ASSERT_THAT(alice_->PutSegment(Args("s", r), payloads.back()), IsOk());
  }
  v1::StatsResponse st = Stats();
  EXPECT_LE(st.tiers(0).bytes(), 1u << 20);
  EXPECT_GE(st.spills(), 5u);
  EXPECT_EQ(st.tiers(1).segments(), 8u);
  auto list = alice_->ListRounds("s");
  ASSERT_THAT(list, IsOk());
  EXPECT_EQ(list->rounds(0).segments(0).state(), v1::SEGMENT_STATE_SPILLED);
  EXPECT_EQ(list->rounds(7).segments(0).state(), v1::SEGMENT_STATE_SEALED);

  // Round 0 is read from disk twice, then served from RAM.
  for (v1::Tier want : {v1::TIER_DISK, v1::TIER_DISK, v1::TIER_RAM}) {
    auto got = alice_->GetSegments("s", {Ref(0)});
    ASSERT_THAT(got, IsOk());
    EXPECT_EQ((*got)[0].served_from, want);
    EXPECT_TRUE((*got)[0].payload == payloads[0]);
  }
  std::vector<v1::SegmentRef> all;
  for (int r = 0; r < 8; ++r) all.push_back(Ref(r));
  auto got = alice_->GetSegments("s", all);
  ASSERT_THAT(got, IsOk());
  for (int r = 0; r < 8; ++r) EXPECT_TRUE((*got)[r].payload == payloads[r]) << r;
  st = Stats();
  EXPECT_GE(st.promotions(), 1u);
  EXPECT_GE(st.hits_disk(), 2u);
}

TEST_F(StoreIntegrationTest, BadInputGetsPreciseStatusAndChangesNothing) {
  StartStore({"--max_segment_mb=1"});
  const std::string good = MakePayload(5000, 1);
  ASSERT_THAT(alice_->PutSegment(Args("s", 0), good), IsOk());
  const v1::StatsResponse before = Stats();

  // INVALID_ARGUMENT: names, layer range, missing header, unparsable bytes, bad shape.
  EXPECT_THAT(alice_->PutSegment(Args("bad name!", 1), good), StatusIs(Code::kInvalidArgument));
  PutSegmentArgs bad_layers = Args("s", 1);
  bad_layers.layer_begin = 3;
  bad_layers.layer_end = 2;
  EXPECT_THAT(alice_->PutSegment(bad_layers, good), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(RawPut({Chunk(good)}), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(RawPut({Header("s", 1, good), Header("s", 1, good)}),
              StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(alice_->PutSegment(Args("s", 1), std::string(4000, '\x07')),
              StatusIs(Code::kInvalidArgument));
  v1::SegmentPayload shaped;
  ASSERT_TRUE(shaped.ParseFromString(good));
  shaped.mutable_tensors(0)->set_shape(0, shaped.tensors(0).shape(0) + 1);
  EXPECT_THAT(alice_->PutSegment(Args("s", 1), shaped.SerializeAsString()),
              StatusIs(Code::kInvalidArgument));
  // Issue 14 #7: a tensor outside the segment's layers [0, 2) is refused.
  v1::SegmentPayload far;
  ASSERT_TRUE(far.ParseFromString(good));
  far.mutable_tensors(0)->set_layer_begin(1'000'000'000);
  EXPECT_THAT(alice_->PutSegment(Args("s", 1), far.SerializeAsString()),
              StatusIs(Code::kInvalidArgument, HasSubstr("outside the segment's layers")));
  // ...and so is a round outside [0, 2^31) in DropRounds.
  EXPECT_THAT(alice_->DropRounds("s", {1u << 31}), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(alice_->GetSegments("s", {}), StatusIs(Code::kInvalidArgument));

  // DATA_LOSS: the header's checksum, and a tensor's own checksum.
  v1::PutSegmentRequest h = Header("s", 1, good);
  h.mutable_header()->set_payload_crc32c(h.header().payload_crc32c() ^ 1);
  EXPECT_THAT(RawPut({h, Chunk(good)}), StatusIs(Code::kDataLoss));
  v1::SegmentPayload flipped;
  ASSERT_TRUE(flipped.ParseFromString(good));
  (*flipped.mutable_tensors(0)->mutable_buffers(0)->mutable_data())[7] ^= 0x10;
  EXPECT_THAT(alice_->PutSegment(Args("s", 1), flipped.SerializeAsString()),
              StatusIs(Code::kDataLoss));

  // OUT_OF_RANGE: truncated, oversize, and over the store's max segment size.
  EXPECT_THAT(RawPut({Header("s", 1, good), Chunk(good.substr(0, 100))}),
              StatusIs(Code::kOutOfRange));
  EXPECT_THAT(RawPut({Header("s", 1, good), Chunk(good), Chunk("x")}), StatusIs(Code::kOutOfRange));
  EXPECT_THAT(alice_->PutSegment(Args("s", 1), MakePayload(2 << 20, 3)),
              StatusIs(Code::kOutOfRange));
  // A declared size of 2^64 - 1 is out of range, not merely too much now.
  v1::PutSegmentRequest huge = Header("s", 1, good);
  huge.mutable_header()->set_payload_bytes(~uint64_t{0});
  EXPECT_THAT(RawPut({huge}), StatusIs(Code::kOutOfRange));

  // ALREADY_EXISTS.
  EXPECT_THAT(alice_->PutSegment(Args("s", 0), MakePayload(5000, 9)),
              StatusIs(Code::kAlreadyExists));

  // NOT_FOUND.
  EXPECT_THAT(alice_->GetSegments("nope", {Ref(0)}), StatusIs(Code::kNotFound));
  EXPECT_THAT(alice_->GetSegments("s", {Ref(0), Ref(3)}), StatusIs(Code::kNotFound));
  EXPECT_THAT(alice_->ListRounds("nope"), StatusIs(Code::kNotFound));
  EXPECT_THAT(alice_->DeleteSession("nope"), StatusIs(Code::kNotFound));
  EXPECT_THAT(alice_->RecordRecalls("s", {}), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(alice_->RecordRecalls("nope", {0}), StatusIs(Code::kNotFound));

  // UNAUTHENTICATED and PERMISSION_DENIED.
  EXPECT_THAT(Client("")->ListRounds("s"), StatusIs(Code::kUnauthenticated));
  EXPECT_THAT(Client("wrong-token-123")->PutSegment(Args("s", 1), good),
              StatusIs(Code::kUnauthenticated));
  auto reader = Client(kAliceReader);
  EXPECT_THAT(reader->PutSegment(Args("s", 1), good), StatusIs(Code::kPermissionDenied));
  EXPECT_THAT(reader->DeleteSession("s"), StatusIs(Code::kPermissionDenied));
  EXPECT_THAT(reader->DropRounds("s", {0}), StatusIs(Code::kPermissionDenied));
  EXPECT_THAT(reader->DropSegments("s", {Ref(0)}), StatusIs(Code::kPermissionDenied));
  EXPECT_THAT(reader->RecordRecalls("s", {0}), StatusIs(Code::kPermissionDenied));
  EXPECT_THAT(reader->ListRounds("s"), IsOk());  // Reading is allowed.

  // RESOURCE_EXHAUSTED: carol's quota is 100000 bytes.
  auto carol = Client(kCarolToken);
  ASSERT_THAT(carol->PutSegment(Args("c", 0), MakePayload(60'000, 4)), IsOk());
  EXPECT_THAT(carol->PutSegment(Args("c", 1), MakePayload(60'000, 5)),
              StatusIs(Code::kResourceExhausted));

  // Nothing above changed alice's data.
  const v1::StatsResponse after = Stats();
  EXPECT_EQ(after.tenant_bytes(), before.tenant_bytes());
  auto list = alice_->ListRounds("s");
  ASSERT_THAT(list, IsOk());
  ASSERT_EQ(list->rounds_size(), 1);
  auto got = alice_->GetSegments("s", {Ref(0)});
  ASSERT_THAT(got, IsOk());
  EXPECT_TRUE((*got)[0].payload == good);
}

// Issue 18: several segments in one call, each stored (or refused) exactly as
// its own PutSegment would be; errors of the stream itself end the call.
// Bytes that do not parse, on every unary method: INVALID_ARGUMENT naming
// the message that did not parse (gRPC's own handler answered UNIMPLEMENTED
// with no details); an unauthenticated caller still hears UNAUTHENTICATED
// first.
TEST_F(StoreIntegrationTest, UnparseableRequestsAreInvalidArgumentOnEveryMethod) {
  StartStore();
  const std::string garbage("\xff\xff\xff\xff\x0f\x01\x02", 7);
  for (const char* m : {"ListRounds", "DropRounds", "DropSegments", "RecordRecalls",
                        "DeleteSession", "PinSession", "ListSessions", "Stats"}) {
    const std::string method = absl::StrCat("/kvtier.v1.Store/", m);
    const grpc::Status st = testing::RawUnary(alice_->channel(), method, garbage, kAliceToken);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << m;
    EXPECT_THAT(st.error_message(), HasSubstr("does not parse as kvtier.v1.")) << m;
    EXPECT_EQ(testing::RawUnary(alice_->channel(), method, garbage).error_code(),
              grpc::StatusCode::UNAUTHENTICATED)
        << m;
  }
}

// Issue 14 #10: one GetSegments naming one segment 4,096 times used to
// stream 4,096 copies. Duplicate refs are INVALID_ARGUMENT, and a call's
// bytes are capped (OUT_OF_RANGE before a byte is sent), readonly or not.
TEST_F(StoreIntegrationTest, ReadAmplificationIsRefused) {
  StartStore({"--max_get_mb=1"});
  ASSERT_THAT(alice_->PutSegment(Args("s", 0), MakePayload(700'000, 1)), IsOk());
  ASSERT_THAT(alice_->PutSegment(Args("s", 1), MakePayload(700'000, 2)), IsOk());
  auto reader = Client(kAliceReader);
  std::vector<v1::SegmentRef> same(4096, Ref(0));
  EXPECT_THAT(reader->GetSegments("s", same), StatusIs(Code::kInvalidArgument, HasSubstr("twice")));
  EXPECT_THAT(reader->GetSegments("s", {Ref(0), Ref(1)}),
              StatusIs(Code::kOutOfRange, HasSubstr("split the call")));
  EXPECT_THAT(reader->GetSegments("s", {Ref(1)}), IsOk());
  // The refused calls counted no recall.
  auto list = alice_->ListRounds("s");
  ASSERT_THAT(list, IsOk());
  EXPECT_EQ(list->rounds(0).segments(0).recall_count(), 0u);
  EXPECT_EQ(list->rounds(1).segments(0).recall_count(), 1u);
}

// A node token may act for an end tenant (kvtier-tenant metadata): the call
// uses that tenant's keys and quota. Any other token naming a tenant is
// PERMISSION_DENIED.
TEST_F(StoreIntegrationTest, OnlyNodesActForOtherTenants) {
  StartStore();
  const std::string p = MakePayload(3000, 1);
  ASSERT_THAT(alice_->PutSegment(Args("conv", 0), p), IsOk());
  CallOptions as_alice;
  as_alice.tenant = "alice";
  EXPECT_THAT(Client(kBobToken)->ListRounds("conv", as_alice),
              StatusIs(Code::kPermissionDenied, HasSubstr("not a node")));
  auto node = Client(kNodeToken);
  EXPECT_THAT(node->ListRounds("conv"), StatusIs(Code::kNotFound));  // node1's own.
  EXPECT_THAT(node->ListRounds("conv", as_alice), IsOk());
  // carol's quota (100000 bytes) holds for writes a node makes for her.
  CallOptions as_carol;
  as_carol.tenant = "carol";
  EXPECT_THAT(node->PutSegment(Args("c", 0), MakePayload(60'000, 2), as_carol), IsOk());
  EXPECT_THAT(node->PutSegment(Args("c", 1), MakePayload(60'000, 3), as_carol),
              StatusIs(Code::kResourceExhausted));
  CallOptions bad;
  bad.tenant = "no/slashes";
  EXPECT_THAT(node->ListRounds("conv", bad), StatusIs(Code::kInvalidArgument));
}

// Issue 14 #9: sessions nobody closes (a killed worker's) no longer stay
// forever: without a TTL of their own they take the store's default; an
// explicit 0 still means never. `kvtier store gc` removes idle ones now.
TEST_F(StoreIntegrationTest, OrphansExpireAndGcRemovesIdleSessions) {
  StartStore({"--default_ttl_seconds=2", "--ttl_sweep_seconds=1"});
  ASSERT_THAT(alice_->PutSegment(Args("orphan", 0), MakePayload(2000, 1)), IsOk());
  PutSegmentArgs forever = Args("forever", 0);
  forever.session_ttl_seconds = 0;
  ASSERT_THAT(alice_->PutSegment(forever, MakePayload(2000, 2)), IsOk());
  // Stats, unlike ListRounds, touches no session.
  const absl::Time deadline = absl::Now() + absl::Seconds(15);
  while (Stats().expired_sessions() == 0 && absl::Now() < deadline) {
    // Timed: the store process's expiry thread runs on its real clock.
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(Stats().expired_sessions(), 1u);
  EXPECT_THAT(alice_->ListRounds("orphan"), StatusIs(Code::kNotFound));
  EXPECT_THAT(alice_->ListRounds("forever"), IsOk());

  // gc: the CLI as an operator runs it.
  PutSegmentArgs pinned = Args("pinned", 0);
  pinned.session_ttl_seconds = 0;
  ASSERT_THAT(alice_->PutSegment(pinned, MakePayload(2000, 3)), IsOk());
  ASSERT_THAT(alice_->PinSession("pinned", true), IsOk());
  // Timed: the store process's TTL counts whole seconds of its real clock.
  absl::SleepFor(absl::Milliseconds(1100));
  PutSegmentArgs fresh = Args("fresh", 0);
  fresh.session_ttl_seconds = 0;
  ASSERT_THAT(alice_->PutSegment(fresh, MakePayload(2000, 4)), IsOk());
  const char* b = std::getenv("KVTIER_BUILD_DIR");
  const std::string cli = std::string(b != nullptr ? b : ".") +
                          "/tools/kvtier store gc --target=" + store_->target() +
                          " --token=" + kAliceToken + " --idle_for=1s";
  const std::string out = dir_.path() + "/gc.out";
  auto run = [&](const std::string& flags) {
    EXPECT_EQ(std::system((cli + flags + " >" + out + " 2>&1").c_str()), 0);
    std::ifstream in(out);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  EXPECT_THAT(run(" --dry_run"), HasSubstr("would delete 1"));
  const std::string text = run("");
  EXPECT_THAT(text, HasSubstr("delete forever"));
  EXPECT_THAT(text, HasSubstr("deleted 1"));
  EXPECT_THAT(text, HasSubstr("kept 1 pinned"));
  EXPECT_THAT(alice_->ListRounds("forever"), StatusIs(Code::kNotFound));
  EXPECT_THAT(alice_->ListRounds("pinned"), IsOk());
  EXPECT_THAT(alice_->ListRounds("fresh"), IsOk());
}

TEST_F(StoreIntegrationTest, TenantsCannotSeeEachOthersSessions) {
  StartStore();
  const std::string p = MakePayload(3000, 1);
  ASSERT_THAT(alice_->PutSegment(Args("conversation-1", 0), p), IsOk());
  auto bob = Client(kBobToken);
  EXPECT_THAT(bob->ListRounds("conversation-1"), StatusIs(Code::kNotFound));
  EXPECT_THAT(bob->GetSegments("conversation-1", {Ref(0)}), StatusIs(Code::kNotFound));
  EXPECT_THAT(bob->DropRounds("conversation-1", {0}), StatusIs(Code::kNotFound));
  EXPECT_THAT(bob->RecordRecalls("conversation-1", {0}), StatusIs(Code::kNotFound));
  EXPECT_THAT(bob->DeleteSession("conversation-1"), StatusIs(Code::kNotFound));
  // Bob may use the same name: it is a different session.
  ASSERT_THAT(bob->PutSegment(Args("conversation-1", 0), MakePayload(3000, 2)), IsOk());
  auto bs = bob->Stats();
  ASSERT_THAT(bs, IsOk());
  EXPECT_EQ(bs->tenant(), "bob");
  EXPECT_EQ(bs->tenant_sessions(), 1u);
  auto got = alice_->GetSegments("conversation-1", {Ref(0)});
  ASSERT_THAT(got, IsOk());
  EXPECT_TRUE((*got)[0].payload == p);
}

TEST_F(StoreIntegrationTest, DropRecordPinDeleteAndRestart) {
  StartStore();
  for (int r = 0; r < 3; ++r)
    ASSERT_THAT(alice_->PutSegment(Args("s", r), MakePayload(2000, r)), IsOk());
  auto dropped = alice_->DropRounds("s", {1, 9});
  ASSERT_THAT(dropped, IsOk());
  EXPECT_EQ(dropped->dropped_size(), 1);
  EXPECT_EQ(dropped->not_found(0), 9u);
  // Single segments: round 0 keeps its segment 0 (and stays listed).
  ASSERT_THAT(alice_->PutSegment(Args("s", 0, 1), MakePayload(2000, 8, 2)), IsOk());
  auto segs = alice_->DropSegments("s", {Ref(0, 1), Ref(7)});
  ASSERT_THAT(segs, IsOk());
  ASSERT_EQ(segs->dropped_size(), 1);
  EXPECT_EQ(segs->dropped(0).segment(), 1u);
  ASSERT_EQ(segs->not_found_size(), 1);
  EXPECT_EQ(segs->not_found(0).round(), 7u);
  EXPECT_GT(segs->freed_bytes(), 0u);
  EXPECT_THAT(alice_->DropSegments("s", {}), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(alice_->DropSegments("nope", {Ref(0)}), StatusIs(Code::kNotFound));
  auto counted = alice_->RecordRecalls("s", {2, 2, 1});
  ASSERT_THAT(counted, IsOk());
  EXPECT_EQ(counted->counted_size(), 2);
  EXPECT_EQ(counted->not_found(0), 1u);  // Dropped above.
  ASSERT_THAT(alice_->PinSession("s", true), IsOk());
  // Issue 14 #5: pinning a session that does not exist creates nothing.
  EXPECT_THAT(alice_->PinSession("never-written", true), StatusIs(Code::kNotFound));
  EXPECT_THAT(alice_->ListRounds("never-written"), StatusIs(Code::kNotFound));
  EXPECT_THAT(Client(kAliceReader)->PinSession("s", false), StatusIs(Code::kPermissionDenied));
  ASSERT_THAT(alice_->PutSegment(Args("gone", 0), MakePayload(2000, 7)), IsOk());
  ASSERT_THAT(alice_->DeleteSession("gone"), IsOk());
  EXPECT_EQ(store_->Stop(), 0);  // Clean SIGTERM shutdown.
  ASSERT_THAT(store_->Start(), IsOk());
  alice_ = Client(kAliceToken);
  auto list = alice_->ListRounds("s");
  ASSERT_THAT(list, IsOk());
  EXPECT_TRUE(list->pinned());
  ASSERT_EQ(list->rounds_size(), 2);
  EXPECT_EQ(list->rounds(1).round(), 2u);
  EXPECT_EQ(list->rounds(1).summary().recall_count(), 2u);  // Recorded, and durable.
  EXPECT_EQ(list->rounds(0).summary().recall_count(), 0u);
  EXPECT_EQ(list->rounds(0).segments_size(), 1);
  EXPECT_THAT(alice_->ListRounds("gone"), StatusIs(Code::kNotFound));
}

TEST_F(StoreIntegrationTest, MetricsHealthAndReflection) {
  StartStore();
  ASSERT_THAT(alice_->PutSegment(Args("s", 0), MakePayload(4096, 1)), IsOk());
  ASSERT_THAT(alice_->GetSegments("s", {Ref(0)}), IsOk());
  std::string metrics = testing::HttpGet(store_->metrics_port(), "/metrics");
  EXPECT_THAT(metrics, HasSubstr("kvtier_store_bytes{tier=\"ram\"}"));
  EXPECT_THAT(metrics, HasSubstr("kvtier_store_hits_total{tier=\"ram\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("kvtier_store_request_seconds_count{method=\"PutSegment\"} 1"));
  // Segments by outcome, a batch's each on its own.
  auto batch = alice_->PutSegments({{Args("s", 1), MakePayload(3000, 2)},
                                    {Args("s", 0), MakePayload(3000, 3)},  // ALREADY_EXISTS
                                    {Args("s", 2), MakePayload(3000, 4)}});
  ASSERT_THAT(batch, IsOk());
  metrics = testing::HttpGet(store_->metrics_port(), "/metrics");
  EXPECT_THAT(metrics, HasSubstr("kvtier_store_segment_puts_total{method=\"PutSegment\","
                                 "outcome=\"ok\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("kvtier_store_segment_puts_total{method=\"PutSegments\","
                                 "outcome=\"ok\"} 2"));
  // ALREADY_EXISTS is the caller's: a client error, not the store's.
  EXPECT_THAT(metrics, HasSubstr("kvtier_store_segment_puts_total{method=\"PutSegments\","
                                 "outcome=\"client_error\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("kvtier_store_requests_total{method=\"PutSegments\","
                                 "outcome=\"ok\"} 1"));
  // Every server's process memory, read at the scrape, and the same in Stats.
  EXPECT_THAT(metrics, HasSubstr("\nprocess_resident_memory_bytes "));
  EXPECT_THAT(metrics, HasSubstr("\nkvtier_process_peak_resident_memory_bytes "));
  EXPECT_THAT(metrics, HasSubstr("\nkvtier_process_heap_in_use_bytes "));
  // And its version (as --version prints it).
  EXPECT_THAT(metrics,
              HasSubstr(absl::StrCat("\nkvtier_build_info{version=\"", KvtierVersionNumber(),
                                     "\",build_type=\"", KvtierBuildType(), "\"} 1\n")));
  auto stats = alice_->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_GT(stats->memory().resident_bytes(), 1u << 20);
  EXPECT_GE(stats->memory().peak_resident_bytes(), stats->memory().resident_bytes());
#ifndef KVTIER_SANITIZED  // The sanitizers' allocator answers mallinfo2 with zeros.
  EXPECT_GT(stats->memory().heap_in_use_bytes(), 4096u);  // The RAM tier holds the segment.
#endif

  EXPECT_EQ(testing::GrpcHealthStatus(alice_->channel()), 1);  // SERVING
  EXPECT_EQ(testing::GrpcHealthStatus(alice_->channel(), "kvtier.v1.Store"), 1);
  EXPECT_EQ(testing::GrpcHealthStatus(alice_->channel(), "kvtier.v1.Nope"), -1);  // NOT_FOUND
  EXPECT_THAT(testing::HttpGet(store_->metrics_port(), "/healthz"), HasSubstr(" 200 OK"));
  EXPECT_THAT(testing::HttpGet(store_->metrics_port(), "/readyz"), HasSubstr("\r\n\r\nok\n"));

  grpc::GenericStub generic(alice_->channel());

  // Reflection: ServerReflectionRequest{list_services: ""} is field 7, empty.
  grpc::CompletionQueue cq;
  grpc::ClientContext rctx;
  auto call = generic.PrepareCall(
      &rctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  auto step = [&](intptr_t tag) {
    void* got;
    bool ok = false;
    EXPECT_TRUE(cq.Next(&got, &ok));
    EXPECT_EQ(reinterpret_cast<intptr_t>(got), tag);
    return ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(step(1));
  grpc::Slice slice(std::string("\x3a\x00", 2));
  grpc::ByteBuffer out(&slice, 1);
  call->Write(out, reinterpret_cast<void*>(2));
  ASSERT_TRUE(step(2));
  call->WritesDone(reinterpret_cast<void*>(3));
  ASSERT_TRUE(step(3));
  grpc::ByteBuffer in;
  call->Read(&in, reinterpret_cast<void*>(4));
  ASSERT_TRUE(step(4));
  std::vector<grpc::Slice> in_slices;
  ASSERT_TRUE(in.Dump(&in_slices).ok());
  std::string listed;
  for (auto& s : in_slices) listed.append(reinterpret_cast<const char*>(s.begin()), s.size());
  EXPECT_THAT(listed, HasSubstr("kvtier.v1.Store"));
  EXPECT_THAT(listed, HasSubstr("grpc.health.v1.Health"));
  grpc::Status fin;
  call->Finish(&fin, reinterpret_cast<void*>(5));
  step(5);
  cq.Shutdown();
  void* ignored_tag;
  bool ignored_ok;
  while (cq.Next(&ignored_tag, &ignored_ok)) {
  }
}

TEST_F(StoreIntegrationTest, TlsRoundTrip) {
  auto certs = testing::MakeSelfSignedCert(dir_.path());
  if (absl::IsUnavailable(certs.status())) GTEST_SKIP() << certs.status().message();
  ASSERT_TRUE(certs.ok()) << certs.status();
  const std::string &cert = certs->cert, &key = certs->key, &pem = certs->pem;
  StartStore({"--tls_cert=" + cert, "--tls_key=" + key});
  StoreClientOptions o;
  o.target = store_->target();
  o.token = kAliceToken;
  o.tls_root_certs = pem;
  o.tls_server_name = "localhost";
  auto tls = StoreClient::Connect(o);
  ASSERT_THAT(tls, IsOk());
  const std::string p = MakePayload(100'000, 5);
  ASSERT_THAT((*tls)->PutSegment(Args("secure", 0), p), IsOk());
  auto got = (*tls)->GetSegments("secure", {Ref(0)});
  ASSERT_THAT(got, IsOk());
  EXPECT_TRUE((*got)[0].payload == p);
  // A plaintext client cannot talk to the TLS port.
  EXPECT_THAT(alice_->ListRounds("secure"), StatusIs(Code::kUnavailable));
}

}  // namespace
}  // namespace kvtier
