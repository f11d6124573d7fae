// The store integration tests' fixture: a real kvtier-store process on
// 127.0.0.1:0 with a tenants file of four tenants and a node, a client per
// token, and hand-built PutSegment and PutSegments streams for malformed
// input.
#ifndef KVTIER_TESTS_UTIL_STORE_STACK_FIXTURE_H_
#define KVTIER_TESTS_UTIL_STORE_STACK_FIXTURE_H_

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "client/store_client.h"
#include "gtest/gtest.h"
#include "kernels/crc32c.h"
#include "testing/store_process.h"
#include "testing/test_util.h"
#include "tests/util/status_matchers.h"

namespace kvtier::store_test {

using ::kvtier::testing::IsOk;

inline constexpr char kAliceToken[] = "alice-token-0001";
inline constexpr char kAliceReader[] = "alice-reader-001";
inline constexpr char kBobToken[] = "bob-token-000001";
inline constexpr char kCarolToken[] = "carol-token-0001";  // Tiny quota.
inline constexpr char kNodeToken[] = "node-token-00001";   // May act for end tenants.

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
    store_ = std::make_unique<testing::StoreProcess>(dir_.path() + "/db", flags);
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

  testing::TempDir dir_;
  std::unique_ptr<testing::StoreProcess> store_;
  std::unique_ptr<StoreClient> alice_;
};

}  // namespace kvtier::store_test

#endif  // KVTIER_TESTS_UTIL_STORE_STACK_FIXTURE_H_
