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
#include "gmock/gmock.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "kernels/crc32c.h"
#include "kernels/encoded_tensor.h"
#include "testing/store_process.h"
#include "testing/test_util.h"
#include "tests/util/grpc_health.h"
#include "tests/util/raw_unary.h"
#include "tests/util/status_matchers.h"

namespace kvtier {
namespace {

using ::kvtier::testing::IsOk;
using ::kvtier::testing::MakePayload;
using ::kvtier::testing::StatusIs;
using ::kvtier::testing::StoreProcess;
using ::kvtier::testing::TempDir;
using ::testing::HasSubstr;
using Code = absl::StatusCode;

constexpr char kAliceToken[] = "alice-token-0001";
constexpr char kAliceReader[] = "alice-reader-001";
constexpr char kBobToken[] = "bob-token-000001";
constexpr char kCarolToken[] = "carol-token-0001";  // Tiny quota.
constexpr char kNodeToken[] = "node-token-00001";   // May act for end tenants.

class StoreIntegrationTest : public ::testing::Test {
 protected:
  void StartStore(std::vector<std::string> flags = {}) {
    std::ofstream(dir_.path() + "/tenants") << "# test tenants\n"
                                            << kAliceToken << " alice readwrite\n"
                                            << kAliceReader << " alice readonly\n"
                                            << kBobToken << " bob readwrite\n"
                                            << kCarolToken << " carol readwrite 100000\n"
                                            << kNodeToken << " node1 node\n";
    flags.push_back("--tenants_file=" + dir_.path() + "/tenants");
    flags.push_back("--sync_writes=false");  // The crash test covers fsync.
    store_ = std::make_unique<StoreProcess>(dir_.path() + "/db", flags);
    ASSERT_THAT(store_->Start(), IsOk());
    alice_ = Client(kAliceToken);
  }

  std::unique_ptr<StoreClient> Client(const std::string& token) {
    StoreClientOptions o;
    o.target = store_->target();
    o.token = token;
    auto c = StoreClient::Connect(o);
    EXPECT_TRUE(c.ok());
    return std::move(c).value();
  }

  static PutSegmentArgs Args(const std::string& session, uint32_t round, uint32_t seg = 0) {
    PutSegmentArgs a;
    a.session_id = session;
    a.round = round;
    a.segment = seg;
    a.layer_begin = seg == 0 ? 0 : 2;
    a.layer_end = seg == 0 ? 2 : 5;
    return a;
  }

  static v1::SegmentRef Ref(uint32_t round, uint32_t seg = 0) {
    v1::SegmentRef r;
    r.set_round(round);
    r.set_segment(seg);
    return r;
  }

  // Sends a hand-built PutSegment stream, for malformed-input cases.
  absl::Status RawPut(const std::vector<v1::PutSegmentRequest>& msgs,
                      const std::string& token = kAliceToken) {
    auto c = Client(token);
    auto ctx = c->NewContext();
    v1::PutSegmentResponse resp;
    auto w = c->stub()->PutSegment(ctx.get(), &resp);
    for (const auto& m : msgs) {
      if (!w->Write(m)) break;
    }
    w->WritesDone();
    grpc::Status s = w->Finish();
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  }

  // The same for PutSegments: the call's status, and its results when OK.
  absl::Status RawPuts(const std::vector<v1::PutSegmentRequest>& msgs,
                       v1::PutSegmentsResponse* resp = nullptr,
                       const std::string& token = kAliceToken) {
    auto c = Client(token);
    auto ctx = c->NewContext();
    v1::PutSegmentsResponse ignored;
    auto w = c->stub()->PutSegments(ctx.get(), resp != nullptr ? resp : &ignored);
    for (const auto& m : msgs) {
      if (!w->Write(m)) break;
    }
    w->WritesDone();
    grpc::Status s = w->Finish();
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  }

  static v1::PutSegmentRequest Header(const std::string& session, uint32_t round,
                                      const std::string& payload) {
    v1::PutSegmentRequest r;
    auto* h = r.mutable_header();
    h->set_session_id(session);
    h->mutable_ref()->set_round(round);
    h->set_layer_begin(0);
    h->set_layer_end(2);
    h->set_payload_bytes(payload.size());
    h->set_payload_crc32c(Crc32c(payload));
    return r;
  }
  static v1::PutSegmentRequest Chunk(const std::string& bytes) {
    v1::PutSegmentRequest r;
    r.set_chunk(bytes);
    return r;
  }

  v1::StatsResponse Stats() {
    auto s = alice_->Stats();
    EXPECT_THAT(s, IsOk());
    return s.value_or(v1::StatsResponse());
  }

  TempDir dir_;
  std::unique_ptr<StoreProcess> store_;
  std::unique_ptr<StoreClient> alice_;
};

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
  EXPECT_THAT(metrics, HasSubstr("kvtier_store_segment_puts_total{method=\"PutSegments\","
                                 "outcome=\"error\"} 1"));
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
