#include "controller/controller.h"

#include <map>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "controller/placement.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/status_matchers.h"

namespace kvtier::controller {
namespace {

using ::kvtier::testing::IsOk;
using ::kvtier::testing::StatusIs;
using Code = absl::StatusCode;
using ::testing::HasSubstr;

std::vector<Candidate> Nodes(const std::vector<std::string>& ids) {
  std::vector<Candidate> c;
  for (const std::string& id : ids) c.push_back({id, 1.0});
  return c;
}

std::string First(const std::string& key, const std::vector<Candidate>& nodes) {
  return std::string(nodes[Rank(key, nodes)[0]].id);
}

TEST(PlacementTest, DeterministicAndWeighted) {
  const std::vector<std::string> ids = {"s1", "s2", "s3"};
  std::vector<Candidate> c = Nodes(ids);
  EXPECT_EQ(Rank("acme/chat-7", c), Rank("acme/chat-7", c));
  EXPECT_EQ(RendezvousHash("a", "b"), RendezvousHash("a", "b"));
  EXPECT_NE(RendezvousHash("ab", "c"), RendezvousHash("a", "bc"));
  c[0].weight = 2.0;  // s1 should win about twice as often as s2 or s3.
  std::map<std::string, int> wins;
  constexpr int kKeys = 20000;
  for (int i = 0; i < kKeys; ++i) ++wins[First(absl::StrCat("t/s", i), c)];
  EXPECT_NEAR(static_cast<double>(wins["s1"]) / kKeys, 0.5, 0.03);
  EXPECT_NEAR(static_cast<double>(wins["s2"]) / kKeys, 0.25, 0.03);
}

// One node of N joining or leaving moves about 1/N of the keys, and only
// to (or from) that node.
TEST(PlacementTest, OneNodeMovesAboutOneNth) {
  // Candidates view their ids: each list keeps its own.
  const std::vector<std::string> ids4 = {"n1", "n2", "n3", "n4"};
  const std::vector<std::string> ids5 = {"n1", "n2", "n3", "n4", "n5"};
  const std::vector<Candidate> four = Nodes(ids4);
  const std::vector<Candidate> five = Nodes(ids5);
  constexpr int kKeys = 20000;
  int moved = 0;
  for (int i = 0; i < kKeys; ++i) {
    const std::string key = absl::StrCat("tenant/session-", i);
    const std::string before = First(key, four), after = First(key, five);
    if (before != after) {
      ++moved;
      EXPECT_EQ(after, "n5");
    }
  }
  EXPECT_NEAR(static_cast<double>(moved) / kKeys, 1.0 / 5, 0.02);
  // Leaving: only n5's keys move, each to its second choice.
  for (int i = 0; i < 2000; ++i) {
    const std::string key = absl::StrCat("tenant/session-", i);
    if (First(key, five) != "n5") {
      EXPECT_EQ(First(key, five), First(key, four));
    }
  }
}

class MembershipTest : public ::testing::Test {
 protected:
  MembershipOptions Options() {
    MembershipOptions o;
    o.clock = &clock_;
    o.heartbeat_interval = absl::Seconds(1);
    o.missed_heartbeats = 3;
    o.warmup = absl::Seconds(30);
    return o;
  }
  FakeClock clock_;
};

TEST_F(MembershipTest, LeasesEpochsAndWarmUp) {
  Membership m(Options());
  const uint64_t e0 = m.epoch();
  ASSERT_THAT(m.Register({"w1", NodeKind::kWorker, "10.0.0.1:7071", 1000}), IsOk());
  ASSERT_THAT(m.Register({"s1", NodeKind::kStore, "10.0.0.2:7070", 0}), IsOk());
  EXPECT_EQ(m.epoch(), e0 + 2);
  // Bad input and conflicts.
  EXPECT_THAT(m.Register({"bad/id", NodeKind::kWorker, "h:1"}), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(m.Register({"w2", NodeKind::kWorker, "nohost"}), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(m.Register({"w2", NodeKind::kWorker, "10.0.0.1:7071"}),
              StatusIs(Code::kAlreadyExists));
  EXPECT_THAT(m.Register({"w1", NodeKind::kWorker, "10.0.0.9:7071"}),
              StatusIs(Code::kAlreadyExists));
  EXPECT_THAT(m.Heartbeat("nobody", 0, 0), StatusIs(Code::kNotFound));
  // Warm-up: 10% at first, all after 30 s.
  EXPECT_NEAR(m.Weight(m.Live(NodeKind::kWorker)[0]), 0.1, 1e-9);
  for (int i = 0; i < 30; ++i) {
    clock_.AdvanceMs(1000);
    ASSERT_THAT(m.Heartbeat("w1", 250, 3), IsOk());
    ASSERT_THAT(m.Heartbeat("s1", 0, 0), IsOk());
  }
  // Full weight times the free fraction (750 of 1000).
  EXPECT_NEAR(m.Weight(m.Live(NodeKind::kWorker)[0]), 0.75, 1e-9);
  EXPECT_TRUE(m.Sweep().empty());
  // w1 stops; s1 goes on. 3 s without a heartbeat is still within the lease.
  for (int i = 0; i < 3; ++i) {
    clock_.AdvanceMs(1000);
    ASSERT_THAT(m.Heartbeat("s1", 0, 0), IsOk());
  }
  EXPECT_TRUE(m.Sweep().empty());
  clock_.AdvanceMs(1);
  const uint64_t e1 = m.epoch();
  EXPECT_THAT(m.Sweep(), ::testing::ElementsAre("w1"));
  EXPECT_EQ(m.epoch(), e1 + 1);
  EXPECT_TRUE(m.Live(NodeKind::kWorker).empty());
  EXPECT_THAT(m.Heartbeat("w1", 0, 0), StatusIs(Code::kNotFound));
  // It comes back (a restart): live again, warming up from the floor.
  ASSERT_THAT(m.Register({"w1", NodeKind::kWorker, "10.0.0.1:7071", 1000}), IsOk());
  EXPECT_EQ(m.epoch(), e1 + 2);
  EXPECT_NEAR(m.Weight(m.Live(NodeKind::kWorker)[0]), 0.1, 1e-9);
}

class ControllerTest : public ::testing::Test {
 protected:
  ControllerOptions Options(int replicas) {
    ControllerOptions o;
    o.membership.clock = &clock_;
    o.membership.warmup = absl::Seconds(30);
    o.replicas = replicas;
    return o;
  }
  void Beat(Controller& c) {
    for (const NodeInfo& n : c.membership().All()) {
      if (n.live) {
        ASSERT_THAT(c.membership().Heartbeat(n.spec.id, n.used_bytes, 0), IsOk());
      }
    }
  }
  void Pass(Controller& c, int seconds) {
    for (int i = 0; i < seconds; ++i) {
      clock_.AdvanceMs(1000);
      Beat(c);
      c.Tick();
    }
  }
  FakeClock clock_;
};

TEST_F(ControllerTest, SessionsStayPutAndNewNodesWarmUp) {
  Controller c(Options(2));
  EXPECT_THAT(c.Route("acme", "s"), StatusIs(Code::kUnavailable));
  for (int i = 1; i <= 3; ++i) {
    ASSERT_THAT(c.membership().Register({absl::StrCat("store", i), NodeKind::kStore,
                                         absl::StrCat("10.0.1.", i, ":7070")}),
                IsOk());
  }
  EXPECT_THAT(c.Route("acme", "s"), StatusIs(Code::kUnavailable));  // No worker yet.
  for (int i = 1; i <= 2; ++i) {
    ASSERT_THAT(c.membership().Register({absl::StrCat("worker", i), NodeKind::kWorker,
                                         absl::StrCat("10.0.2.", i, ":7071")}),
                IsOk());
  }
  Pass(c, 31);  // Everyone warm.
  std::map<std::string, Placement> first;
  for (int i = 0; i < 300; ++i) {
    const std::string s = absl::StrCat("chat-", i);
    KVT_ASSERT_OK_AND_ASSIGN(Placement p, c.Route("acme", s));
    ASSERT_EQ(p.stores.size(), 2u);
    EXPECT_NE(p.stores[0].spec.id, p.stores[1].spec.id);
    EXPECT_TRUE(p.placed_now);
    first[s] = p;
  }
  EXPECT_THAT(c.Route("acme", "bad/name"), StatusIs(Code::kInvalidArgument));
  // A third worker joins: no placed session moves, and while it warms up it
  // takes far fewer new sessions than its 1/3.
  ASSERT_THAT(c.membership().Register({"worker3", NodeKind::kWorker, "10.0.2.3:7071"}), IsOk());
  int on_new = 0;
  for (int i = 0; i < 300; ++i) {
    KVT_ASSERT_OK_AND_ASSIGN(Placement p, c.Route("acme", absl::StrCat("chat-", i)));
    EXPECT_EQ(p.worker.spec.id, first[absl::StrCat("chat-", i)].worker.spec.id);
    EXPECT_FALSE(p.placed_now);
    KVT_ASSERT_OK_AND_ASSIGN(Placement q, c.Route("acme", absl::StrCat("new-", i)));
    on_new += q.worker.spec.id == "worker3" ? 1 : 0;
  }
  EXPECT_LT(on_new, 300 / 3 / 2);  // Weight 0.1 against 1 + 1: about 5%.
  Pass(c, 31);
  int warm_new = 0;
  for (int i = 0; i < 600; ++i) {
    KVT_ASSERT_OK_AND_ASSIGN(Placement q, c.Route("acme", absl::StrCat("later-", i)));
    warm_new += q.worker.spec.id == "worker3" ? 1 : 0;
  }
  EXPECT_NEAR(warm_new / 600.0, 1.0 / 3, 0.07);

  // store2 dies: sessions that had it keep their other replica and get a
  // new one; the others are untouched.
  clock_.AdvanceMs(500);
  for (const char* id : {"store1", "store3", "worker1", "worker2", "worker3"}) {
    ASSERT_THAT(c.membership().Heartbeat(id, 0, 0), IsOk());
  }
  clock_.AdvanceMs(3000);
  for (const char* id : {"store1", "store3", "worker1", "worker2", "worker3"}) {
    ASSERT_THAT(c.membership().Heartbeat(id, 0, 0), IsOk());
  }
  const size_t on_store2 = c.PlacementsOn("store2");
  EXPECT_GT(on_store2, 0u);
  EXPECT_EQ(c.RepairsPending(), 0u);
  EXPECT_THAT(c.Tick(), ::testing::ElementsAre("store2"));
  // The sweep replaced store2 in every record at once, and queued one repair
  // per session that had it: from the survivor to the replacement.
  EXPECT_EQ(c.PlacementsOn("store2"), 0u);
  EXPECT_EQ(c.RepairsPending(), on_store2);
  EXPECT_EQ(c.UnderReplicated(), 0u);
  for (int i = 0; i < 300; ++i) {
    const std::string s = absl::StrCat("chat-", i);
    KVT_ASSERT_OK_AND_ASSIGN(Placement p, c.Route("acme", s));
    ASSERT_EQ(p.stores.size(), 2u);
    std::set<std::string> now = {p.stores[0].spec.id, p.stores[1].spec.id};
    EXPECT_EQ(now, (std::set<std::string>{"store1", "store3"}));
    const auto& was = first[s].stores;
    const bool had = was[0].spec.id == "store2" || was[1].spec.id == "store2";
    EXPECT_FALSE(p.placed_now);  // Already replaced by the sweep.
    if (!had) {
      EXPECT_EQ(p.stores[0].spec.id, was[0].spec.id);
    } else {
      // The survivor keeps its place first.
      EXPECT_EQ(p.stores[0].spec.id, was[0].spec.id == "store2" ? was[1].spec.id : was[0].spec.id);
    }
  }
  size_t tasks = 0;
  std::optional<RepairTask> first_task;
  while (std::optional<RepairTask> t = c.NextRepair()) {
    ++tasks;
    ASSERT_EQ(t->sources.size(), 1u);
    EXPECT_NE(t->sources[0].spec.id, "store2");
    EXPECT_NE(t->target.spec.id, "store2");
    EXPECT_NE(t->target.spec.id, t->sources[0].spec.id);
    if (!first_task) {
      first_task = *t;
    } else {
      c.RepairFinished(*t, /*ok=*/true);
    }
  }
  EXPECT_EQ(tasks, on_store2);
  EXPECT_EQ(c.RepairsPending(), 1u);  // first_task is still running.
  // A failed repair is queued again, up to max_attempts.
  c.RepairFinished(*first_task, /*ok=*/false, /*max_attempts=*/2);
  std::optional<RepairTask> again = c.NextRepair();
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->session, first_task->session);
  EXPECT_EQ(again->attempt, 1);
  c.RepairFinished(*again, /*ok=*/false, /*max_attempts=*/2);
  EXPECT_FALSE(c.NextRepair().has_value());
  EXPECT_EQ(c.RepairsPending(), 0u);
}

TEST_F(ControllerTest, CallerMovesItsSessionOffAnUnreachableWorker) {
  Controller c(Options(1));
  ASSERT_THAT(c.membership().Register({"s", NodeKind::kStore, "h:1"}), IsOk());
  ASSERT_THAT(c.membership().Register({"w1", NodeKind::kWorker, "h:2"}), IsOk());
  ASSERT_THAT(c.membership().Register({"w2", NodeKind::kWorker, "h:3"}), IsOk());
  KVT_ASSERT_OK_AND_ASSIGN(Placement p, c.Route("t", "chat"));
  const std::string other = p.worker.spec.id == "w1" ? "w2" : "w1";
  // Naming another worker changes nothing.
  KVT_ASSERT_OK_AND_ASSIGN(Placement same, c.Route("t", "chat", 0, other));
  EXPECT_EQ(same.worker.spec.id, p.worker.spec.id);
  EXPECT_FALSE(same.placed_now);
  // Naming its own worker moves it, and it stays moved.
  KVT_ASSERT_OK_AND_ASSIGN(Placement moved, c.Route("t", "chat", 0, p.worker.spec.id));
  EXPECT_EQ(moved.worker.spec.id, other);
  EXPECT_TRUE(moved.placed_now);
  KVT_ASSERT_OK_AND_ASSIGN(Placement after, c.Route("t", "chat"));
  EXPECT_EQ(after.worker.spec.id, other);
  // With no other worker: UNAVAILABLE, and the record stays.
  Controller one(Options(1));
  ASSERT_THAT(one.membership().Register({"s", NodeKind::kStore, "h:1"}), IsOk());
  ASSERT_THAT(one.membership().Register({"w1", NodeKind::kWorker, "h:2"}), IsOk());
  ASSERT_THAT(one.Route("t", "chat"), IsOk());
  EXPECT_THAT(one.Route("t", "chat", 0, "w1"), StatusIs(Code::kUnavailable));
  EXPECT_EQ(one.Placements(), 1u);
}

// Worker roles (prefill/decode disaggregation): sessions are placed on
// prefill-capable workers only; when decode workers are live, Route names one
// per session (stable in the session's rendezvous order, spread over the
// pool); without prefill-capable workers there is no placement.
TEST_F(ControllerTest, RolesSplitPlacementFromDecode) {
  Controller c(Options(1));
  ASSERT_THAT(c.membership().Register({"s", NodeKind::kStore, "h:1"}), IsOk());
  NodeSpec d1{"d1", NodeKind::kWorker, "h:5"}, d2{"d2", NodeKind::kWorker, "h:6"};
  d1.role = d2.role = WorkerRole::kDecode;
  ASSERT_THAT(c.membership().Register(d1), IsOk());
  EXPECT_THAT(c.Route("t", "chat-0"),
              StatusIs(Code::kUnavailable, HasSubstr("no live worker that prefills (1 decode")));
  NodeSpec p1{"p1", NodeKind::kWorker, "h:2"};
  p1.role = WorkerRole::kPrefill;
  ASSERT_THAT(c.membership().Register(p1), IsOk());
  ASSERT_THAT(c.membership().Register({"b1", NodeKind::kWorker, "h:3"}), IsOk());  // Both.
  ASSERT_THAT(c.membership().Register(d2), IsOk());
  std::map<std::string, int> decoders;
  for (int i = 0; i < 64; ++i) {
    const std::string session = absl::StrCat("chat-", i);
    KVT_ASSERT_OK_AND_ASSIGN(Placement p, c.Route("t", session));
    EXPECT_NE(p.worker.spec.role, WorkerRole::kDecode) << session;
    ASSERT_TRUE(p.decode_worker.has_value()) << session;
    EXPECT_EQ(p.decode_worker->spec.role, WorkerRole::kDecode);
    ++decoders[p.decode_worker->spec.id];
    KVT_ASSERT_OK_AND_ASSIGN(Placement again, c.Route("t", session));
    EXPECT_EQ(again.decode_worker->spec.id, p.decode_worker->spec.id);
  }
  EXPECT_EQ(decoders.size(), 2u);
  EXPECT_GT(decoders["d1"], 10);
  EXPECT_GT(decoders["d2"], 10);
  // Without decode workers, the session's worker does both.
  Controller plain(Options(1));
  ASSERT_THAT(plain.membership().Register({"s", NodeKind::kStore, "h:1"}), IsOk());
  ASSERT_THAT(plain.membership().Register({"b1", NodeKind::kWorker, "h:3"}), IsOk());
  KVT_ASSERT_OK_AND_ASSIGN(Placement p, plain.Route("t", "chat"));
  EXPECT_FALSE(p.decode_worker.has_value());
}

// A restarted controller learns live sessions from the workers that hold
// them: the reported stores are matched as they register, a session waits
// (UNAVAILABLE) while one of its stores has not come back within a lease,
// and one that never comes back is replaced and repaired from the other.
TEST_F(ControllerTest, AdoptsWhatWorkersReport) {
  Controller c(Options(2));
  ASSERT_THAT(c.membership().Register({"w1", NodeKind::kWorker, "h:1"}), IsOk());
  ASSERT_THAT(c.membership().Register({"w2", NodeKind::kWorker, "h:2"}), IsOk());
  ASSERT_THAT(c.membership().Register({"s1", NodeKind::kStore, "h:11"}), IsOk());
  c.Adopt("w2", "t", "chat", {"h:12", "h:11"});
  c.Adopt("w1", "t", "chat", {"h:13"});  // A later, other report: the first stays.
  c.Adopt("w2", "t", "gone", {"h:14", "h:11"});
  EXPECT_THAT(c.Route("t", "chat"), StatusIs(Code::kUnavailable));  // s2 not back yet.
  ASSERT_THAT(c.membership().Register({"s2", NodeKind::kStore, "h:12"}), IsOk());
  ASSERT_THAT(c.membership().Register({"s3", NodeKind::kStore, "h:13"}), IsOk());
  KVT_ASSERT_OK_AND_ASSIGN(Placement p, c.Route("t", "chat"));
  EXPECT_EQ(p.worker.spec.id, "w2");
  ASSERT_EQ(p.stores.size(), 2u);
  EXPECT_EQ(p.stores[0].spec.id, "s2");  // The reported order.
  EXPECT_EQ(p.stores[1].spec.id, "s1");
  EXPECT_FALSE(p.placed_now);
  EXPECT_EQ(c.RepairsPending(), 0u);
  // h:14 never registers: after a lease it counts as dead.
  EXPECT_THAT(c.Route("t", "gone"), StatusIs(Code::kUnavailable));
  clock_.AdvanceMs(3001);
  KVT_ASSERT_OK_AND_ASSIGN(Placement g, c.Route("t", "gone"));
  EXPECT_EQ(g.worker.spec.id, "w2");
  ASSERT_EQ(g.stores.size(), 2u);
  EXPECT_EQ(g.stores[0].spec.id, "s1");
  EXPECT_TRUE(g.placed_now);
  std::optional<RepairTask> t = c.NextRepair();
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->session, "gone");
  EXPECT_EQ(t->sources[0].spec.id, "s1");
  EXPECT_EQ(t->target.spec.id, g.stores[1].spec.id);
}

TEST_F(ControllerTest, RoomOnWorkers) {
  Controller c(Options(1));
  ASSERT_THAT(c.membership().Register({"s", NodeKind::kStore, "h:1"}), IsOk());
  ASSERT_THAT(c.membership().Register({"w", NodeKind::kWorker, "h:2", 1000}), IsOk());
  ASSERT_THAT(c.membership().Heartbeat("w", 900, 1), IsOk());
  EXPECT_THAT(c.Route("t", "big", 200), StatusIs(Code::kResourceExhausted));
  EXPECT_EQ(c.Placements(), 0u);
  KVT_ASSERT_OK_AND_ASSIGN(Placement p, c.Route("t", "small", 100));
  EXPECT_EQ(p.worker.spec.id, "w");
  // Idle placements are forgotten.
  clock_.AdvanceMs(int64_t{25} * 3600 * 1000);
  c.Tick();
  EXPECT_EQ(c.Placements(), 0u);
}

}  // namespace
}  // namespace kvtier::controller
