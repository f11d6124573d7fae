// kvtier-controller over loopback gRPC: node registration and leases with
// real time, routes for tenants, the statuses of the contract.
#include <fstream>

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "client/controller_client.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "services/controller/controller_server.h"
#include "services/worker/worker_server.h"
#include "testing/store_process.h"
#include "testing/test_util.h"
#include "tests/util/raw_unary.h"
#include "tests/util/status_matchers.h"

namespace kvtier {
namespace {

constexpr char kNodeToken[] = "node-token-00001";
constexpr char kAcmeToken[] = "acme-token-00001";
// Node tokens bound to one node each (node_id=, node_kind=).
constexpr char kStoreAToken[] = "store-a-token-01";
constexpr char kStoreBToken[] = "store-b-token-01";

class ControllerServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::WriteFile(dir_.path() + "/tenants",
                       absl::StrCat(kNodeToken, " nodes node\n", kAcmeToken, " acme readwrite\n",
                                    kStoreAToken, " store-a node node_id=sa node_kind=store\n",
                                    kStoreBToken, " store-b node node_id=sb node_kind=store\n"));
    ControllerServerOptions o;
    o.listen = "127.0.0.1:0";
    o.metrics_listen = "";
    o.tenants_file = dir_.path() + "/tenants";
    o.controller.membership.heartbeat_interval = absl::Milliseconds(100);
    o.controller.membership.missed_heartbeats = 3;
    o.controller.membership.warmup = absl::ZeroDuration();
    o.controller.membership.clock = clock_;
    o.controller.replicas = 2;
    auto s = ControllerServer::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    stub_ = v1::Controller::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                                        grpc::InsecureChannelCredentials()));
  }

  std::unique_ptr<grpc::ClientContext> Ctx(const std::string& token) {
    auto c = std::make_unique<grpc::ClientContext>();
    c->AddMetadata("authorization", "Bearer " + token);
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    return c;
  }
  grpc::Status Register(const std::string& id, v1::NodeKind kind, const std::string& addr,
                        const std::string& token = kNodeToken) {
    v1::RegisterRequest r;
    r.set_node_id(id);
    r.set_kind(kind);
    r.set_address(addr);
    v1::RegisterResponse resp;
    auto c = Ctx(token);
    grpc::Status s = stub_->Register(c.get(), r, &resp);
    if (s.ok()) {
      EXPECT_EQ(resp.heartbeat_interval_ms(), 100u);
    }
    return s;
  }
  grpc::Status Beat(const std::string& id, const std::string& token = kNodeToken) {
    v1::HeartbeatRequest r;
    r.set_node_id(id);
    r.set_used_bytes(123);
    v1::HeartbeatResponse resp;
    auto c = Ctx(token);
    return stub_->Heartbeat(c.get(), r, &resp);
  }
  grpc::Status Route(const std::string& session, v1::RouteResponse* resp) {
    v1::RouteRequest r;
    r.set_session_id(session);
    auto c = Ctx(kAcmeToken);
    return stub_->Route(c.get(), r, resp);
  }
  uint64_t Epoch() {
    v1::ListNodesResponse resp;
    auto c = Ctx(kAcmeToken);
    EXPECT_TRUE(stub_->ListNodes(c.get(), {}, &resp).ok());
    return resp.epoch();
  }

  // The controller's clock: real unless a test moves it (FakeClockTest).
  Clock* clock_ = Clock::Real();
  testing::TempDir dir_;
  std::unique_ptr<ControllerServer> server_;
  std::unique_ptr<v1::Controller::Stub> stub_;
};

// Leases run on a clock the test moves: a node misses its lease when the
// test says, and the sweep runs when the test calls it (the background
// sweeper, on real time, may run it too; either way it runs once a death).
class ControllerServiceFakeClockTest : public ControllerServiceTest {
 protected:
  void SetUp() override {
    clock_ = &fake_;
    ControllerServiceTest::SetUp();
  }
  FakeClock fake_;
};

TEST_F(ControllerServiceFakeClockTest, MembershipAndRoutes) {
  v1::RouteResponse route;
  EXPECT_EQ(Route("chat-1", &route).error_code(), grpc::StatusCode::UNAVAILABLE);
  // Only node tokens register; kinds and addresses are checked.
  EXPECT_EQ(Register("s1", v1::NODE_KIND_STORE, "10.0.0.1:7070", kAcmeToken).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Register("s1", v1::NODE_KIND_STORE, "10.0.0.1:7070", "wrong-token-1").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Register("s1", v1::NODE_KIND_UNSPECIFIED, "10.0.0.1:7070").error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(Register("s1", v1::NODE_KIND_STORE, "10.0.0.1:7070").ok());
  ASSERT_TRUE(Register("s2", v1::NODE_KIND_STORE, "10.0.0.2:7070").ok());
  ASSERT_TRUE(Register("s3", v1::NODE_KIND_STORE, "10.0.0.3:7070").ok());
  ASSERT_TRUE(Register("w1", v1::NODE_KIND_WORKER, "10.0.1.1:7071").ok());
  EXPECT_EQ(Register("w2", v1::NODE_KIND_WORKER, "10.0.1.1:7071").error_code(),
            grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(Beat("nobody").error_code(), grpc::StatusCode::NOT_FOUND);

  ASSERT_TRUE(Route("chat-1", &route).ok());
  EXPECT_EQ(route.worker_address(), "10.0.1.1:7071");
  ASSERT_EQ(route.store_addresses_size(), 2);
  EXPECT_NE(route.store_addresses(0), route.store_addresses(1));
  EXPECT_EQ(route.store_address(), route.store_addresses(0));
  EXPECT_TRUE(route.placed_now());
  const std::string gone = route.store_node_ids(0);
  const uint64_t epoch = Epoch();
  EXPECT_EQ(route.epoch(), epoch);

  // Every node but `gone` keeps beating; `gone` misses its lease (300 ms).
  for (int i = 0; i < 4; ++i) {
    fake_.AdvanceMs(100);
    for (const char* id : {"s1", "s2", "s3", "w1"}) {
      if (id != gone) {
        ASSERT_TRUE(Beat(id).ok()) << id;
      }
    }
  }
  server_->controller()->Tick();
  ASSERT_TRUE(server_->controller()->ReplaceDeadStores().ok());
  ASSERT_NE(Epoch(), epoch);
  EXPECT_EQ(Beat(gone).error_code(), grpc::StatusCode::NOT_FOUND);
  v1::RouteResponse again;
  ASSERT_TRUE(Route("chat-1", &again).ok());
  EXPECT_GT(again.epoch(), epoch);
  EXPECT_FALSE(again.placed_now());  // The sweep replaced the dead replica already.
  ASSERT_EQ(again.store_node_ids_size(), 2);
  EXPECT_EQ(again.store_node_ids(0), route.store_node_ids(1));  // The survivor stays first.
  EXPECT_NE(again.store_node_ids(1), gone);
  // It comes back and may register again.
  EXPECT_TRUE(
      Register(gone, v1::NODE_KIND_STORE, absl::StrCat("10.0.0.", gone.substr(1), ":7070")).ok());
  v1::GetPolicyRequest ask;
  ask.set_session_id("chat-1");
  ask.mutable_model()->set_name("no-such-model");
  v1::GetPolicyResponse pol;
  auto c = Ctx(kAcmeToken);
  EXPECT_EQ(stub_->GetPolicy(c.get(), ask, &pol).error_code(), grpc::StatusCode::NOT_FOUND);
}

// Per-model policies: registered by a node token, validated, served as
// registered, and tightened for cold sessions while a node of theirs is
// under pressure; levels follow the heartbeats' usage; kept across a
// restart with --state_dir.
// A node token bound to one node id and kind acts as that node only, and
// no other token (bound elsewhere, or shared) may Register or Heartbeat it:
// a leaked or compromised node cannot keep another alive, move its address
// or change its capacity.
TEST_F(ControllerServiceTest, NodeTokensAreBoundToTheirNodes) {
  ASSERT_TRUE(Register("sa", v1::NODE_KIND_STORE, "10.0.0.1:7070", kStoreAToken).ok());
  ASSERT_TRUE(Register("sb", v1::NODE_KIND_STORE, "10.0.0.2:7070", kStoreBToken).ok());
  for (const char* token : {kStoreBToken, kNodeToken}) {
    const grpc::Status st = Register("sa", v1::NODE_KIND_STORE, "10.6.6.6:7070", token);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << token;
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr("'sa'")) << st.error_message();
    EXPECT_EQ(Beat("sa", token).error_code(), grpc::StatusCode::PERMISSION_DENIED) << token;
  }
  // Its own token, but another kind or another id.
  EXPECT_EQ(Register("sa", v1::NODE_KIND_WORKER, "10.0.0.1:7071", kStoreAToken).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Register("free", v1::NODE_KIND_STORE, "10.0.0.9:7070", kStoreAToken).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Beat("sb", kStoreAToken).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  // The shared token still runs the nodes no token is bound to; the bound
  // ones beat for themselves.
  EXPECT_TRUE(Register("free", v1::NODE_KIND_STORE, "10.0.0.9:7070").ok());
  EXPECT_TRUE(Beat("free").ok());
  EXPECT_TRUE(Beat("sa", kStoreAToken).ok());
  v1::ListNodesResponse nodes;
  auto c = Ctx(kAcmeToken);
  ASSERT_TRUE(stub_->ListNodes(c.get(), {}, &nodes).ok());
  for (const v1::NodeStatus& n : nodes.nodes()) {
    if (n.node_id() == "sa") {
      EXPECT_EQ(n.address(), "10.0.0.1:7070");
    }
    if (n.node_id() == "sb") {
      EXPECT_EQ(n.address(), "10.0.0.2:7070");
      EXPECT_EQ(n.used_bytes(), 0u);  // No other token's heartbeat reached it.
    }
  }
}

// Addresses are checked before they are stored anywhere: whitespace and
// control bytes, a missing or out-of-range port are INVALID_ARGUMENT, and a
// 10 kB address is refused with a short message (not echoed into the
// status, where the client would see RESOURCE_EXHAUSTED about metadata).
TEST_F(ControllerServiceTest, RegisterRefusesMalformedAddresses) {
  for (const std::string& bad :
       {std::string("10.0.0.1:70 70"), std::string("10.0.0.1:7070\n"), std::string("10.0.0.1"),
        std::string("10.0.0.1:99999"), std::string(10'000, 'a') + ":1"}) {
    const grpc::Status st = Register("s1", v1::NODE_KIND_STORE, bad);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_LT(st.error_message().size(), 400u);
  }
  EXPECT_TRUE(Register("s1", v1::NODE_KIND_STORE, "store-1.kvtier.svc:7070").ok());
  // A worker's reported sessions name their stores: checked as well.
  v1::RegisterRequest w;
  w.set_node_id("w1");
  w.set_kind(v1::NODE_KIND_WORKER);
  w.set_address("10.0.1.1:7071");
  v1::HeldSession* h = w.add_sessions();
  h->set_tenant("acme");
  h->set_session_id("chat");
  h->add_store_addresses("10.0.0.1:7070\r\nX-Evil: 1");
  v1::RegisterResponse resp;
  auto c = Ctx(kNodeToken);
  const grpc::Status st = stub_->Register(c.get(), w, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_THAT(st.error_message(), ::testing::HasSubstr("held session store address"));
}

// Bytes that do not parse, on every method: INVALID_ARGUMENT naming the
// message (gRPC's own handler answered UNIMPLEMENTED with no details).
TEST_F(ControllerServiceTest, UnparseableRequestsAreInvalidArgumentOnEveryMethod) {
  auto ch = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                grpc::InsecureChannelCredentials());
  const std::string garbage("\xff\xff\xff\xff\x0f\x01\x02", 7);
  for (const char* m : {"Register", "Heartbeat", "Route", "ListNodes", "GetPolicy", "SetPolicy"}) {
    const grpc::Status st =
        testing::RawUnary(ch, absl::StrCat("/kvtier.v1.Controller/", m), garbage, kNodeToken);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << m;
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr("does not parse as kvtier.v1.")) << m;
  }
}

// Mutual TLS: the controller requires client certificates from its CA, and
// a node's certificate is its identity (cert: lines, bound with node_id=).
// A real kvtier-store joins with its certificate and no token; a client
// with a certificate from another CA, or with none, never gets a call
// through; a node's certificate cannot register or heartbeat another node;
// a tenant's certificate is that tenant.
TEST(ControllerMutualTlsTest, CertificatesAreIdentities) {
  testing::TempDir dir;
  auto ca = testing::TestCa::Make(dir.path(), "kvtier-ca");
  if (absl::IsUnavailable(ca.status())) GTEST_SKIP() << ca.status();
  ASSERT_TRUE(ca.ok()) << ca.status();
  auto rogue = testing::TestCa::Make(dir.path(), "rogue-ca");
  ASSERT_TRUE(rogue.ok()) << rogue.status();
  auto server = ca->Issue("controller", "DNS:localhost,IP:127.0.0.1");
  auto s0 = ca->Issue("store-0", "DNS:store-0");
  auto s1 = ca->Issue("store-1", "DNS:store-1");
  auto acme = ca->Issue("acme", "DNS:acme");
  auto fake = rogue->Issue("fake-store-0", "DNS:store-0");
  for (const auto* c : {&server, &s0, &s1, &acme, &fake}) ASSERT_TRUE(c->ok()) << c->status();
  testing::WriteFile(dir.path() + "/tenants",
                     "cert:store-0 store-0 node node_id=store-0 node_kind=store\n"
                     "cert:store-1 store-1 node node_id=store-1 node_kind=store\n"
                     "cert:acme    acme    readwrite\n");
  ControllerServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_listen = "";
  o.tenants_file = dir.path() + "/tenants";
  o.tls_cert = server->cert;
  o.tls_key = server->key;
  o.tls_client_ca = ca->cert_path();
  o.controller.membership.heartbeat_interval = absl::Milliseconds(100);
  o.controller.membership.warmup = absl::ZeroDuration();
  auto controller = ControllerServer::Start(o);
  ASSERT_TRUE(controller.ok()) << controller.status();
  const std::string target = absl::StrCat("127.0.0.1:", (*controller)->port());
  auto client = [&](const std::string& roots, const testing::SelfSignedCert* me) {
    ControllerClientOptions co;
    co.target = target;
    co.tls_root_certs = roots;
    if (me != nullptr) {
      co.tls_cert_chain = me->pem;
      co.tls_private_key = testing::ReadFileOrDie(me->key);
    }
    return std::move(ControllerClient::Connect(co)).value();
  };
  auto node = [](const std::string& id, const std::string& address) {
    v1::RegisterRequest r;
    r.set_node_id(id);
    r.set_kind(v1::NODE_KIND_STORE);
    r.set_address(address);
    return r;
  };

  // A real store joins with its certificate as its only credential.
  testing::StoreProcess store(
      dir.path() + "/s0",
      {"--controller=" + target, "--controller_tls_root_certs=" + ca->cert_path(),
       "--tls_client_cert=" + s0->cert, "--tls_client_key=" + s0->key, "--node_id=store-0"});
  ASSERT_TRUE(store.Start().ok());
  auto tenant = client(ca->pem(), &*acme);
  const absl::Time until = absl::Now() + absl::Seconds(20);
  bool joined = false;
  while (!joined && absl::Now() < until) {
    auto nodes = tenant->ListNodes();  // acme's certificate is acme.
    ASSERT_TRUE(nodes.ok()) << nodes.status();
    joined = nodes->nodes_size() == 1 && nodes->nodes(0).node_id() == "store-0" &&
             nodes->nodes(0).live();
    // Timed: a store process joins with its first heartbeat.
    if (!joined) absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(joined) << "store-0 did not join over mutual TLS";

  // store-1's certificate may not act as store-0, nor register it elsewhere.
  auto other = client(ca->pem(), &*s1);
  EXPECT_THAT(other->Register(node("store-0", "127.0.0.1:1")).status(),
              testing::StatusIs(absl::StatusCode::kPermissionDenied));
  v1::HeartbeatRequest beat;
  beat.set_node_id("store-0");
  EXPECT_THAT(other->Heartbeat(beat).status(),
              testing::StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_TRUE(other->Register(node("store-1", "127.0.0.1:2")).ok());
  // A tenant's certificate is not a node's.
  EXPECT_THAT(tenant->Register(node("store-9", "127.0.0.1:3")).status(),
              testing::StatusIs(absl::StatusCode::kPermissionDenied));
  // A certificate from another CA, or none, never gets a call through.
  const std::vector<const testing::SelfSignedCert*> strangers = {&*fake, nullptr};
  for (const testing::SelfSignedCert* me : strangers) {
    auto c = client(ca->pem(), me);
    CallOptions call = CallOptions::Within(absl::Seconds(3));
    EXPECT_THAT(c->ListNodes(call).status(), testing::StatusIs(absl::StatusCode::kUnavailable))
        << (me == nullptr ? "no certificate" : "rogue CA");
  }
}

TEST(ControllerPolicyTest, PoliciesAndPressure) {
  testing::TempDir dir;
  testing::WriteFile(dir.path() + "/tenants",
                     absl::StrCat(kNodeToken, " nodes node\n", kAcmeToken, " acme readwrite\n"));
  ControllerServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_listen = "";
  o.tenants_file = dir.path() + "/tenants";
  o.controller.membership.heartbeat_interval = absl::Milliseconds(100);
  o.controller.membership.missed_heartbeats = 50;  // Nobody beats here but the test.
  o.controller.membership.warmup = absl::ZeroDuration();
  o.state_dir = dir.path() + "/state";
  o.policy.cold_after = absl::Seconds(60);
  auto server = ControllerServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  auto connect = [](int port, const char* token) {
    ControllerClientOptions co;
    co.target = absl::StrCat("127.0.0.1:", port);
    co.token = token;
    return std::move(ControllerClient::Connect(co)).value();
  };
  auto node = connect((*server)->port(), kNodeToken);
  auto acme = connect((*server)->port(), kAcmeToken);

  v1::SetPolicyRequest set;
  set.set_model_name("llama-8b");
  set.mutable_policy()->set_codec(v1::CODEC_KIVI);
  set.mutable_policy()->mutable_codec_params()->set_bits(4);
  set.mutable_policy()->set_eviction("snapkv");
  set.mutable_policy()->set_budget_tokens(256);
  set.mutable_policy()->set_recall("topk:2");
  EXPECT_EQ(acme->SetPolicy(set).status().code(), absl::StatusCode::kPermissionDenied);
  v1::SetPolicyRequest bad = set;
  bad.mutable_policy()->set_budget_tokens(0);  // snapkv needs a budget.
  EXPECT_EQ(node->SetPolicy(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad = set;
  bad.set_model_name("bad name");
  EXPECT_EQ(node->SetPolicy(bad).status().code(), absl::StatusCode::kInvalidArgument);
  auto done = node->SetPolicy(set);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_FALSE(done->replaced());
  v1::SetPolicyRequest profiled;
  profiled.set_model_name("tiny");
  profiled.mutable_policy()->set_window(8);
  for (uint32_t b : {64u, 40u, 12u}) profiled.add_layer_budgets(b);
  profiled.set_profile_name("evolkv-tiny");
  ASSERT_TRUE(node->SetPolicy(profiled).ok());

  // A store and a worker of known capacity; chat-1 lives on them.
  for (auto [id, kind] : {std::pair{"s1", v1::NODE_KIND_STORE}, {"w1", v1::NODE_KIND_WORKER}}) {
    v1::RegisterRequest r;
    r.set_node_id(id);
    r.set_kind(kind);
    r.set_address(absl::StrCat("10.0.0.", kind, ":7070"));
    r.set_capacity_bytes(1000);
    ASSERT_TRUE(node->Register(r).ok());
  }
  v1::RouteRequest route;
  route.set_session_id("chat-1");
  ASSERT_TRUE(acme->Route(route).ok());
  auto beat = [&](const char* id, uint64_t used) {
    v1::HeartbeatRequest hb;
    hb.set_node_id(id);
    hb.set_used_bytes(used);
    auto r = node->Heartbeat(hb);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->pressure() : v1::PRESSURE_LEVEL_UNSPECIFIED;
  };
  auto ask = [&](const std::string& model, uint64_t idle_ms) {
    v1::GetPolicyRequest q;
    q.set_session_id("chat-1");
    q.mutable_model()->set_name(model);
    q.set_idle_ms(idle_ms);
    auto r = acme->GetPolicy(q);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : v1::GetPolicyResponse();
  };
  EXPECT_EQ(beat("s1", 100), v1::PRESSURE_NONE);
  EXPECT_EQ(beat("w1", 100), v1::PRESSURE_NONE);
  v1::GetPolicyResponse a = ask("llama-8b", 3600 * 1000);  // Cold, no pressure.
  EXPECT_FALSE(a.tightened());
  EXPECT_EQ(a.pressure(), v1::PRESSURE_NONE);
  EXPECT_EQ(a.policy().codec_params().bits(), 4u);
  EXPECT_EQ(a.policy().budget_tokens(), 256u);
  EXPECT_EQ(a.policy().recall(), "topk:2");

  // The store passes 80%: MODERATE for it, and for chat-1.
  EXPECT_EQ(beat("s1", 850), v1::PRESSURE_MODERATE);
  a = ask("llama-8b", 5);  // Active: as registered.
  EXPECT_FALSE(a.tightened());
  EXPECT_EQ(a.pressure(), v1::PRESSURE_MODERATE);
  EXPECT_EQ(a.policy().budget_tokens(), 256u);
  a = ask("llama-8b", 120 * 1000);  // Cold: fewer bits, half the budget.
  EXPECT_TRUE(a.tightened());
  EXPECT_EQ(a.policy().codec(), v1::CODEC_KIVI);
  EXPECT_EQ(a.policy().codec_params().bits(), 2u);
  EXPECT_EQ(a.policy().budget_tokens(), 128u);
  EXPECT_EQ(a.policy().recall(), "topk:2");
  a = ask("tiny", 120 * 1000);  // Layer budgets halve, never to the window.
  EXPECT_TRUE(a.tightened());
  EXPECT_EQ(a.policy().eviction(), "profile");
  EXPECT_THAT(std::vector<uint32_t>(a.layer_budgets().begin(), a.layer_budgets().end()),
              ::testing::ElementsAre(32, 20, 9));
  EXPECT_EQ(a.policy().codec(), v1::CODEC_KIVI);  // Raw becomes 4-bit KIVI.
  EXPECT_EQ(a.policy().codec_params().bits(), 4u);
  EXPECT_EQ(beat("w1", 960), v1::PRESSURE_HIGH);
  EXPECT_EQ(ask("llama-8b", 120 * 1000).pressure(), v1::PRESSURE_HIGH);
  const std::string metrics = (*server)->RenderMetrics();
  EXPECT_THAT(metrics, ::testing::HasSubstr(
                           "kvtier_controller_node_pressure{kind=\"worker\",node=\"w1\"} 2"));
  EXPECT_THAT(metrics, ::testing::HasSubstr(
                           "kvtier_controller_policy_answers_total{result=\"tightened\"} 3"));
  EXPECT_THAT(metrics, ::testing::HasSubstr("kvtier_controller_policies 2"));
  // Back under the thresholds: as registered again.
  EXPECT_EQ(beat("w1", 10), v1::PRESSURE_NONE);
  EXPECT_EQ(beat("s1", 10), v1::PRESSURE_NONE);
  EXPECT_FALSE(ask("llama-8b", 120 * 1000).tightened());

  // A restarted controller serves the registered policies again.
  server->reset();
  server = ControllerServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  acme = connect((*server)->port(), kAcmeToken);
  v1::GetPolicyRequest q;
  q.set_session_id("chat-2");
  q.mutable_model()->set_name("llama-8b");
  auto again = acme->GetPolicy(q);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->policy().budget_tokens(), 256u);
  // A damaged policy file is refused, not served half.
  server->reset();
  {
    std::fstream f(o.state_dir + "/policies", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(30);
    f.put('\x7f');
  }
  auto broken = ControllerServer::Start(o);
  EXPECT_EQ(broken.status().code(), absl::StatusCode::kDataLoss);
}

// Real nodes join by themselves: a kvtier-store process and an in-process
// kvtier-worker started with --controller register and keep their leases; a
// killed store is declared dead, and a restarted one registers again.
TEST_F(ControllerServiceTest, NodesJoinAndLeaveByThemselves) {
  const std::string controller = absl::StrCat("127.0.0.1:", server_->port());
  testing::StoreProcess store(
      dir_.path() + "/db", {"--controller=" + controller,
                            std::string("--controller_token=") + kNodeToken, "--node_id=store-a"});
  ASSERT_TRUE(store.Start().ok());
  WorkerServerOptions wo;
  wo.listen = "127.0.0.1:0";
  wo.metrics_listen = "";
  wo.store.target = store.target();
  wo.cluster.controller = controller;
  wo.cluster.controller_token = kNodeToken;
  wo.cluster.node_id = "worker-a";
  auto worker = WorkerServer::Start(wo);
  ASSERT_TRUE(worker.ok()) << worker.status();

  auto live = [&](const std::string& id) {
    v1::ListNodesResponse resp;
    auto c = Ctx(kAcmeToken);
    EXPECT_TRUE(stub_->ListNodes(c.get(), {}, &resp).ok());
    for (const auto& n : resp.nodes()) {
      if (n.node_id() == id) return n.live();
    }
    return false;
  };
  auto wait_for = [&](const std::string& id, bool want) {
    const absl::Time until = absl::Now() + absl::Seconds(10);
    // Timed: leases run on the controller's real clock.
    while (live(id) != want && absl::Now() < until) absl::SleepFor(absl::Milliseconds(20));
    return live(id) == want;
  };
  ASSERT_TRUE(wait_for("store-a", true));
  ASSERT_TRUE(wait_for("worker-a", true));
  v1::RouteResponse route;
  ASSERT_TRUE(Route("chat-1", &route).ok());
  EXPECT_EQ(route.store_address(), store.target());
  EXPECT_EQ(route.worker_address(), absl::StrCat("127.0.0.1:", (*worker)->port()));
  // Leases hold over several intervals.
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_TRUE(live("store-a"));
  store.Kill();
  ASSERT_TRUE(wait_for("store-a", false));
  EXPECT_EQ(Route("chat-1", &route).error_code(), grpc::StatusCode::UNAVAILABLE);
  ASSERT_TRUE(store.Start().ok());
  ASSERT_TRUE(wait_for("store-a", true));
  ASSERT_TRUE(Route("chat-1", &route).ok());
  EXPECT_EQ(route.store_address(), store.target());
  // A worker that shuts down stops its heartbeats and is declared dead.
  worker->reset();
  ASSERT_TRUE(wait_for("worker-a", false));
}

}  // namespace
}  // namespace kvtier
