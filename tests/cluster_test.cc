// kvtier as a cluster on real hosts: a controller, three stores (R = 2) and
// two workers, each a real process in a network namespace of its own
// (tests/util/netns_cluster.h), and the engine in this process, routing
// through the controller. Nodes are killed with SIGKILL mid-conversation;
// the sessions must finish with what they would have computed without the
// failure, and every acknowledged round must be on two stores again.
// Needs root (CI runs as root); skips otherwise, except under CI=true.
#include <algorithm>
#include <atomic>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/controller_client.h"
#include "client/session_router.h"
#include "client/store_client.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "model/forward.h"
#include "refengine/conversation.h"
#include "refengine/demo.h"
#include "testing/store_process.h"
#include "testing/test_util.h"
#include "tests/util/etcd_process.h"
#include "tests/util/netns_cluster.h"
#include "tests/util/segment_refs.h"

namespace kvtier {
namespace {

constexpr char kNodeToken[] = "node-token-00001";
constexpr char kAcmeToken[] = "acme-token-00001";

class ClusterTest : public ::testing::Test {
 protected:
  // Host 0: the controller; 1-3: stores; 4-5: workers; 6: a spare.
  void SetUp() override {
    auto c = testing::NetnsCluster::Create(7, dir_.path());
    if (!c.ok()) {
      if (testing::InCi()) FAIL() << "CI=true: " << c.status();
      GTEST_SKIP() << "skipped: " << c.status().message();
    }
    cluster_ = std::move(*c);
    if (etcd_mode_) {
      if (testing::EtcdProcess::Binary().empty()) {
        if (testing::InCi()) FAIL() << "CI=true but etcd (Debian's etcd-server) is not installed";
        GTEST_SKIP() << "needs etcd (Debian's etcd-server; scripts/kvtier.sh deps installs it)";
      }
      // etcd on host 0, beside controller replica A.
      etcd_ = std::make_unique<testing::EtcdProcess>(
          dir_.path(), cluster_->Address(0),
          std::vector<std::string>{"ip", "netns", "exec", cluster_->Namespace(0)}, 2379, 2380);
      absl::Status st = etcd_->Start();
      ASSERT_TRUE(st.ok()) << st;
    }
    tenants_ = dir_.path() + "/tenants";
    testing::WriteFile(tenants_,
                       absl::StrCat(kNodeToken, " nodes node\n", kAcmeToken, " acme readwrite\n"));
    ASSERT_TRUE(StartController().ok());
    for (int i = 1; i <= 3; ++i) ASSERT_TRUE(StartStore(i, i).ok());
    for (int i = 1; i <= 2; ++i) {
      auto p = cluster_->Run(
          3 + i, absl::StrCat("worker-", i), WorkerBinary(),
          {"--store=" + StoreAddress(i), absl::StrCat("--store_token=", kNodeToken),
           "--listen=" + cluster_->Address(3 + i) + ":0", "--port_file=PORT_FILE",
           "--metrics_listen=", "--tenants_file=" + tenants_, "--controller=" + controller_,
           absl::StrCat("--controller_token=", kNodeToken), absl::StrCat("--node_id=worker-", i),
           "--store_deadline_ms=3000"});
      ASSERT_TRUE(p.ok()) << p.status();
      workers_.push_back(*p);
    }
    ControllerClientOptions co;
    co.target = controller_;
    co.token = kAcmeToken;
    client_ = std::move(ControllerClient::Connect(co)).value();
    ASSERT_TRUE(WaitLive(5));
    // Past the warm-up, so that both workers take sessions.
    absl::SleepFor(absl::Milliseconds(1200));
  }

  static std::string WorkerBinary() {
    if (const char* env = std::getenv("KVTIER_WORKER_BINARY")) return env;
    return KVTIER_WORKER_BINARY_PATH;
  }
  static std::string ControllerBinary() { return KVTIER_CONTROLLER_BINARY_PATH; }

  absl::Status StartController() {
    if (controller_proc_ != nullptr) return controller_proc_->Start();  // A restart.
    std::vector<std::string> args = {"--listen=" + cluster_->Address(0) + ":0",
                                     "--port_file=PORT_FILE",
                                     "--metrics_listen=",
                                     "--tenants_file=" + tenants_,
                                     "--replicas=2",
                                     "--heartbeat_interval_ms=200",
                                     "--warmup_seconds=1",
                                     absl::StrCat("--store_token=", kNodeToken),
                                     "--repair_mb_per_s=0"};
    if (etcd_mode_) {
      args.push_back("--etcd=" + etcd_->endpoint());
      args.push_back("--replica_id=controller-a");
    }
    auto p = cluster_->Run(0, "controller", ControllerBinary(), args);
    if (!p.ok()) return p.status();
    controller_proc_ = *p;
    controller_ = absl::StrCat(cluster_->Address(0), ":", controller_proc_->port());
    if (etcd_mode_) {
      // Replica B on the spare host; nodes and engines are given both.
      args[0] = "--listen=" + cluster_->Address(6) + ":0";
      args.back() = "--replica_id=controller-b";
      auto b = cluster_->Run(6, "controller-b", ControllerBinary(), args);
      if (!b.ok()) return b.status();
      controller_b_ = *b;
      controller_ += absl::StrCat(",", cluster_->Address(6), ":", controller_b_->port());
    }
    return absl::OkStatus();
  }
  // store-`n` on `host`.
  absl::Status StartStore(int n, int host) {
    auto p = cluster_->Run(
        host, absl::StrCat("store-", n), testing::StoreBinary(),
        {"--data_dir=" + dir_.path() + "/store-" + std::to_string(n),
         "--listen=" + cluster_->Address(host) + ":0", "--port_file=PORT_FILE",
         "--metrics_listen=", "--tenants_file=" + tenants_, "--controller=" + controller_,
         absl::StrCat("--controller_token=", kNodeToken), absl::StrCat("--node_id=store-", n)});
    if (!p.ok()) return p.status();
    stores_.push_back(*p);
    return absl::OkStatus();
  }
  std::vector<testing::HostProcess*> Procs() const {
    std::vector<testing::HostProcess*> all = {controller_proc_};
    all.insert(all.end(), stores_.begin(), stores_.end());
    all.insert(all.end(), workers_.begin(), workers_.end());
    return all;
  }
  std::string WorkerAddress(int i) const {
    return absl::StrCat(cluster_->Address(3 + i), ":", workers_[i - 1]->port());
  }
  std::string StoreAddress(int i) const {
    return absl::StrCat(cluster_->Address(i), ":", stores_[i - 1]->port());
  }

  // The engine's router, as tenant acme.
  std::unique_ptr<SessionRouter> AcmeRouter() {
    ControllerClientOptions co;
    co.target = controller_;
    co.token = kAcmeToken;
    return std::move(SessionRouter::Connect(co)).value();
  }
  // Six short greedy rounds: the failover tests' conversation.
  static refengine::ConversationOptions GreedyConversation() {
    refengine::ConversationOptions conv;
    conv.rounds = 6;
    conv.question_tokens = 10;
    conv.answer_tokens = 11;
    return conv;
  }

  bool WaitLive(int n) {
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (absl::Now() < until) {
      auto nodes = client_->ListNodes();
      if (nodes.ok()) {
        int live = 0;
        for (const auto& x : nodes->nodes()) live += x.live() ? 1 : 0;
        if (live == n) return true;
      }
      // Timed: heartbeats of real processes reach the controller.
      absl::SleepFor(absl::Milliseconds(50));
    }
    return false;
  }

  refengine::DemoOptions Demo(const std::string& prefix) {
    refengine::DemoOptions o;
    o.controller = controller_;
    o.token = kAcmeToken;
    o.sessions = 8;
    o.rounds = 8;
    o.question_tokens = 8;
    o.answer_tokens = 4;
    o.session_prefix = prefix;
    return o;
  }

  // Every round 0..rounds-1 of `session` is on each of its replicas now,
  // byte for byte the same. Waits up to 30 s (repair).
  void ExpectReplicated(const std::string& session, int rounds) {
    v1::RouteRequest rq;
    rq.set_session_id(session);
    // Route needs a live worker. With heartbeats every 200 ms, a worker
    // starved of CPU on a loaded machine can miss three and be declared dead
    // until its next one re-registers it: UNAVAILABLE meanwhile.
    auto route = client_->Route(rq);
    for (const absl::Time until = absl::Now() + absl::Seconds(30);
         absl::IsUnavailable(route.status()) && absl::Now() < until;) {
      // Timed: a real worker process re-registers with its next heartbeat.
      absl::SleepFor(absl::Milliseconds(100));
      route = client_->Route(rq);
    }
    ASSERT_TRUE(route.ok()) << route.status();
    ASSERT_EQ(route->store_addresses_size(), 2) << session;
    const std::vector<v1::SegmentRef> refs = testing::BothSegments(rounds);
    std::vector<std::vector<std::string>> payloads;
    for (const std::string& address : route->store_addresses()) {
      StoreClientOptions so;
      so.target = address;
      so.token = kAcmeToken;
      auto store = std::move(StoreClient::Connect(so)).value();
      const absl::Time until = absl::Now() + absl::Seconds(30);
      absl::StatusOr<v1::ListRoundsResponse> listed;
      while (absl::Now() < until) {
        listed = store->ListRounds(session);
        if (listed.ok() && listed->rounds_size() == rounds) break;
        // Timed: a real worker process writes the rounds to its store replicas.
        absl::SleepFor(absl::Milliseconds(100));
      }
      ASSERT_TRUE(listed.ok()) << session << " on " << address << ": " << listed.status();
      ASSERT_EQ(listed->rounds_size(), rounds) << session << " on " << address;
      auto got = store->GetSegments(session, refs, {}, /*uncounted=*/true);
      ASSERT_TRUE(got.ok()) << session << " on " << address << ": " << got.status();
      payloads.emplace_back();
      for (FetchedSegment& f : *got) payloads.back().push_back(std::move(f.payload));
    }
    EXPECT_TRUE(payloads[0] == payloads[1]) << session << ": the replicas differ";
  }

  testing::TempDir dir_;
  std::unique_ptr<testing::NetnsCluster> cluster_;
  // The etcd back end: etcd and replica A on host 0, replica B on host 6.
  bool etcd_mode_ = false;
  std::unique_ptr<testing::EtcdProcess> etcd_;
  testing::HostProcess* controller_b_ = nullptr;
  std::string tenants_, controller_;
  testing::HostProcess* controller_proc_ = nullptr;
  std::vector<testing::HostProcess*> stores_, workers_;
  std::unique_ptr<ControllerClient> client_;
};

// 8 concurrent sessions; store-1 is killed at round 3, worker-1 at round 6.
// Every session finishes with exactly the attention outputs of a run without
// failures, and every round ends up on two live stores, byte for byte.
TEST_F(ClusterTest, StoreAndWorkerKilledMidConversation) {
  auto base = refengine::RunDemo(Demo("base-"), nullptr);
  ASSERT_TRUE(base.ok()) << base.status();

  std::atomic<bool> store_killed{false}, worker_killed{false};
  refengine::DemoOptions o = Demo("fail-");
  o.delete_at_end = false;
  auto failed = refengine::RunDemo(o, [&](const std::string& line) {
    if (absl::StrContains(line, " (3 of ") && !store_killed.exchange(true)) stores_[0]->Kill();
    if (absl::StrContains(line, " (6 of ") && !worker_killed.exchange(true)) {
      workers_[0]->Kill();
    }
  });
  ASSERT_TRUE(failed.ok()) << failed.status();
  EXPECT_TRUE(store_killed && worker_killed);

  ASSERT_EQ(failed->sessions.size(), base->sessions.size());
  int failovers = 0;
  for (size_t i = 0; i < failed->sessions.size(); ++i) {
    const refengine::DemoSession& f = failed->sessions[i];
    const refengine::DemoSession& b = base->sessions[i];
    // Bit for bit: the same sums of squared differences.
    EXPECT_EQ(f.err2, b.err2) << f.id;
    EXPECT_EQ(f.ref2, b.ref2) << f.id;
    EXPECT_EQ(f.worker, "worker-2") << f.id;
    EXPECT_THAT(f.stores, ::testing::Not(::testing::Contains("store-1"))) << f.id;
    failovers += static_cast<int>(f.failovers.size());
    for (const refengine::Failover& x : f.failovers) {
      EXPECT_EQ(x.from, "worker-1");
      EXPECT_EQ(x.to, "worker-2");
    }
    EXPECT_EQ(f.rounds.size(), 8u) << f.id;
  }
  EXPECT_GE(failovers, 1);  // Sessions of worker-1 moved.
  for (const refengine::DemoSession& f : failed->sessions) ExpectReplicated(f.id, 8);
}

// A store stopped (SIGSTOP) for longer than the worker's store deadline
// (3 s): its calls time out instead of hanging, reads fall back to the other
// replica, writes go to the store that replaces it once it is declared dead,
// and every session finishes with the outputs of an undisturbed run. After
// SIGCONT the store registers again by itself.
TEST_F(ClusterTest, StoppedStoreTimesOutAndRejoins) {
  refengine::DemoOptions o = Demo("calm-");
  o.rounds = 6;
  auto base = refengine::RunDemo(o, nullptr);
  ASSERT_TRUE(base.ok()) << base.status();
  o.session_prefix = "stop-";
  o.delete_at_end = false;
  // Placed now (the demo finds these placements): some must use store-1
  // (each of 8 does with probability 2/3).
  int on_store1 = 0;
  for (int i = 0; i < o.sessions; ++i) {
    v1::RouteRequest rq;
    rq.set_session_id(absl::StrCat("stop-", i));
    auto r = client_->Route(rq);
    ASSERT_TRUE(r.ok()) << r.status();
    for (const std::string& id : r->store_node_ids()) on_store1 += id == "store-1" ? 1 : 0;
  }
  ASSERT_GT(on_store1, 0);
  std::atomic<bool> stopped{false};
  const absl::Time t0 = absl::Now();
  auto run = refengine::RunDemo(o, [&](const std::string& line) {
    if (absl::StrContains(line, " (2 of ") && !stopped.exchange(true)) stores_[0]->Pause();
  });
  const absl::Duration took = absl::Now() - t0;
  // Still stopped: the controller has declared it dead.
  EXPECT_TRUE(WaitLive(4));
  stores_[0]->Resume();
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_TRUE(stopped);
  EXPECT_LT(took, absl::Seconds(60)) << "no hang";
  for (size_t i = 0; i < run->sessions.size(); ++i) {
    EXPECT_EQ(run->sessions[i].err2, base->sessions[i].err2) << run->sessions[i].id;
    EXPECT_THAT(run->sessions[i].stores, ::testing::Not(::testing::Contains("store-1")));
  }
  for (const refengine::DemoSession& f : run->sessions) ExpectReplicated(f.id, 6);
  // Back after SIGCONT: declared dead meanwhile, it registers again.
  EXPECT_TRUE(WaitLive(5));
}

// A store killed and started again on its address (same data directory):
// the workers reach it again by themselves (their channels retry within a
// second), it registers again, and every session finishes with the outputs
// of an undisturbed run, every round on two live replicas.
TEST_F(ClusterTest, RestartedStoreIsReachedAgain) {
  refengine::DemoOptions o = Demo("even-");
  o.rounds = 6;
  auto base = refengine::RunDemo(o, nullptr);
  ASSERT_TRUE(base.ok()) << base.status();
  testing::HostProcess* store = stores_[1];
  store->SetArg("--listen=", "--listen=" + StoreAddress(2));
  o.session_prefix = "bounce-";
  o.delete_at_end = false;
  std::atomic<bool> bounced{false};
  absl::Status restarted;
  auto run = refengine::RunDemo(o, [&](const std::string& line) {
    if (absl::StrContains(line, " (2 of ") && !bounced.exchange(true)) {
      store->Kill();
      restarted = store->Start();
    }
  });
  ASSERT_TRUE(bounced);
  ASSERT_TRUE(restarted.ok()) << restarted;
  ASSERT_TRUE(run.ok()) << run.status();
  for (size_t i = 0; i < run->sessions.size(); ++i) {
    EXPECT_EQ(run->sessions[i].err2, base->sessions[i].err2) << run->sessions[i].id;
  }
  EXPECT_TRUE(WaitLive(5));
  for (const refengine::DemoSession& f : run->sessions) ExpectReplicated(f.id, 6);
}

// The controller killed and started again on its address mid-conversation,
// and a fourth store joining as it comes back: no session fails (engines
// keep their routes; nodes register again), and the restarted controller
// learns where the live sessions are from the workers' reports: its routes
// name the stores that hold them, although rendezvous hashing over the new
// membership would place some elsewhere.
TEST_F(ClusterTest, RestartedControllerLearnsLiveSessionsFromWorkers) {
  refengine::DemoOptions o = Demo("steady-");
  o.rounds = 6;
  auto base = refengine::RunDemo(o, nullptr);
  ASSERT_TRUE(base.ok()) << base.status();
  controller_proc_->SetArg("--listen=", "--listen=" + controller_);
  o.session_prefix = "ctl-";
  o.delete_at_end = false;
  std::atomic<bool> bounced{false};
  absl::Status restarted;
  std::map<std::string, std::vector<std::string>> before;  // Session -> its stores.
  auto run = refengine::RunDemo(o, [&](const std::string& line) {
    if (absl::StrContains(line, " (3 of ") && !bounced.exchange(true)) {
      for (int i = 0; i < o.sessions; ++i) {
        v1::RouteRequest rq;
        rq.set_session_id(absl::StrCat("ctl-", i));
        auto r = client_->Route(rq);
        if (r.ok())
          before[rq.session_id()].assign(r->store_node_ids().begin(), r->store_node_ids().end());
      }
      controller_proc_->Kill();
      restarted = StartController();
      if (restarted.ok()) restarted = StartStore(4, 6);
    }
  });
  ASSERT_TRUE(bounced);
  ASSERT_TRUE(restarted.ok()) << restarted;
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(before.size(), 8u);
  for (size_t i = 0; i < run->sessions.size(); ++i) {
    EXPECT_EQ(run->sessions[i].err2, base->sessions[i].err2) << run->sessions[i].id;
    // Asked after the restart (the report refreshes the route): the same
    // stores as before it.
    EXPECT_EQ(run->sessions[i].stores, before[run->sessions[i].id]) << run->sessions[i].id;
  }
  EXPECT_TRUE(WaitLive(6));
  for (const refengine::DemoSession& f : run->sessions) ExpectReplicated(f.id, 6);
}

// Chaos: KVTIER_CHAOS_CYCLES cycles (default 1; `ctest -L chaos` runs 20),
// each a run of 8 sessions in which one random store and one random worker
// are killed at random rounds and started again on their addresses a round
// later. Every run must give the undisturbed outputs, and every session must
// end with all its rounds on two replicas.
TEST_F(ClusterTest, ChaosRandomKills) {
  int cycles = 1;
  if (const char* env = std::getenv("KVTIER_CHAOS_CYCLES")) cycles = std::max(1, std::atoi(env));
  refengine::DemoOptions o = Demo("quiet-");
  o.rounds = 8;
  auto base = refengine::RunDemo(o, nullptr);
  ASSERT_TRUE(base.ok()) << base.status();
  std::mt19937 rng(static_cast<uint32_t>(absl::ToUnixMicros(absl::Now())));
  for (int i = 0; i < 2; ++i) workers_[i]->SetArg("--listen=", "--listen=" + WorkerAddress(i + 1));
  for (int i = 0; i < 3; ++i) stores_[i]->SetArg("--listen=", "--listen=" + StoreAddress(i + 1));
  int failovers = 0;
  absl::Duration slowest;
  for (int cycle = 0; cycle < cycles; ++cycle) {
    testing::HostProcess* store = stores_[rng() % 3];
    testing::HostProcess* worker = workers_[rng() % 2];
    const int store_at = 1 + static_cast<int>(rng() % 5),
              worker_at = 1 + static_cast<int>(rng() % 5);
    std::mutex mu;
    int kills = 0;
    // Kills at their rounds, restarts on the same address a round later.
    auto on_round = [&](const std::string& line) {
      std::lock_guard<std::mutex> lock(mu);
      // "round R (R+1 of N)": the (R+1)th round of a session begins.
      auto at = [&](int r) { return absl::StrContains(line, absl::StrCat(" (", r, " of ")); };
      if (store->running() && at(store_at)) {
        store->Kill();
        ++kills;
      }
      if (worker->running() && at(worker_at)) {
        worker->Kill();
        ++kills;
      }
      if (!store->running() && at(store_at + 1)) (void)store->Start();
      if (!worker->running() && at(worker_at + 1)) (void)worker->Start();
    };
    o.session_prefix = absl::StrCat("chaos", cycle, "-");
    o.delete_at_end = false;
    const absl::Time t0 = absl::Now();
    auto run = refengine::RunDemo(o, on_round);
    slowest = std::max(slowest, absl::Now() - t0);
    ASSERT_TRUE(run.ok()) << "cycle " << cycle << " (" << store->name() << " at " << store_at
                          << ", " << worker->name() << " at " << worker_at << "): " << run.status();
    // Both kills must have happened (rounds 1-5 of 8 always come): a cycle
    // that killed nothing would pass whatever the cluster does.
    EXPECT_GE(kills, 2) << "cycle " << cycle;
    for (size_t i = 0; i < run->sessions.size(); ++i) {
      EXPECT_EQ(run->sessions[i].err2, base->sessions[i].err2) << run->sessions[i].id;
      failovers += static_cast<int>(run->sessions[i].failovers.size());
    }
    if (!store->running()) {
      ASSERT_TRUE(store->Start().ok());
    }
    if (!worker->running()) {
      ASSERT_TRUE(worker->Start().ok());
    }
    ASSERT_TRUE(WaitLive(5)) << "cycle " << cycle;
    for (const refengine::DemoSession& f : run->sessions) {
      ExpectReplicated(f.id, o.rounds);
      if (HasFailure()) {
        // What the nodes said about that session.
        std::printf("cycle %d: %s at %d, %s at %d\n", cycle, store->name().c_str(), store_at,
                    worker->name().c_str(), worker_at);
        for (testing::HostProcess* p : Procs()) {
          std::ifstream in(p->log_path());
          for (std::string l; std::getline(in, l);) {
            if (absl::StrContains(l, f.id) || absl::StrContains(l, "dead") ||
                absl::StrContains(l, "repair")) {
              std::printf("%s: %s\n", p->name().c_str(), l.c_str());
            }
          }
        }
        return;
      }
    }
  }
  std::printf("chaos: %d cycles, %d failovers, slowest run %.1f s\n", cycles, failovers,
              absl::ToDoubleSeconds(slowest));
}

// With a lossless policy, a conversation whose worker is killed mid-round
// goes on from the store on the other worker and answers with exactly the
// greedy tokens of a run without the failure.
TEST_F(ClusterTest, GreedyTokensSurviveAWorkerKill) {
  KVT_REQUIRE_SHARED_MODEL(path);
  auto m = model::Model::Load(path);
  ASSERT_TRUE(m.ok()) << m.status();
  auto router = AcmeRouter();
  const refengine::ConversationOptions conv = GreedyConversation();
  v1::Policy policy;
  policy.set_release_after_end_round(true);
  auto run = [&](const std::string& id, int kill_at_round,
                 std::vector<refengine::Failover>* fo) -> absl::StatusOr<refengine::Transcript> {
    auto s = refengine::ClusterBackend(refengine::SpecOf((*m)->config()), router.get(), id, policy,
                                       kAcmeToken);
    if (!s.ok()) return s.status();
    refengine::ClusterSession* cs = s->get();
    auto t = refengine::RunConversation(**m, conv, cs, nullptr, [&](const std::string& line) {
      if (kill_at_round >= 0 &&
          absl::StartsWith(line, absl::StrCat("round ", kill_at_round - 1, " ("))) {
        for (testing::HostProcess* w : workers_) {
          if (w->name() == cs->worker_node_id()) w->Kill();
        }
        kill_at_round = -1;
      }
    });
    *fo = cs->failovers();
    (*s)->Close(true).IgnoreError();
    return t;
  };
  std::vector<refengine::Failover> none, moved;
  auto plain = run("greedy-plain", -1, &none);
  ASSERT_TRUE(plain.ok()) << plain.status();
  auto killed = run("greedy-killed", 3, &moved);
  ASSERT_TRUE(killed.ok()) << killed.status();
  EXPECT_TRUE(none.empty());
  ASSERT_EQ(moved.size(), 1u);
  EXPECT_EQ(moved[0].round, 3u);  // Round 3 (0-based) was open when its worker died.
  EXPECT_NE(moved[0].from, moved[0].to);
  EXPECT_EQ(killed->answers, plain->answers);
}

// Forwards to a session and calls `at_decode` once, before the first decode
// step of round `round` (counting rounds that ended).
class DecodeHook : public refengine::ConversationBackend {
 public:
  DecodeHook(refengine::ConversationBackend* inner, int round, std::function<void()> at_decode)
      : inner_(inner), round_(round), at_decode_(std::move(at_decode)) {}
  absl::Status BeginStep(bool prefill, int n, int question_tokens) override {
    if (!prefill && ended_ == round_ && at_decode_) std::exchange(at_decode_, nullptr)();
    return inner_->BeginStep(prefill, n, question_tokens);
  }
  absl::Status EndStep() override { return inner_->EndStep(); }
  absl::Status EndRound() override {
    absl::Status s = inner_->EndRound();
    if (s.ok()) ++ended_;
    return s;
  }
  absl::StatusOr<uint32_t> Recover(uint32_t round, const absl::Status& failure) override {
    absl::StatusOr<uint32_t> next = inner_->Recover(round, failure);
    if (next.ok()) ended_ = static_cast<int>(*next);
    return next;
  }
  absl::Status AttendLayer(int layer, int pos0, int n, const float* q, const float* k,
                           const float* v, float* out) override {
    return inner_->AttendLayer(layer, pos0, n, q, k, v, out);
  }
  bool WantsNextLayerQuery() const override { return inner_->WantsNextLayerQuery(); }
  absl::Status NextLayerQuery(int layer, int pos0, int n, const float* q_next) override {
    return inner_->NextLayerQuery(layer, pos0, n, q_next);
  }

 private:
  refengine::ConversationBackend* const inner_;
  const int round_;
  std::function<void()> at_decode_;
  int ended_ = 0;
};

// Disaggregation through the controller, and the loss of the decode worker
// while a session is on it: a decode-role worker on host 6 takes every
// session's decode steps; it is killed with SIGKILL at the first decode step
// of round 3, when the session was handed to it. The session resumes on its
// own worker from the store, which then decodes too, and a lossless
// conversation answers with exactly the greedy tokens of a run where nothing
// failed.
TEST_F(ClusterTest, DecodeWorkerKilledWhileItHoldsTheSession) {
  KVT_REQUIRE_SHARED_MODEL(path);
  auto m = model::Model::Load(path);
  ASSERT_TRUE(m.ok()) << m.status();
  auto decoder = cluster_->Run(
      6, "decode-1", WorkerBinary(),
      {"--store=" + StoreAddress(1), absl::StrCat("--store_token=", kNodeToken),
       "--listen=" + cluster_->Address(6) + ":0", "--port_file=PORT_FILE",
       "--metrics_listen=", "--tenants_file=" + tenants_, "--controller=" + controller_,
       absl::StrCat("--controller_token=", kNodeToken), "--node_id=decode-1", "--role=decode",
       "--placement=host", "--store_deadline_ms=3000"});
  ASSERT_TRUE(decoder.ok()) << decoder.status();
  ASSERT_TRUE(WaitLive(6));
  auto router = AcmeRouter();
  const refengine::ConversationOptions conv = GreedyConversation();
  v1::Policy policy;
  policy.set_release_after_end_round(true);
  struct Run {
    refengine::Transcript transcript;
    std::vector<refengine::TierRound> rounds;
    std::vector<refengine::Failover> failovers;
  };
  auto run = [&](const std::string& id, int kill_at_round) -> absl::StatusOr<Run> {
    auto s = refengine::ClusterBackend(refengine::SpecOf((*m)->config()), router.get(), id, policy,
                                       kAcmeToken);
    if (!s.ok()) return s.status();
    DecodeHook hook(s->get(), kill_at_round, [&] { (*decoder)->Kill(); });
    auto t = refengine::RunConversation(**m, conv, &hook, nullptr, {});
    if (!t.ok()) return t.status();
    Run r{*std::move(t), (*s)->rounds(), (*s)->failovers()};
    (*s)->Close(true).IgnoreError();
    return r;
  };
  auto plain = run("pd-plain", -1);
  ASSERT_TRUE(plain.ok()) << plain.status();
  for (size_t r = 0; r < plain->rounds.size(); ++r) {
    EXPECT_TRUE(plain->rounds[r].handed_off) << "round " << r;
  }
  auto killed = run("pd-killed", 3);
  ASSERT_TRUE(killed.ok()) << killed.status();
  EXPECT_FALSE((*decoder)->running());
  EXPECT_TRUE(plain->failovers.empty());
  ASSERT_EQ(killed->failovers.size(), 1u);
  EXPECT_EQ(killed->failovers[0].round, 3u);
  EXPECT_EQ(killed->failovers[0].from, "decode-1");
  EXPECT_NE(killed->failovers[0].to, "decode-1");
  EXPECT_EQ(killed->transcript.answers, plain->transcript.answers);
  ASSERT_EQ(killed->rounds.size(), 6u);
  for (size_t r = 0; r < 6; ++r) {
    // Rounds 0-2 went to the decode worker; from round 3 the session's own
    // worker decodes.
    EXPECT_EQ(killed->rounds[r].handed_off, r < 3) << "round " << r;
    EXPECT_EQ(killed->rounds[r].stored_bytes, plain->rounds[r].stored_bytes) << "round " << r;
  }
}

// Prefill/decode disaggregation across hosts: a standalone worker on host 4
// prefills each round and hands it to one on host 5 layer by layer over the
// namespaces' network, which decodes, ends the round and hands the session
// back. A lossless conversation answers with exactly the greedy tokens of the
// host-4 worker doing everything.
TEST_F(ClusterTest, PrefillOnOneHostDecodeOnAnother) {
  KVT_REQUIRE_SHARED_MODEL(path);
  auto m = model::Model::Load(path);
  ASSERT_TRUE(m.ok()) << m.status();
  std::vector<std::string> pd;
  for (int i = 0; i < 2; ++i) {
    auto p =
        cluster_->Run(4 + i, absl::StrCat("pd-worker-", i), WorkerBinary(),
                      {"--store=" + StoreAddress(1), absl::StrCat("--store_token=", kNodeToken),
                       "--listen=" + cluster_->Address(4 + i) + ":0", "--port_file=PORT_FILE",
                       "--metrics_listen=", "--tenants_file=" + tenants_, "--placement=host"});
    ASSERT_TRUE(p.ok()) << p.status();
    pd.push_back(absl::StrCat(cluster_->Address(4 + i), ":", (*p)->port()));
  }
  refengine::ConversationOptions conv;
  conv.rounds = 6;
  conv.question_tokens = 10;
  conv.answer_tokens = 11;
  v1::Policy policy;
  policy.set_release_after_end_round(true);
  refengine::Disaggregation dis;
  dis.decode_channel = grpc::CreateChannel(pd[1], grpc::InsecureChannelCredentials());
  dis.prefill_target = pd[0];
  dis.decode_target = pd[1];
  auto run =
      [&](const std::string& id, bool disaggregated,
          std::vector<refengine::TierRound>* rounds) -> absl::StatusOr<refengine::Transcript> {
    auto s =
        refengine::TierBackend(refengine::SpecOf((*m)->config()),
                               grpc::CreateChannel(pd[0], grpc::InsecureChannelCredentials()), id,
                               policy, kAcmeToken, {}, nullptr, disaggregated ? &dis : nullptr);
    if (!s.ok()) return s.status();
    auto t = refengine::RunConversation(**m, conv, s->get(), nullptr, {});
    *rounds = (*s)->rounds();
    (*s)->Close(true).IgnoreError();
    return t;
  };
  std::vector<refengine::TierRound> one_rounds, pd_rounds;
  auto one = run("pd-one", false, &one_rounds);
  ASSERT_TRUE(one.ok()) << one.status();
  auto split = run("pd-split", true, &pd_rounds);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->answers, one->answers);
  ASSERT_EQ(pd_rounds.size(), one_rounds.size());
  for (size_t r = 0; r < pd_rounds.size(); ++r) {
    EXPECT_TRUE(pd_rounds[r].handed_off) << "round " << r;
    EXPECT_EQ(pd_rounds[r].transfer_path, "grpc");
    EXPECT_GT(pd_rounds[r].transfer_wire_bytes, 0u);
    EXPECT_EQ(pd_rounds[r].stored_bytes, one_rounds[r].stored_bytes) << "round " << r;
  }
}

// The etcd back end: two controller replicas share membership, placements
// and policies through a real etcd on host 0; nodes and the engine know
// both. The leader replica is killed with SIGKILL at round 3, store-1 at
// round 4 (the new leader must replace it in the shared placements and
// repair), and worker-1 at round 5, so that its sessions fail over through
// the surviving replica (which must still see the nodes live: their
// heartbeats moved to it). No session fails, every one gives exactly the
// outputs of an undisturbed run, the other replica takes the lead, and every
// round ends up on two live replicas.
class EtcdClusterTest : public ClusterTest {
 protected:
  EtcdClusterTest() { etcd_mode_ = true; }
};

TEST_F(EtcdClusterTest, LossOfTheLeaderControllerFailsNoSession) {
  refengine::DemoOptions o = Demo("etcd-base-");
  o.rounds = 6;
  auto base = refengine::RunDemo(o, nullptr);
  ASSERT_TRUE(base.ok()) << base.status();
  ASSERT_THAT(controller_proc_->Tail(), ::testing::HasSubstr("elected leader controller"));
  o.session_prefix = "etcd-";
  o.delete_at_end = false;
  std::atomic<bool> killed{false}, store_killed{false}, worker_killed{false};
  auto run = refengine::RunDemo(o, [&](const std::string& line) {
    if (absl::StrContains(line, " (3 of ") && !killed.exchange(true)) controller_proc_->Kill();
    if (absl::StrContains(line, " (4 of ") && !store_killed.exchange(true)) stores_[0]->Kill();
    if (absl::StrContains(line, " (5 of ") && !worker_killed.exchange(true)) {
      workers_[0]->Kill();
    }
  });
  ASSERT_TRUE(killed && store_killed && worker_killed);
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(run->sessions.size(), base->sessions.size());
  int failovers = 0;
  for (size_t i = 0; i < run->sessions.size(); ++i) {
    EXPECT_EQ(run->sessions[i].err2, base->sessions[i].err2) << run->sessions[i].id;
    EXPECT_EQ(run->sessions[i].rounds.size(), 6u) << run->sessions[i].id;
    EXPECT_EQ(run->sessions[i].worker, "worker-2") << run->sessions[i].id;
    EXPECT_THAT(run->sessions[i].stores, ::testing::Not(::testing::Contains("store-1")))
        << run->sessions[i].id;
    failovers += static_cast<int>(run->sessions[i].failovers.size());
  }
  EXPECT_GE(failovers, 1);
  const absl::Time by = absl::Now() + absl::Seconds(20);
  while (!absl::StrContains(controller_b_->Tail(), "elected leader controller") &&
         absl::Now() < by) {
    // Timed: the etcd lease of the killed leader must expire.
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_THAT(controller_b_->Tail(), ::testing::HasSubstr("elected leader controller"));
  for (const refengine::DemoSession& f : run->sessions) ExpectReplicated(f.id, 6);
}

}  // namespace
}  // namespace kvtier
