// kvtier-worker in a cluster of real processes: rounds on every store
// replica and a dead one replaced through kvtier-controller, a session
// resumed by another worker (never from another model's rounds), memory
// pressure tightening policies, and readiness following the store.
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

using ::kvtier::testing::Dense;
using ::kvtier::testing::EndRound;
using ::kvtier::testing::Eventually;
using ::kvtier::testing::Floats;
using ::kvtier::testing::IsOk;
using ::kvtier::testing::kDim;
using ::kvtier::testing::kKvHeads;
using ::kvtier::testing::kLayers;
using ::kvtier::testing::kQHeads;
using ::kvtier::testing::OpenRequest;
using ::kvtier::testing::PrefillStep;

// A session opened with store replicas keeps every round on each of them,
// byte for byte; when its first replica dies, recalls come from the next;
// a round that cannot reach every replica is refused (UNAVAILABLE, naming
// the store) and leaves no half round behind.
TEST(WorkerReplicationTest, RoundsLandOnEveryReplicaAndRecallsFallBack) {
  testing::TempDir dir;
  testing::StoreProcess a(dir.path() + "/a"), b(dir.path() + "/b");
  ASSERT_TRUE(a.Start().ok());
  ASSERT_TRUE(b.Start().ok());
  WorkerServerOptions wo;
  wo.listen = "127.0.0.1:0";
  wo.metrics_listen = "";
  wo.store.target = a.target();
  wo.replica_stores = {b.target()};
  wo.service.store_deadline = absl::Seconds(5);
  auto worker = WorkerServer::Start(wo);
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*worker)->port()),
                                                      grpc::InsecureChannelCredentials()));
  v1::OpenSessionRequest open = OpenRequest("r");
  open.add_store_addresses(b.target());  // b first: the primary.
  open.add_store_addresses(a.target());
  {
    v1::OpenSessionRequest bad = open;
    bad.set_session_id("bad");
    bad.add_store_addresses(a.target());  // Repeated.
    grpc::ClientContext c;
    v1::OpenSessionResponse r;
    EXPECT_EQ(stub->OpenSession(&c, bad, &r).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext c;
    v1::OpenSessionResponse r;
    ASSERT_TRUE(stub->OpenSession(&c, open, &r).ok());
  }
  std::mt19937 rng(11);
  v1::EndRoundResponse end;
  for (int round = 0; round < 2; ++round) {
    ASSERT_TRUE(PrefillStep(stub.get(), "r", 4, &rng).ok());
    ASSERT_TRUE(EndRound(stub.get(), "r", &end).ok());
  }
  auto client = [](const testing::StoreProcess& p) {
    StoreClientOptions o;
    o.target = p.target();
    return std::move(StoreClient::Connect(o)).value();
  };
  auto ca = client(a), cb = client(b);
  const std::vector<v1::SegmentRef> refs = testing::BothSegments(2);
  auto got_a = ca->GetSegments("r", refs);
  auto got_b = cb->GetSegments("r", refs);
  ASSERT_TRUE(got_a.ok()) << got_a.status();
  ASSERT_TRUE(got_b.ok()) << got_b.status();
  for (size_t i = 0; i < refs.size(); ++i) {
    EXPECT_TRUE((*got_a)[i].payload == (*got_b)[i].payload) << "segment " << i;
  }

  // The primary dies: the next round's recall is served by the other.
  b.Kill();
  const uint64_t before = (*worker)->segments()->read_fallbacks();
  const grpc::Status st = PrefillStep(stub.get(), "r", 4, &rng);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ((*worker)->segments()->read_fallbacks(), before + 1);
  // The round cannot reach every replica: refused, and a holds no half of it.
  const grpc::Status ended = EndRound(stub.get(), "r", &end);
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(ended.error_message(), ::testing::HasSubstr(b.target()));
  auto list = ca->ListRounds("r");
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->rounds_size(), 2);
}

// With a controller, a dead replica is replaced and repaired: three real
// stores and a worker join kvtier-controller (R = 2); the session's primary
// is killed; once the controller has declared it dead, the next round lands
// on the surviving replica and the store that replaces the dead one, and the
// controller copies the older round there: R = 2 again, byte for byte.
TEST(WorkerReplicationTest, ADeadReplicaIsReplacedThroughTheController) {
  testing::TempDir dir;
  const std::string tenants = dir.path() + "/tenants";
  testing::WriteFile(tenants,
                     "node-token-00001 nodes node\n"
                     "acme-token-00001 acme  readwrite\n");
  ControllerServerOptions co;
  co.listen = "127.0.0.1:0";
  co.metrics_listen = "";
  co.tenants_file = tenants;
  co.controller.replicas = 2;
  co.controller.membership.heartbeat_interval = absl::Milliseconds(100);
  co.controller.membership.warmup = absl::ZeroDuration();
  co.repair.store_token = "node-token-00001";
  auto controller = ControllerServer::Start(co);
  ASSERT_TRUE(controller.ok()) << controller.status();
  const std::string target = absl::StrCat("127.0.0.1:", (*controller)->port());
  std::vector<std::unique_ptr<testing::StoreProcess>> stores;
  for (const char* id : {"s-a", "s-b", "s-c"}) {
    stores.push_back(std::make_unique<testing::StoreProcess>(
        dir.path() + "/" + id,
        std::vector<std::string>{"--controller=" + target, "--controller_token=node-token-00001",
                                 std::string("--node_id=") + id}));
    ASSERT_TRUE(stores.back()->Start().ok());
  }
  WorkerServerOptions wo;
  wo.listen = "127.0.0.1:0";
  wo.metrics_listen = "";
  wo.tenants_file = tenants;
  wo.store.target = stores[0]->target();
  wo.cluster.controller = target;
  wo.cluster.controller_token = "node-token-00001";
  wo.cluster.node_id = "w-a";
  auto worker = WorkerServer::Start(wo);
  ASSERT_TRUE(worker.ok()) << worker.status();
  controller::Controller* ctl = (*controller)->controller();
  auto live = [&](controller::NodeKind k) { return ctl->membership().Live(k).size(); };
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while ((live(controller::NodeKind::kStore) < 3 || live(controller::NodeKind::kWorker) < 1) &&
         absl::Now() < until) {
    // Timed: store and worker processes register with the controller.
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(live(controller::NodeKind::kStore), 3u);

  // The engine routes the session as its tenant and opens it on the worker.
  KVT_ASSERT_OK_AND_ASSIGN(controller::Placement pl, ctl->Route("acme", "chat"));
  ASSERT_EQ(pl.stores.size(), 2u);
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*worker)->port()),
                                                      grpc::InsecureChannelCredentials()));
  v1::OpenSessionRequest open = OpenRequest("chat");
  for (const auto& st : pl.stores) open.add_store_addresses(st.spec.address);
  {
    // Beside a store the controller placed, an address it does not know
    // is refused: the worker asked the controller, not the tenant.
    testing::TrapListener trap;
    ASSERT_TRUE(trap.ok());
    v1::OpenSessionRequest hostile = OpenRequest("chat-hostile");
    hostile.add_store_addresses(pl.stores[0].spec.address);
    hostile.add_store_addresses(trap.address());
    grpc::ClientContext c;
    c.AddMetadata("authorization", "Bearer acme-token-00001");
    v1::OpenSessionResponse r;
    const grpc::Status st = stub->OpenSession(&c, hostile, &r);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr("controller lists"));
    EXPECT_EQ(trap.Connections(), 0);
  }
  {
    grpc::ClientContext c;
    c.AddMetadata("authorization", "Bearer acme-token-00001");
    v1::OpenSessionResponse r;
    const grpc::Status st = stub->OpenSession(&c, open, &r);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  {
    // Nor may it hand the session to a "worker" the controller does not
    // list: refused before anything is dialled.
    testing::TrapListener trap;
    ASSERT_TRUE(trap.ok());
    grpc::ClientContext c;
    c.AddMetadata("authorization", "Bearer acme-token-00001");
    v1::SendSessionRequest send;
    send.set_session_id("chat");
    send.set_target(trap.address());
    v1::SendSessionResponse r;
    const grpc::Status st = stub->SendSession(&c, send, &r);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr("hand-off target"));
    EXPECT_EQ(trap.Connections(), 0);
  }
  const std::string token = "acme-token-00001";
  std::mt19937 rng(5);
  v1::EndRoundResponse end;
  ASSERT_TRUE(PrefillStep(stub.get(), "chat", 4, &rng, absl::Seconds(30), token).ok());
  ASSERT_TRUE(EndRound(stub.get(), "chat", &end, absl::Seconds(30), token).ok());

  // The primary dies, and the controller notices.
  testing::StoreProcess* primary = nullptr;
  testing::StoreProcess* survivor = nullptr;
  testing::StoreProcess* spare = nullptr;
  for (auto& st : stores) {
    if (st->target() == pl.stores[0].spec.address) {
      primary = st.get();
    } else if (st->target() == pl.stores[1].spec.address) {
      survivor = st.get();
    } else {
      spare = st.get();
    }
  }
  ASSERT_TRUE(primary != nullptr && survivor != nullptr && spare != nullptr);
  primary->Kill();
  const absl::Time dead_by = absl::Now() + absl::Seconds(10);
  while (live(controller::NodeKind::kStore) != 2 && absl::Now() < dead_by) {
    // Timed: the killed store's lease must expire at the controller.
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(live(controller::NodeKind::kStore), 2u);

  // The next round: its recall falls back to the survivor, and it is
  // stored on the survivor and the spare.
  ASSERT_TRUE(PrefillStep(stub.get(), "chat", 4, &rng, absl::Seconds(30), token).ok());
  const grpc::Status ended = EndRound(stub.get(), "chat", &end, absl::Seconds(30), token);
  ASSERT_TRUE(ended.ok()) << ended.error_message();
  EXPECT_EQ(end.round(), 1u);
  EXPECT_EQ((*worker)->segments()->reroutes(), 1u);
  auto client_of = [&](testing::StoreProcess* p) {
    StoreClientOptions o;
    o.target = p->target();
    return std::move(StoreClient::Connect(o)).value();
  };
  CallOptions as_acme;
  as_acme.tenant = "acme";
  auto rounds_on = [&](testing::StoreProcess* p) {
    auto list = client_of(p)->ListRounds("chat", as_acme);
    std::vector<uint32_t> out;
    if (list.ok()) {
      for (const auto& r : list->rounds()) out.push_back(r.round());
    }
    return out;
  };
  EXPECT_THAT(rounds_on(survivor), ::testing::ElementsAre(0u, 1u));
  // Repair copies round 0 from the survivor to the spare.
  const absl::Time repaired_by = absl::Now() + absl::Seconds(20);
  while ((ctl->RepairsPending() > 0 || rounds_on(spare).size() < 2) && absl::Now() < repaired_by) {
    // Timed: the controller's repair threads copy between store processes.
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(ctl->RepairsPending(), 0u);
  EXPECT_EQ(ctl->UnderReplicated(), 0u);
  ASSERT_THAT(rounds_on(spare), ::testing::ElementsAre(0u, 1u));
  const RepairStats rs = (*controller)->repairer()->stats();
  EXPECT_EQ(rs.sessions_repaired, 1u);
  EXPECT_GE(rs.segments_copied + rs.segments_present, 2u);  // Round 0 at least.
  const std::vector<v1::SegmentRef> refs = testing::BothSegments(2);
  auto from_survivor = client_of(survivor)->GetSegments("chat", refs, as_acme);
  auto from_spare = client_of(spare)->GetSegments("chat", refs, as_acme);
  ASSERT_TRUE(from_survivor.ok()) << from_survivor.status();
  ASSERT_TRUE(from_spare.ok()) << from_spare.status();
  for (size_t i = 0; i < refs.size(); ++i) {
    EXPECT_TRUE((*from_survivor)[i].payload == (*from_spare)[i].payload) << "segment " << i;
    EXPECT_EQ((*from_survivor)[i].info.layer_end(), (*from_spare)[i].info.layer_end());
  }
  // The copy was not counted as a recall on the survivor: round 0 was
  // recalled once (by round 1's prefill), plus this test's own read.
  auto listed = client_of(survivor)->ListRounds("chat", as_acme);
  ASSERT_TRUE(listed.ok());
  EXPECT_LE(listed->rounds(0).summary().recall_count(), 2u);
}

// Worker failover: a worker that never held a session resumes it from the
// store (OpenSession with resume) and answers the next step exactly as the
// worker that held it does (a lossless policy; same inputs, same outputs).
TEST(WorkerResumeTest, AnotherWorkerResumesFromTheStore) {
  testing::TempDir dir;
  testing::StoreProcess store(dir.path() + "/db");
  ASSERT_TRUE(store.Start().ok());
  auto start_worker = [&]() {
    WorkerServerOptions wo;
    wo.listen = "127.0.0.1:0";
    wo.metrics_listen = "";
    wo.store.target = store.target();
    return std::move(WorkerServer::Start(wo)).value();
  };
  auto a = start_worker();
  auto b = start_worker();
  auto stub_for = [](WorkerServer& w) {
    return v1::Worker::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", w.port()),
                                                   grpc::InsecureChannelCredentials()));
  };
  auto sa = stub_for(*a), sb = stub_for(*b);
  auto open = [](v1::Worker::Stub* stub, bool resume, v1::OpenSessionResponse* r) {
    v1::OpenSessionRequest req = OpenRequest("f");
    req.set_resume(resume);
    grpc::ClientContext c;
    return stub->OpenSession(&c, req, r);
  };
  v1::OpenSessionResponse ra, rb;
  EXPECT_EQ(open(sb.get(), true, &rb).error_code(), grpc::StatusCode::NOT_FOUND);
  ASSERT_TRUE(open(sa.get(), false, &ra).ok());
  std::mt19937 rng(21);
  v1::EndRoundResponse end;
  for (int round = 0; round < 3; ++round) {
    ASSERT_TRUE(PrefillStep(sa.get(), "f", 5, &rng).ok());
    ASSERT_TRUE(EndRound(sa.get(), "f", &end).ok());
  }
  // b never held "f": it resumes from the store's three rounds.
  ASSERT_TRUE(open(sb.get(), true, &rb).ok());
  EXPECT_EQ(rb.next_round(), 3u);
  // Resuming a session the worker holds is ALREADY_EXISTS.
  EXPECT_EQ(open(sb.get(), true, &rb).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  // The same step on both workers: the same outputs.
  std::vector<std::vector<float>> q(kLayers), k(kLayers), v(kLayers);
  std::normal_distribution<float> nd;
  for (int l = 0; l < kLayers; ++l) {
    for (auto* x : {&q[l], &k[l], &v[l]}) {
      x->resize((x == &q[l] ? kQHeads : kKvHeads) * kDim * 4);
      for (float& e : *x) e = nd(rng);
    }
  }
  auto step = [&](v1::Worker::Stub* stub) {
    std::vector<std::vector<float>> outs;
    grpc::ClientContext c;
    auto s = stub->Prefill(&c);
    for (int l = 0; l < kLayers; ++l) {
      v1::LayerRequest req;
      if (l == 0) req.set_session_id("f");
      req.set_layer(l);
      *req.mutable_q() = Dense(q[l], 4, kQHeads);
      *req.mutable_k() = Dense(k[l], 4, kKvHeads);
      *req.mutable_v() = Dense(v[l], 4, kKvHeads);
      v1::LayerResponse resp;
      EXPECT_TRUE(s->Write(req) && s->Read(&resp));
      outs.push_back(Floats(resp.o()));
    }
    s->WritesDone();
    EXPECT_TRUE(s->Finish().ok());
    return outs;
  };
  const auto out_a = step(sa.get());
  const auto out_b = step(sb.get());
  ASSERT_EQ(out_a.size(), out_b.size());
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_EQ(out_a[l].size(), static_cast<size_t>(4 * kQHeads * kDim));
    EXPECT_EQ(out_a[l], out_b[l]) << "layer " << l;
  }
  // b carries on: its round is round 3.
  ASSERT_TRUE(EndRound(sb.get(), "f", &end).ok());
  EXPECT_EQ(end.round(), 3u);
}

// A controller (heartbeats every 100 ms, sessions cold after 300 ms), a
// kvtier-store process and an in-process worker, both joined to it.
struct PressureCluster {
  absl::Status Start(double pressure_moderate, double pressure_high, const std::string& store_id,
                     const std::string& disk_budget_mb, const std::string& worker_id,
                     uint64_t max_working_set_bytes) {
    ControllerServerOptions co;
    co.listen = "127.0.0.1:0";
    co.metrics_listen = "";
    co.controller.membership.heartbeat_interval = absl::Milliseconds(100);
    co.controller.membership.warmup = absl::ZeroDuration();
    co.controller.membership.pressure_moderate = pressure_moderate;
    co.controller.membership.pressure_high = pressure_high;
    co.policy.cold_after = absl::Milliseconds(300);
    KVT_ASSIGN_OR_RETURN(controller, ControllerServer::Start(co));
    target = absl::StrCat("127.0.0.1:", controller->port());
    store = std::make_unique<testing::StoreProcess>(
        dir.path() + "/db",
        std::vector<std::string>{"--controller=" + target, "--node_id=" + store_id,
                                 "--disk_budget_mb=" + disk_budget_mb});
    KVT_RETURN_IF_ERROR(store->Start());
    WorkerServerOptions wo;
    wo.listen = "127.0.0.1:0";
    wo.metrics_listen = "";
    wo.store.target = store->target();
    wo.cluster.controller = target;
    wo.cluster.node_id = worker_id;
    wo.engine.max_working_set_bytes = max_working_set_bytes;
    KVT_ASSIGN_OR_RETURN(worker, WorkerServer::Start(wo));
    stub = v1::Worker::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", worker->port()),
                                                   grpc::InsecureChannelCredentials()));
    return absl::OkStatus();
  }

  testing::TempDir dir;
  std::unique_ptr<ControllerServer> controller;
  std::string target;  // The controller's address.
  std::unique_ptr<testing::StoreProcess> store;
  std::unique_ptr<WorkerServer> worker;
  std::unique_ptr<v1::Worker::Stub> stub;
};

// Memory pressure end to end, with a real controller, store and worker: a
// model's policy is registered; a session opens without a Policy and gets
// it; once the session is cold and its nodes are under pressure (the
// thresholds here make any use HIGH), the worker runs its next rounds with
// the tightened policy (raw -> 4-bit KIVI), and the store drops the
// session's never-recalled rounds but its newest. The session goes on.
TEST(WorkerPressureTest, ColdSessionsGetTighterPoliciesAndLoseUnrecalledRounds) {
  PressureCluster pc;
  const absl::Status started =
      pc.Start(1e-9, 1e-9, "store-p", "64", "worker-p", uint64_t{64} << 20);
  ASSERT_TRUE(started.ok()) << started;
  ControllerClientOptions cco;
  cco.target = pc.target;
  auto admin = std::move(ControllerClient::Connect(cco)).value();

  // The model's policy recalls only a round that takes all the attention
  // mass (round 0, the one past round of round 1), so rounds 1 and 2 are
  // never recalled.
  v1::SetPolicyRequest set;
  set.set_model_name("tiny");
  set.mutable_policy()->set_watershed_layer(1);
  set.mutable_policy()->set_recall("threshold:1");
  set.mutable_policy()->set_keep_recent_round(false);
  {
    auto registered = admin->SetPolicy(set);
    ASSERT_TRUE(registered.ok()) << registered.status();
  }
  v1::OpenSessionRequest open = OpenRequest("p");
  open.clear_policy();
  open.mutable_model()->set_name("tiny");
  {
    grpc::ClientContext c;
    v1::OpenSessionResponse r;
    const grpc::Status st = pc.stub->OpenSession(&c, open, &r);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(r.effective_policy().recall(), "threshold:1");
    EXPECT_FALSE(r.effective_policy().keep_recent_round());
  }
  std::mt19937 rng(9);
  v1::EndRoundResponse end;
  for (int round = 0; round < 3; ++round) {
    ASSERT_TRUE(PrefillStep(pc.stub.get(), "p", 4, &rng).ok());
    ASSERT_TRUE(EndRound(pc.stub.get(), "p", &end).ok());
  }
  worker::Engine* engine = pc.worker->engine();
  const worker::SessionKey key("", "p");
  auto stats = engine->Stats(key);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->policy.codec.codec, Codec::kRaw);

  StoreClientOptions so;
  so.target = pc.store->target();
  auto client = std::move(StoreClient::Connect(so)).value();
  const absl::Time until = absl::Now() + absl::Seconds(15);
  bool tightened = false, dropped = false;
  while ((!tightened || !dropped) && absl::Now() < until) {
    // ListRounds is a use of the session: poll slower than it goes cold.
    absl::SleepFor(absl::Milliseconds(700));
    stats = engine->Stats(key);
    tightened =
        stats.ok() && stats->policy.codec.codec == Codec::kKivi && stats->policy.codec.bits == 4;
    auto listed = client->ListRounds("p");
    // Round 1 goes; round 2 is the newest.
    dropped = listed.ok() && listed->rounds_size() >= 1 &&
              listed->rounds(listed->rounds_size() - 1).round() == 2;
    if (dropped) {
      for (const auto& r : listed->rounds()) dropped &= r.round() != 1;
    }
  }
  EXPECT_TRUE(tightened) << "the worker never applied the tightened policy";
  EXPECT_TRUE(dropped) << "the store never dropped round 1";
  EXPECT_EQ(stats->policy.watershed_layer, 1);  // Stored rounds stay split where they were.

  // GetPolicy says why, and the metrics count it.
  v1::GetPolicyRequest q;
  q.set_session_id("p");
  q.mutable_model()->set_name("tiny");
  q.set_idle_ms(1000);
  q.set_node_id("worker-p");
  auto answer = admin->GetPolicy(q);
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_TRUE(answer->tightened());
  EXPECT_EQ(answer->pressure(), v1::PRESSURE_HIGH);
  EXPECT_THAT(
      pc.controller->RenderMetrics(),
      ::testing::HasSubstr("kvtier_controller_node_pressure{kind=\"store\",node=\"store-p\"} 2"));

  // The session goes on, its new rounds 4-bit.
  ASSERT_TRUE(PrefillStep(pc.stub.get(), "p", 4, &rng).ok());
  ASSERT_TRUE(EndRound(pc.stub.get(), "p", &end).ok());
  EXPECT_EQ(end.round(), 3u);
}

// A workload that writes past the cluster's budget: one store with a 1 MiB
// disk budget (its capacity in the cluster), two sessions that go cold, and
// a pinned session that keeps writing. The store frees what it can (the
// cold sessions' rounds, never-recalled ones first) and answers
// RESOURCE_EXHAUSTED, as backpressure, only when nothing unpinned is left to
// drop; the controller saw the store at HIGH; no process dies, and the
// pinned session's acknowledged rounds are all there.
TEST(WorkerPressureTest, WritesPastTheBudgetAreRefusedOnlyWhenNothingCanBeFreed) {
  PressureCluster pc;
  const absl::Status started = pc.Start(0.80, 0.95, "store-b", "1", "worker-b", 0);
  ASSERT_TRUE(started.ok()) << started;
  StoreClientOptions so;
  so.target = pc.store->target();
  auto client = std::move(StoreClient::Connect(so)).value();
  auto open = [&](const std::string& id) {
    grpc::ClientContext c;
    v1::OpenSessionResponse r;
    return pc.stub->OpenSession(&c, OpenRequest(id), &r);
  };
  std::mt19937 rng(13);
  v1::EndRoundResponse end;
  // Two sessions write 4 rounds each (about 25 KB a round) and go cold.
  for (const char* id : {"cold-0", "cold-1"}) {
    ASSERT_TRUE(open(id).ok());
    for (int round = 0; round < 4; ++round) {
      ASSERT_TRUE(PrefillStep(pc.stub.get(), id, 256, &rng).ok());
      ASSERT_TRUE(EndRound(pc.stub.get(), id, &end).ok());
    }
  }
  // The pinned one writes until the store refuses.
  ASSERT_TRUE(open("pinned").ok());
  ASSERT_TRUE(PrefillStep(pc.stub.get(), "pinned", 256, &rng).ok());
  ASSERT_TRUE(EndRound(pc.stub.get(), "pinned", &end).ok());
  ASSERT_TRUE(client->PinSession("pinned", true).ok());
  int acknowledged = 1;
  uint64_t pinned_bytes = end.stored_bytes();
  const uint64_t round_bytes = end.stored_bytes();
  grpc::Status refused;
  for (int round = 1; round < 200 && refused.ok(); ++round) {
    ASSERT_TRUE(PrefillStep(pc.stub.get(), "pinned", 256, &rng).ok()) << "round " << round;
    refused = EndRound(pc.stub.get(), "pinned", &end);
    if (refused.ok()) {
      ++acknowledged;
      pinned_bytes += end.stored_bytes();
    }
  }
  ASSERT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_THAT(refused.error_message(), ::testing::HasSubstr("disk budget"));
  // Refused only when the pinned rounds alone leave no room for one more.
  EXPECT_LE(pinned_bytes, uint64_t{1} << 20);
  EXPECT_GT(pinned_bytes + round_bytes, uint64_t{1} << 20);
  // Nothing unpinned was left to drop, and the pinned rounds are all there.
  for (const char* id : {"cold-0", "cold-1"}) {
    auto listed = client->ListRounds(id);
    EXPECT_TRUE(!listed.ok() || listed->rounds_size() == 0) << id << " still holds rounds";
  }
  auto pinned = client->ListRounds("pinned");
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_EQ(pinned->rounds_size(), acknowledged);
  auto stats = client->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_GE(stats->drops(), 8u);
  // The controller saw the store at HIGH (every stored byte counts against
  // its budget).
  const absl::Time until = absl::Now() + absl::Seconds(5);
  const std::string high = "kvtier_controller_node_pressure{kind=\"store\",node=\"store-b\"} 2";
  while (!absl::StrContains(pc.controller->RenderMetrics(), high) && absl::Now() < until) {
    // Timed: pressure comes with the next heartbeats of real processes.
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_THAT(pc.controller->RenderMetrics(), ::testing::HasSubstr(high));
  // Both processes are alive and serve: the open round can still be closed.
  grpc::ClientContext c;
  v1::CloseSessionRequest close;
  close.set_session_id("pinned");
  v1::CloseSessionResponse closed;
  EXPECT_TRUE(pc.stub->CloseSession(&c, close, &closed).ok());
  EXPECT_TRUE(client->ListRounds("pinned").ok());
}

// A worker is live while it runs and ready while its store answers: its gRPC
// health ("" and "kvtier.v1.Worker") and /readyz follow a SIGSTOPped store
// and its return; /healthz stays 200. The store serves its own name too.
TEST(WorkerHealthTest, ReadinessFollowsTheStore) {
  using ::testing::HasSubstr;
  testing::WorkerStackOptions o;
  o.metrics_listen = "127.0.0.1:0";
  o.store_probe_interval = absl::Milliseconds(300);
  testing::WorkerStack stack;
  ASSERT_THAT(stack.Start(o), IsOk());
  const int http = stack.server()->metrics_port();
  ASSERT_GT(http, 0);
  auto ready = [&] { return absl::StrContains(testing::HttpGet(http, "/readyz"), " 200 OK"); };
  ASSERT_TRUE(Eventually(ready)) << testing::HttpGet(http, "/readyz");
  EXPECT_EQ(testing::GrpcHealthStatus(stack.channel(), ""), 1);
  EXPECT_EQ(testing::GrpcHealthStatus(stack.channel(), "kvtier.v1.Worker"), 1);
  EXPECT_THAT(testing::HttpGet(http, "/healthz"), HasSubstr("\r\n\r\nok\n"));
  EXPECT_THAT(testing::HttpGet(http, "/metrics"), HasSubstr("kvtier_worker_"));
  auto store_channel =
      grpc::CreateChannel(stack.store()->target(), grpc::InsecureChannelCredentials());
  EXPECT_EQ(testing::GrpcHealthStatus(store_channel, "kvtier.v1.Store"), 1);

  stack.store()->Pause();
  ASSERT_TRUE(Eventually([&] { return !ready(); }));
  const std::string body = testing::HttpGet(http, "/readyz");
  EXPECT_THAT(body, HasSubstr(" 503 "));
  EXPECT_THAT(body, HasSubstr("does not answer"));
  EXPECT_THAT(body, HasSubstr(stack.store()->target()));
  EXPECT_EQ(testing::GrpcHealthStatus(stack.channel(), ""), 2);
  EXPECT_EQ(testing::GrpcHealthStatus(stack.channel(), "kvtier.v1.Worker"), 2);
  EXPECT_THAT(testing::HttpGet(http, "/healthz"), HasSubstr(" 200 OK"));

  stack.store()->Resume();
  ASSERT_TRUE(Eventually(ready));
  EXPECT_EQ(testing::GrpcHealthStatus(stack.channel(), "kvtier.v1.Worker"), 1);
}

// Rounds record the identity of the model that made them: a worker never
// resumes a session from rounds of another model of the same shape.
TEST(WorkerResumeTest, RoundsOfAnotherModelAreNeverResumed) {
  testing::TempDir dir;
  testing::StoreProcess store(dir.path() + "/db");
  ASSERT_TRUE(store.Start().ok());
  WorkerServerOptions wo;
  wo.listen = "127.0.0.1:0";
  wo.metrics_listen = "";
  wo.store.target = store.target();
  auto a = std::move(WorkerServer::Start(wo)).value();
  auto b = std::move(WorkerServer::Start(wo)).value();
  auto stub_for = [](WorkerServer& w) {
    return v1::Worker::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", w.port()),
                                                   grpc::InsecureChannelCredentials()));
  };
  auto sa = stub_for(*a), sb = stub_for(*b);
  auto open = [](v1::Worker::Stub* stub, bool resume, uint64_t model, v1::OpenSessionResponse* r) {
    v1::OpenSessionRequest req = OpenRequest("m");
    req.set_resume(resume);
    req.mutable_model()->set_model_digest(model);
    grpc::ClientContext c;
    return stub->OpenSession(&c, req, r);
  };
  v1::OpenSessionResponse r;
  ASSERT_TRUE(open(sa.get(), false, 0x1111, &r).ok());
  std::mt19937 rng(5);
  v1::EndRoundResponse end;
  for (int round = 0; round < 2; ++round) {
    ASSERT_TRUE(PrefillStep(sa.get(), "m", 5, &rng).ok());
    ASSERT_TRUE(EndRound(sa.get(), "m", &end).ok());
  }
  const grpc::Status other = open(sb.get(), true, 0x2222, &r);
  EXPECT_EQ(other.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(other.error_message(), ::testing::HasSubstr("holds K/V of model 0000000000001111"));
  EXPECT_THAT(other.error_message(),
              ::testing::HasSubstr("this session's model is 0000000000002222"));
  ASSERT_TRUE(open(sb.get(), true, 0x1111, &r).ok());
  EXPECT_EQ(r.next_round(), 2u);
}

}  // namespace
}  // namespace kvtier
