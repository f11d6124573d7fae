// kvtier-controller's etcd back end against a real etcd (Debian's
// etcd-server, started by the test on loopback): the client's calls, and two
// controller replicas in this process that share membership, placements and
// policies through it, one of them leading until it goes. Skips without
// etcd installed, except under CI=true.
#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/controller_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/controller/controller_server.h"
#include "services/controller/etcd_client.h"
#include "testing/test_util.h"
#include "tests/util/etcd_process.h"

namespace kvtier {
namespace {

class EtcdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (testing::EtcdProcess::Binary().empty()) {
      if (testing::InCi()) FAIL() << "CI=true but etcd (Debian's etcd-server) is not installed";
      GTEST_SKIP() << "needs etcd (Debian's etcd-server; scripts/kvtier.sh deps installs it)";
    }
    etcd_ = std::make_unique<testing::EtcdProcess>(dir_.path());
    absl::Status st = etcd_->Start();
    ASSERT_TRUE(st.ok()) << st;
  }
  std::unique_ptr<EtcdClient> Client() {
    EtcdOptions o;
    o.endpoints = {"http://127.0.0.1:1", etcd_->endpoint()};  // The first never answers.
    auto c = EtcdClient::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  testing::TempDir dir_;
  std::unique_ptr<testing::EtcdProcess> etcd_;
};

TEST_F(EtcdTest, ClientKeysLeasesAndCompareAndPut) {
  auto c = Client();
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->Put("p/a", "1").ok());
  ASSERT_TRUE(c->Put("p/b", std::string("two\0bytes", 9)).ok());
  ASSERT_TRUE(c->Put("q", "3").ok());
  auto all = c->GetPrefix("p/");
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].key, "p/a");
  EXPECT_EQ((*all)[1].value, std::string("two\0bytes", 9));
  auto none = c->Get("missing");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());

  auto put = c->CompareAndPut("c", "x", 0);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_TRUE(*put);
  EXPECT_FALSE(*c->CompareAndPut("c", "y", 0));  // It exists now.
  auto cur = c->Get("c");
  ASSERT_TRUE(cur.ok() && cur->has_value());
  EXPECT_TRUE(*c->CompareAndPut("c", "z", (*cur)->mod_revision));
  EXPECT_FALSE(*c->CompareAndPut("c", "w", (*cur)->mod_revision));  // Stale.
  EXPECT_EQ((*c->Get("c"))->value, "z");

  auto lease = c->Grant(absl::Seconds(5));
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(c->Put("l", "v", *lease).ok());
  EXPECT_TRUE(c->KeepAlive(*lease).ok());
  EXPECT_EQ((*c->Get("l"))->lease, *lease);
  ASSERT_TRUE(c->Revoke(*lease).ok());
  EXPECT_FALSE(c->Get("l")->has_value());  // Gone with its lease.
  EXPECT_EQ(c->KeepAlive(*lease).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(c->Delete("p/a").ok());
  EXPECT_EQ(c->GetPrefix("p/")->size(), 1u);
}

TEST_F(EtcdTest, ReplicasShareTheViewAndOneLeads) {
  ControllerServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_listen = "";
  o.controller.membership.heartbeat_interval = absl::Milliseconds(100);
  o.controller.membership.missed_heartbeats = 10;
  o.controller.membership.warmup = absl::ZeroDuration();
  o.etcd_endpoints = {etcd_->endpoint()};
  o.replica_id = "replica-a";
  auto a = ControllerServer::Start(o);
  ASSERT_TRUE(a.ok()) << a.status();
  o.replica_id = "replica-b";
  auto b = ControllerServer::Start(o);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE((*a)->leader());  // It campaigned first.
  EXPECT_FALSE((*b)->leader());

  auto client = [](const std::string& target) {
    ControllerClientOptions co;
    co.target = target;
    co.deadline = absl::Seconds(2);
    return std::move(ControllerClient::Connect(co)).value();
  };
  const std::string ta = absl::StrCat("127.0.0.1:", (*a)->port());
  const std::string tb = absl::StrCat("127.0.0.1:", (*b)->port());
  auto ca = client(ta), cb = client(tb);
  auto both = client(ta + "," + tb);  // What nodes and engines are given.

  // Nodes register at a; their heartbeats go wherever `both` reaches.
  for (auto [id, kind, address] : {std::tuple{"s1", v1::NODE_KIND_STORE, "10.0.0.1:7070"},
                                   {"w1", v1::NODE_KIND_WORKER, "10.0.0.2:7071"}}) {
    v1::RegisterRequest r;
    r.set_node_id(id);
    r.set_kind(kind);
    r.set_address(address);
    ASSERT_TRUE(ca->Register(r).ok());
  }
  std::atomic<bool> stop{false};
  std::thread beats([&] {
    while (!stop.load()) {
      for (const char* id : {"s1", "w1"}) {
        v1::HeartbeatRequest hb;
        hb.set_node_id(id);
        (void)both->Heartbeat(hb);
      }
      // Timed: heartbeats keep a real etcd's leases alive.
      absl::SleepFor(absl::Milliseconds(100));
    }
  });

  // b routes on the same view, and a finds b's placement.
  v1::RouteRequest rq;
  rq.set_session_id("chat-1");
  absl::StatusOr<v1::RouteResponse> at_b;
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (!(at_b = cb->Route(rq)).ok() && absl::Now() < until)
    // Timed: the other replica learns the placement through etcd.
    absl::SleepFor(absl::Milliseconds(50));
  ASSERT_TRUE(at_b.ok()) << at_b.status();
  EXPECT_EQ(at_b->worker_node_id(), "w1");
  EXPECT_THAT(at_b->store_node_ids(), ::testing::ElementsAre("s1"));
  auto at_a = ca->Route(rq);
  ASSERT_TRUE(at_a.ok()) << at_a.status();
  EXPECT_FALSE(at_a->placed_now());
  EXPECT_EQ(at_a->worker_node_id(), "w1");

  // A policy registered at a is served by b.
  v1::SetPolicyRequest set;
  set.set_model_name("tiny");
  set.mutable_policy()->set_recall("topk:3");
  ASSERT_TRUE(ca->SetPolicy(set).ok());
  v1::GetPolicyRequest q;
  q.set_session_id("chat-1");
  q.mutable_model()->set_name("tiny");
  auto pol = cb->GetPolicy(q);
  ASSERT_TRUE(pol.ok()) << pol.status();
  EXPECT_EQ(pol->policy().recall(), "topk:3");

  // The leader goes: b takes over within its lease, and the session stays.
  a->reset();
  const absl::Time by = absl::Now() + absl::Seconds(15);
  // Timed: the leader's etcd lease must expire.
  while (!(*b)->leader() && absl::Now() < by) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_TRUE((*b)->leader());
  auto after = both->Route(rq);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_FALSE(after->placed_now());
  EXPECT_EQ(after->worker_node_id(), "w1");
  EXPECT_THAT(after->store_node_ids(), ::testing::ElementsAre("s1"));
  stop.store(true);
  beats.join();
}

}  // namespace
}  // namespace kvtier
