// kvtier-worker's tenants over gRPC with a real kvtier-store process: a
// tenant cannot point the worker at an address of its choosing, reach
// another tenant's sessions, or take more than its share; a stopped store
// costs a call its deadline, never a hang.
#include <chrono>
#include <cmath>
#include <functional>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/half.h"
#include "kernels/speculation.h"
#include "services/controller/controller_server.h"
#include "services/worker/worker_server.h"
#include "testing/test_util.h"
#include "tests/util/grpc_health.h"
#include "tests/util/raw_unary.h"
#include "tests/util/segment_refs.h"
#include "tests/util/status_matchers.h"
#include "tests/util/trap_listener.h"
#include "tests/util/worker_rpc.h"
#include "tests/util/worker_stack.h"

namespace kvtier {
namespace {

using ::kvtier::testing::EndRound;
using ::kvtier::testing::IdentitySkew;
using ::kvtier::testing::kDim;
using ::kvtier::testing::kKvHeads;
using ::kvtier::testing::kLayers;
using ::kvtier::testing::kQHeads;
using ::kvtier::testing::OpenRequest;
using ::kvtier::testing::PrefillStep;
using ::kvtier::testing::PutSkew;
using ::kvtier::testing::RetryWhile;
using ::kvtier::testing::RetryWhileResuming;
using ::kvtier::testing::StatusIs;
using ::kvtier::testing::WorkerServiceTest;

// A hostile tenant names its own listener as a store replica, to catch the
// worker's store token: in OpenSession, in a TransferSession header, and
// beside the worker's real store. Each is PERMISSION_DENIED naming the
// address; the listener never sees a connection, even after the steps and
// EndRound that would have written rounds there; malformed addresses are
// INVALID_ARGUMENT; the worker's own --store still works.
TEST_F(WorkerServiceTest, ATenantCannotPointTheWorkerAtAnAddressOfItsChoosing) {
  testing::TrapListener trap;
  ASSERT_TRUE(trap.ok());
  std::mt19937 rng(9);
  v1::EndRoundResponse end;
  for (const std::vector<std::string>& stores :
       {std::vector<std::string>{trap.address()},
        std::vector<std::string>{stack_.store()->target(), trap.address()}}) {
    v1::OpenSessionRequest open = Open("steal");
    for (const std::string& a : stores) open.add_store_addresses(a);
    grpc::ClientContext c;
    v1::OpenSessionResponse r;
    const grpc::Status st = stub_->OpenSession(&c, open, &r);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr(trap.address()));
    EXPECT_EQ(PrefillStep(stub_.get(), "steal", 4, &rng).error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(EndRound(stub_.get(), "steal", &end, absl::Seconds(2)).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  for (const std::string& bad :
       {std::string("127.0.0.1:70 70"), std::string("evil\n:1"), std::string(10'000, 'x') + ":1"}) {
    v1::OpenSessionRequest open = Open("malformed");
    open.add_store_addresses(bad);
    grpc::ClientContext c;
    v1::OpenSessionResponse r;
    const grpc::Status st = stub_->OpenSession(&c, open, &r);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_LT(st.error_message().size(), 400u);
  }
  {
    // A hand-off stream whose header names the listener ends at the header.
    grpc::ClientContext c;
    c.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::TransferSessionResponse resp;
    auto w = stub_->TransferSession(&c, &resp);
    v1::TransferChunk chunk;
    v1::TransferHeader* h = chunk.mutable_header();
    h->set_session_id("moved");
    *h->mutable_model() = Open("moved").model();
    h->add_store_addresses(trap.address());
    w->Write(chunk);
    w->WritesDone();
    const grpc::Status st = w->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr(trap.address()));
  }
  EXPECT_EQ(trap.Connections(), 0);
  // The worker's own store is allowed by name.
  v1::OpenSessionRequest own = Open("own");
  own.add_store_addresses(stack_.store()->target());
  grpc::ClientContext c;
  v1::OpenSessionResponse r;
  const grpc::Status st = stub_->OpenSession(&c, own, &r);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_TRUE(PrefillStep(stub_.get(), "own", 4, &rng).ok());
  ASSERT_TRUE(EndRound(stub_.get(), "own", &end).ok());
}

// A store that stops answering (SIGSTOP) costs a call its deadline and a
// precise DEADLINE_EXCEEDED, never a hang: the caller's own deadline when
// it sets one, the worker's store deadline when it does not.
class WorkerDeadlineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVT_ASSERT_OK(stack_.Start(absl::Seconds(1)));
    stub_ = v1::Worker::NewStub(stack_.channel());
  }
  void TearDown() override { stack_.store()->Resume(); }
  testing::WorkerStack stack_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

TEST_F(WorkerDeadlineTest, StoppedStoreGivesDeadlineExceeded) {
  v1::OpenSessionRequest open;
  open.set_session_id("s");
  open.mutable_model()->set_num_layers(kLayers);
  open.mutable_model()->set_num_q_heads(kQHeads);
  open.mutable_model()->set_num_kv_heads(kKvHeads);
  open.mutable_model()->set_head_dim(kDim);
  open.mutable_model()->set_dtype(v1::DTYPE_FP16);
  open.mutable_policy()->set_watershed_layer(1);
  open.mutable_policy()->set_recall("all");
  grpc::ClientContext oc;
  v1::OpenSessionResponse or_;
  ASSERT_TRUE(stub_->OpenSession(&oc, open, &or_).ok());
  std::mt19937 rng(2);
  v1::EndRoundResponse end;
  ASSERT_TRUE(PrefillStep(stub_.get(), "s", 4, &rng).ok());
  ASSERT_TRUE(EndRound(stub_.get(), "s", &end).ok());
  ASSERT_TRUE(PrefillStep(stub_.get(), "s", 4, &rng).ok());

  stack_.store()->Pause();
  // The caller's deadline (0.5 s) reaches the store.
  auto t0 = absl::Now();
  grpc::Status s = EndRound(stub_.get(), "s", &end, absl::Milliseconds(500));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  // Without a caller deadline: the worker's own store deadline (1 s). The
  // first attempt may still be finishing on the worker (its store call had
  // the same 0.5 s): that is ABORTED, and a retry.
  s = RetryWhile(grpc::StatusCode::ABORTED, [&] {
    t0 = absl::Now();
    grpc::ClientContext c;
    v1::EndRoundRequest r;
    r.set_session_id("s");
    return stub_->EndRound(&c, r, &end);
  });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(900));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  // The engine directly: its Get/Put pass the deadline on.
  worker::Engine* engine = stack_.server()->engine();
  absl::Status direct;
  for (int attempt = 0; attempt < 50; ++attempt) {
    t0 = absl::Now();
    direct = engine->EndRound("s", CallOptions::Within(absl::Milliseconds(300))).status();
    if (!absl::IsAborted(direct)) break;
    // Timed: the abandoned call still finishing on the worker's threads (ABORTED meanwhile).
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_THAT(direct, StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3));

  // The round stayed open; with the store back, EndRound succeeds.
  stack_.store()->Resume();
  s = RetryWhileResuming([&] { return EndRound(stub_.get(), "s", &end); });
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(end.round(), 1u);

  // The recall fetch at L_w + 1 waits at most the caller's deadline.
  stack_.store()->Pause();
  t0 = absl::Now();
  s = PrefillStep(stub_.get(), "s", 4, &rng, absl::Milliseconds(700));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  stack_.store()->Resume();
  // Rolled back: the whole step can be sent again.
  const grpc::Status again =
      RetryWhileResuming([&] { return PrefillStep(stub_.get(), "s", 4, &rng); });
  EXPECT_TRUE(again.ok()) << again.error_message();
}

// Tenants are a (tenant, session) pair, never one joined string: with
// tenants `acme` and `acme.eu`, `acme` naming session `eu.x` reaches its own
// session, not acme.eu's `x`. The worker acts for each end tenant at the
// store (a node token), so rounds land under the end tenant and its own
// store quota applies.
TEST(WorkerTenantTest, TenantsCannotReachEachOther) {
  testing::TempDir dir;
  const std::string worker_tenants = dir.path() + "/worker-tenants";
  const std::string store_tenants = dir.path() + "/store-tenants";
  testing::WriteFile(worker_tenants,
                     "acme-token-1   acme     readwrite\n"
                     "acmeeu-token-1 acme.eu  readwrite\n");
  // The worker's node token; readonly tokens for looking, and acme's quota
  // (too small for one round).
  testing::WriteFile(store_tenants,
                     "worker-node-token worker   node\n"
                     "acme-reader-1     acme     readonly 1024\n"
                     "acmeeu-reader-1   acme.eu  readonly\n");
  testing::WorkerStackOptions o;
  o.worker_tenants_file = worker_tenants;
  o.store_flags = {"--tenants_file=" + store_tenants};
  o.store_token = "worker-node-token";
  testing::WorkerStack stack;
  KVT_ASSERT_OK(stack.Start(o));
  auto stub = v1::Worker::NewStub(stack.channel());
  auto open = [&](const std::string& id, const std::string& token) {
    grpc::ClientContext c;
    c.AddMetadata("authorization", "Bearer " + token);
    v1::OpenSessionResponse resp;
    return stub->OpenSession(&c, OpenRequest(id), &resp);
  };
  auto close = [&](const std::string& id, const std::string& token) {
    grpc::ClientContext c;
    c.AddMetadata("authorization", "Bearer " + token);
    v1::CloseSessionRequest r;
    r.set_session_id(id);
    r.set_delete_from_store(true);
    v1::CloseSessionResponse resp;
    return stub->CloseSession(&c, r, &resp);
  };
  std::mt19937 rng(7);
  ASSERT_TRUE(open("x", "acmeeu-token-1").ok());
  ASSERT_TRUE(PrefillStep(stub.get(), "x", 4, &rng, absl::Seconds(30), "acmeeu-token-1").ok());
  v1::EndRoundResponse end;
  ASSERT_TRUE(EndRound(stub.get(), "x", &end, absl::Seconds(30), "acmeeu-token-1").ok());

  // acme cannot touch acme.eu's x under any spelling.
  EXPECT_EQ(EndRound(stub.get(), "eu.x", &end, absl::Seconds(30), "acme-token-1").error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(close("eu.x", "acme-token-1").error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(close("x", "acme-token-1").error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(open("acme.eu/x", "acme-token-1").error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Its own eu.x is a different session; filling it leaves acme.eu's alone.
  ASSERT_TRUE(open("eu.x", "acme-token-1").ok());
  ASSERT_TRUE(PrefillStep(stub.get(), "eu.x", 4, &rng, absl::Seconds(30), "acme-token-1").ok());
  // acme's store quota (1 KiB) holds per end tenant: its round is refused...
  const grpc::Status over = EndRound(stub.get(), "eu.x", &end, absl::Seconds(30), "acme-token-1");
  EXPECT_EQ(over.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << over.error_message();
  // ...while acme.eu, with no quota, goes on.
  ASSERT_TRUE(PrefillStep(stub.get(), "x", 2, &rng, absl::Seconds(30), "acmeeu-token-1").ok());
  ASSERT_TRUE(EndRound(stub.get(), "x", &end, absl::Seconds(30), "acmeeu-token-1").ok());

  // In the store, the rounds are acme.eu's, under its own session name.
  auto store = v1::Store::NewStub(
      grpc::CreateChannel(stack.store()->target(), grpc::InsecureChannelCredentials()));
  auto list = [&](const std::string& token, const std::string& session, int* rounds) {
    grpc::ClientContext c;
    c.AddMetadata("authorization", "Bearer " + token);
    v1::ListRoundsRequest r;
    r.set_session_id(session);
    v1::ListRoundsResponse resp;
    grpc::Status st = store->ListRounds(&c, r, &resp);
    *rounds = resp.rounds_size();
    return st.error_code();
  };
  int rounds = 0;
  EXPECT_EQ(list("acmeeu-reader-1", "x", &rounds), grpc::StatusCode::OK);
  EXPECT_EQ(rounds, 2);
  EXPECT_EQ(list("acme-reader-1", "x", &rounds), grpc::StatusCode::NOT_FOUND);
  // acme's refused round left nothing behind (its session record may stay).
  rounds = -1;
  list("acme-reader-1", "eu.x", &rounds);
  EXPECT_EQ(rounds, 0);
  // Deleting from the store also acts for the end tenant.
  EXPECT_TRUE(close("x", "acmeeu-token-1").ok());
  EXPECT_EQ(list("acmeeu-reader-1", "x", &rounds), grpc::StatusCode::NOT_FOUND);
}

// Two tenants on one worker, one hostile. The hostile one opens sessions
// until its default share (--tenant_max_sessions) refuses it, grows one
// past its working-set share, opens a PutSkew stream and goes silent, and
// tries a second, then sends more skew bytes than its share: each refusal
// is RESOURCE_EXHAUSTED naming the limit, and the silent stream ends
// DEADLINE_EXCEEDED after the idle deadline. The
// well-behaved tenant's every call meanwhile succeeds at once: its
// sessions open, step and end rounds, and its skew uploads.
TEST(WorkerFairnessTest, AHostileTenantTakesOnlyItsShare) {
  testing::TempDir dir;
  testing::WriteFile(dir.path() + "/tenants",
                     "evil-token-00001 evil readwrite\n"
                     "good-token-00001 good readwrite\n");
  testing::StoreProcess store(dir.path() + "/db");
  ASSERT_TRUE(store.Start().ok());
  WorkerServerOptions wo;
  wo.listen = "127.0.0.1:0";
  wo.metrics_listen = "";
  wo.tenants_file = dir.path() + "/tenants";
  wo.store.target = store.target();
  wo.engine.max_sessions = 64;
  // Shares: 4 sessions and room for 64 tokens of the tests' model (fp16).
  wo.engine.default_tenant_limit = {4, 64 * kLayers * kKvHeads * kDim * 2 * 2};
  wo.service.skew_uploads_per_tenant = 1;
  wo.service.skew_upload_bytes_per_tenant = 1 << 20;
  wo.service.skew_upload_idle = absl::Milliseconds(500);
  auto worker = WorkerServer::Start(wo);
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*worker)->port()),
                                                      grpc::InsecureChannelCredentials()));
  const std::string evil = "evil-token-00001", good = "good-token-00001";
  auto open = [&](const std::string& token, const std::string& id) {
    grpc::ClientContext c;
    c.AddMetadata("authorization", "Bearer " + token);
    v1::OpenSessionResponse r;
    return stub->OpenSession(&c, OpenRequest(id), &r);
  };
  auto upload = [&](const std::string& token, grpc::ClientContext* c, v1::PutSkewResponse* resp) {
    c->AddMetadata("authorization", "Bearer " + token);
    c->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    return stub->PutSkew(c, resp);
  };
  std::mt19937 rng(21);
  v1::EndRoundResponse end;

  for (int i = 0; i < 4; ++i) ASSERT_TRUE(open(evil, absl::StrCat("e", i)).ok()) << i;
  const grpc::Status more = open(evil, "e4");
  EXPECT_EQ(more.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(more.error_message(), ::testing::HasSubstr("--tenant_max_sessions"));
  ASSERT_TRUE(PrefillStep(stub.get(), "e0", 60, &rng, absl::Seconds(30), evil).ok());
  const grpc::Status grown = PrefillStep(stub.get(), "e1", 60, &rng, absl::Seconds(30), evil);
  EXPECT_EQ(grown.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(grown.error_message(), ::testing::HasSubstr("--tenant_max_working_set_mb"));
  // A skew upload that sends one slice and then nothing; a second refused.
  grpc::ClientContext silent_ctx;
  v1::PutSkewResponse silent_resp;
  auto silent = upload(evil, &silent_ctx, &silent_resp);
  v1::PutSkewRequest slice;
  slice.set_data(std::string(1000, 'x'));
  silent->WaitForInitialMetadata();  // Admitted.
  ASSERT_TRUE(silent->Write(slice));
  const absl::Time silent_since = absl::Now();
  {
    grpc::ClientContext c;
    v1::PutSkewResponse r;
    auto second = upload(evil, &c, &r);
    second->WritesDone();
    const grpc::Status st = second->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr("--skew_uploads_per_tenant"));
  }

  // Meanwhile the other tenant is served in full.
  for (int i = 0; i < 4; ++i) {
    const std::string id = absl::StrCat("g", i);
    ASSERT_TRUE(open(good, id).ok()) << id;
    ASSERT_TRUE(PrefillStep(stub.get(), id, 12, &rng, absl::Seconds(30), good).ok()) << id;
    ASSERT_TRUE(EndRound(stub.get(), id, &end, absl::Seconds(30), good).ok()) << id;
  }
  {
    grpc::ClientContext c;
    v1::PutSkewResponse r;
    auto w = upload(good, &c, &r);
    v1::PutSkewRequest req;
    req.set_data(IdentitySkew(kLayers, kQHeads, kKvHeads, kDim, 2));
    ASSERT_TRUE(w->Write(req));
    w->WritesDone();
    const grpc::Status st = w->Finish();
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_FALSE(r.skew_id().empty());
  }

  // The silent stream ends by the idle deadline, not the call's, and gives
  // its slot back.
  const grpc::Status st = silent->Finish();  // Never half-closed.
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
  EXPECT_THAT(st.error_message(), ::testing::HasSubstr("PutSkew idle for 500ms"));
  EXPECT_GE(absl::Now() - silent_since, absl::Milliseconds(500));
  {
    grpc::ClientContext c;
    v1::PutSkewResponse r;
    auto again = upload(evil, &c, &r);
    v1::PutSkewRequest req;
    req.set_data(IdentitySkew(kLayers, kQHeads, kKvHeads, kDim, 1));
    ASSERT_TRUE(again->Write(req));
    again->WritesDone();
    EXPECT_TRUE(again->Finish().ok());
  }
  // Bytes in flight are capped per tenant too (1 MiB here).
  grpc::ClientContext c;
  v1::PutSkewResponse r;
  auto big = upload(evil, &c, &r);
  v1::PutSkewRequest half;
  half.set_data(std::string(600 << 10, 'x'));
  big->Write(half);
  big->Write(half);
  big->WritesDone();
  const grpc::Status capped = big->Finish();
  EXPECT_EQ(capped.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << capped.error_message();
  EXPECT_THAT(capped.error_message(), ::testing::HasSubstr("--skew_upload_mb_per_tenant"));
}

}  // namespace
}  // namespace kvtier
