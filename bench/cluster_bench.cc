// kvtier-cluster-bench: what placement costs and how much it moves, each
// figure against a baseline from the same run.
//  - Movement: sessions placed on N nodes by weighted rendezvous hashing;
//    one node joins (N -> N+1) or leaves (N -> N-1); the fraction of
//    sessions whose first choice changes, against the ideal 1/(N+1) (join)
//    or 1/N (leave), and the spread of sessions over nodes (max/mean).
//  - Route latency: kvtier-controller in this process on 127.0.0.1, Route
//    for new and for placed sessions, p50 and p99, against a gRPC no-op on
//    the same server (the health check).
//  - Replication and repair: three real kvtier-store processes and a
//    kvtier-worker in this process. EndRound of sessions with one replica
//    against the same rounds with two (time and bytes stored); then the
//    repair of one session to the third store (uncapped) against
//    PutSegment of the same segments to that store by one client; and the
//    repair of a session of 200 small rounds against PutSegments of them,
//    a round a call.
//
//   kvtier-cluster-bench [--sessions=N] [--routes=N] [--rounds=N]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "base/status_macros.h"
#include "client/store_client.h"
#include "controller/placement.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "rpc/dense_tensor.h"
#include "services/controller/controller_server.h"
#include "services/controller/repairer.h"
#include "services/worker/worker_server.h"
#include "testing/store_process.h"
#include "testing/test_util.h"

namespace kvtier {
namespace {

std::string FirstOf(const std::string& key, const std::vector<std::string>& ids) {
  std::vector<controller::Candidate> c;
  for (const std::string& id : ids) c.push_back({id, 1.0});
  return ids[controller::Rank(key, c)[0]];
}

void Movement(int sessions) {
  std::printf("== placement movement, %d sessions, equal weights\n", sessions);
  std::printf("%6s %12s %12s %8s %14s\n", "N", "join moved", "ideal", "ratio", "spread max/mean");
  for (int n : {3, 4, 8, 16}) {
    std::vector<std::string> ids;
    for (int i = 0; i < n; ++i) ids.push_back(absl::StrCat("node-", i));
    std::vector<std::string> plus = ids;
    plus.push_back(absl::StrCat("node-", n));
    int moved = 0;
    std::map<std::string, int> load;
    for (int s = 0; s < sessions; ++s) {
      const std::string key = absl::StrCat("tenant/session-", s);
      const std::string a = FirstOf(key, ids);
      ++load[a];
      moved += a != FirstOf(key, plus) ? 1 : 0;
    }
    int mx = 0;
    for (const auto& [id, c] : load) mx = std::max(mx, c);
    const double frac = static_cast<double>(moved) / sessions, ideal = 1.0 / (n + 1);
    std::printf("%6d %11.2f%% %11.2f%% %8.3f %14.3f\n", n, 100 * frac, 100 * ideal, frac / ideal,
                mx / (static_cast<double>(sessions) / n));
  }
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

// A controller in this process with 8 workers and 8 stores, on the embedded
// back end, or on etcd at `etcd` (its placements then live there).
absl::StatusOr<std::unique_ptr<ControllerServer>> BenchController(const std::string& etcd) {
  ControllerServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_listen = "";
  o.controller.replicas = 2;
  o.controller.membership.warmup = absl::ZeroDuration();
  o.controller.membership.heartbeat_interval = absl::Seconds(60);  // No sweeps mid-run.
  if (!etcd.empty()) {
    o.etcd_endpoints = {etcd};
    o.etcd_prefix = absl::StrCat("/kvtier-bench-", ::getpid());
  }
  KVT_ASSIGN_OR_RETURN(std::unique_ptr<ControllerServer> server, ControllerServer::Start(o));
  controller::Membership& m = server->controller()->membership();
  for (int i = 0; i < 8; ++i) {
    (void)m.Register({absl::StrCat("store-", i), controller::NodeKind::kStore,
                      absl::StrCat("10.0.0.", i + 1, ":7070")});
    (void)m.Register({absl::StrCat("worker-", i), controller::NodeKind::kWorker,
                      absl::StrCat("10.0.1.", i + 1, ":7071")});
  }
  return server;
}

int RouteLatency(int routes, const std::string& etcd) {
  auto server = BenchController("");
  if (!server.ok()) {
    std::fprintf(stderr, "controller: %s\n", server.status().ToString().c_str());
    return 1;
  }
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::Controller::NewStub(channel);
  std::unique_ptr<ControllerServer> on_etcd;
  std::unique_ptr<v1::Controller::Stub> etcd_stub;
  if (!etcd.empty()) {
    auto e = BenchController(etcd);
    if (!e.ok()) {
      std::fprintf(stderr, "controller on etcd %s: %s\n", etcd.c_str(),
                   e.status().ToString().c_str());
      return 1;
    }
    on_etcd = std::move(*e);
    etcd_stub = v1::Controller::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", on_etcd->port()), grpc::InsecureChannelCredentials()));
  }
  grpc::GenericStub generic(channel);
  grpc::Slice empty_slice(std::string{});
  auto time_ms = [](auto&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  std::vector<double> noop, fresh, placed, etcd_fresh, etcd_placed;
  for (int i = 0; i < routes; ++i) {
    noop.push_back(time_ms([&] {
      grpc::ClientContext c;
      grpc::ByteBuffer req(&empty_slice, 1), resp;
      absl::Notification done;
      generic.UnaryCall(&c, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                        [&](grpc::Status) { done.Notify(); });
      done.WaitForNotification();
    }));
    v1::RouteRequest req;
    req.set_session_id(absl::StrCat("s-", i));
    fresh.push_back(time_ms([&] {
      grpc::ClientContext c;
      v1::RouteResponse r;
      (void)stub->Route(&c, req, &r);
    }));
    placed.push_back(time_ms([&] {
      grpc::ClientContext c;
      v1::RouteResponse r;
      (void)stub->Route(&c, req, &r);
    }));
    if (etcd_stub != nullptr) {
      for (std::vector<double>* v : {&etcd_fresh, &etcd_placed}) {
        v->push_back(time_ms([&] {
          grpc::ClientContext c;
          v1::RouteResponse r;
          (void)etcd_stub->Route(&c, req, &r);
        }));
      }
    }
  }
  std::printf("\n== Route latency, %d calls each, 8 workers + 8 stores, R=2, loopback\n", routes);
  std::printf("%-28s %10s %10s %12s\n", "call", "p50 ms", "p99 ms", "p50 / no-op");
  const double base = Percentile(noop, 0.5);
  for (const auto& [name, v] : std::vector<std::pair<const char*, std::vector<double>*>>{
           {"gRPC no-op (health check)", &noop},
           {"Route, new session", &fresh},
           {"Route, placed session", &placed},
           {"Route on etcd, new session", &etcd_fresh},
           {"Route on etcd, placed", &etcd_placed}}) {
    if (v->empty()) continue;
    std::printf("%-28s %10.3f %10.3f %12.2f\n", name, Percentile(*v, 0.5), Percentile(*v, 0.99),
                Percentile(*v, 0.5) / base);
  }
  if (etcd.empty()) std::printf("(the etcd back end's rows: --etcd=http://HOST:2379)\n");
  return 0;
}

// A session shaped like a small 8B-class slice: 8 layers, 32 q / 8 kv heads,
// d = 128, fp16; rounds of 256 tokens, L_w = 2 (two segments a round).
constexpr int kLayers = 8, kQHeads = 32, kKvHeads = 8, kDim = 128, kRoundTokens = 256;

v1::OpenSessionRequest BenchSession(const std::string& id, const std::vector<std::string>& stores) {
  v1::OpenSessionRequest r;
  r.set_session_id(id);
  r.mutable_model()->set_num_layers(kLayers);
  r.mutable_model()->set_num_q_heads(kQHeads);
  r.mutable_model()->set_num_kv_heads(kKvHeads);
  r.mutable_model()->set_head_dim(kDim);
  r.mutable_model()->set_dtype(v1::DTYPE_FP16);
  r.mutable_policy()->set_watershed_layer(2);
  r.mutable_policy()->set_recall("topk:1");
  for (const std::string& a : stores) r.add_store_addresses(a);
  return r;
}

// One prefill step of a round's tokens (random q/k/v), in 64-token chunks.
bool Prefill(v1::Worker::Stub* stub, const std::string& id, uint64_t seed) {
  uint64_t x = seed * 0x9e3779b97f4a7c15ULL + 1;
  auto rnd = [&](size_t n) {
    std::vector<float> v(n);
    for (float& f : v) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      f = static_cast<float>(static_cast<int64_t>(x % 2001) - 1000) / 1000.0f;
    }
    return v;
  };
  grpc::ClientContext c;
  auto s = stub->Prefill(&c);
  constexpr int kChunk = 64;
  for (int l = 0; l < kLayers; ++l) {
    const auto q = rnd(size_t{kRoundTokens} * kQHeads * kDim);
    const auto k = rnd(size_t{kRoundTokens} * kKvHeads * kDim);
    const auto v = rnd(size_t{kRoundTokens} * kKvHeads * kDim);
    for (int t = 0; t < kRoundTokens; t += kChunk) {
      v1::LayerRequest req;
      if (l == 0 && t == 0) req.set_session_id(id);
      req.set_layer(l);
      req.set_question_tokens(kRoundTokens);
      WriteDense(q.data(), t, kChunk, kQHeads, kDim, v1::DTYPE_FP16, req.mutable_q());
      WriteDense(k.data(), t, kChunk, kKvHeads, kDim, v1::DTYPE_FP16, req.mutable_k());
      WriteDense(v.data(), t, kChunk, kKvHeads, kDim, v1::DTYPE_FP16, req.mutable_v());
      req.set_more_chunks(t + kChunk < kRoundTokens);
      if (!s->Write(req)) break;
    }
    v1::LayerResponse resp;
    do {
      if (!s->Read(&resp)) break;
    } while (resp.more_chunks());
  }
  s->WritesDone();
  const grpc::Status st = s->Finish();
  if (!st.ok()) std::fprintf(stderr, "Prefill: %s\n", st.error_message().c_str());
  return st.ok();
}

int Replication(int rounds) {
  testing::TempDir dir;
  std::vector<std::unique_ptr<testing::StoreProcess>> stores;
  for (int i = 0; i < 3; ++i) {
    stores.push_back(
        std::make_unique<testing::StoreProcess>(dir.path() + "/s" + std::to_string(i)));
    if (absl::Status st = stores.back()->Start(); !st.ok()) {
      std::fprintf(stderr, "store: %s\n", st.ToString().c_str());
      return 1;
    }
  }
  WorkerServerOptions wo;
  wo.listen = "127.0.0.1:0";
  wo.metrics_listen = "";
  wo.store.target = stores[0]->target();
  auto worker = WorkerServer::Start(wo);
  if (!worker.ok()) {
    std::fprintf(stderr, "worker: %s\n", worker.status().ToString().c_str());
    return 1;
  }
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*worker)->port()),
                                                      grpc::InsecureChannelCredentials()));
  // Alternate the two shapes round by round, so that load drifts hit both.
  struct Run {
    const char* name;
    std::string id;
    std::vector<std::string> stores;
    std::vector<double> ms;
    uint64_t bytes = 0;
  };
  std::vector<Run> runs = {{"R=1", "r1", {stores[0]->target()}, {}, 0},
                           {"R=2", "r2", {stores[0]->target(), stores[1]->target()}, {}, 0}};
  for (Run& r : runs) {
    grpc::ClientContext c;
    v1::OpenSessionResponse resp;
    if (!stub->OpenSession(&c, BenchSession(r.id, r.stores), &resp).ok()) return 1;
  }
  for (int round = 0; round < rounds; ++round) {
    for (Run& r : runs) {
      if (!Prefill(stub.get(), r.id, round)) {
        std::fprintf(stderr, "prefill failed\n");
        return 1;
      }
      grpc::ClientContext c;
      v1::EndRoundRequest req;
      req.set_session_id(r.id);
      v1::EndRoundResponse resp;
      const auto t0 = std::chrono::steady_clock::now();
      const grpc::Status st = stub->EndRound(&c, req, &resp);
      r.ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      if (!st.ok()) {
        std::fprintf(stderr, "EndRound: %s\n", st.error_message().c_str());
        return 1;
      }
      r.bytes += resp.stored_bytes() * r.stores.size();
    }
  }
  std::printf(
      "\n== EndRound with 1 and 2 store replicas, %d rounds of %d tokens each "
      "(%d layers, %d kv heads, d=%d, fp16, L_w=2), same worker and stores\n",
      rounds, kRoundTokens, kLayers, kKvHeads, kDim);
  std::printf("%-6s %10s %10s %16s %10s\n", "", "p50 ms", "p99 ms", "bytes stored", "p50 / R=1");
  const double base = Percentile(runs[0].ms, 0.5);
  for (const Run& r : runs) {
    std::printf("%-6s %10.2f %10.2f %16llu %10.2f\n", r.name, Percentile(r.ms, 0.5),
                Percentile(r.ms, 0.99), static_cast<unsigned long long>(r.bytes),
                Percentile(r.ms, 0.5) / base);
  }

  // Repair of r2 to the third store, against plain PutSegment of the same
  // segments to that store (another session name) by one client.
  controller::Controller ctl;
  RepairOptions ro;
  ro.max_bytes_per_second = 0;
  auto repairer = Repairer::Start(&ctl, ro);
  if (!repairer.ok()) return 1;
  controller::RepairTask task;
  task.tenant = "default";
  task.session = "r2";
  task.sources.push_back({{"s1", controller::NodeKind::kStore, stores[1]->target()}});
  task.target = {{"s2", controller::NodeKind::kStore, stores[2]->target()}};
  auto t0 = std::chrono::steady_clock::now();
  bool empty = false;
  absl::Status rs = (*repairer)->Repair(task, &empty);
  const double repair_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!rs.ok()) {
    std::fprintf(stderr, "repair: %s\n", rs.ToString().c_str());
    return 1;
  }
  const uint64_t repaired = (*repairer)->stats().bytes_copied;
  StoreClientOptions so;
  so.target = stores[1]->target();
  auto src = std::move(StoreClient::Connect(so)).value();
  so.target = stores[2]->target();
  auto dst = std::move(StoreClient::Connect(so)).value();
  auto listed = src->ListRounds("r2");
  if (!listed.ok()) return 1;
  std::vector<std::pair<v1::SegmentInfo, std::string>> segs;
  for (const v1::RoundInfo& ri : listed->rounds()) {
    std::vector<v1::SegmentRef> refs;
    for (const v1::SegmentInfo& si : ri.segments()) refs.push_back(si.ref());
    auto got = src->GetSegments("r2", refs, {}, /*uncounted=*/true);
    if (!got.ok()) return 1;
    for (FetchedSegment& f : *got) segs.emplace_back(f.info, std::move(f.payload));
  }
  uint64_t put_bytes = 0;
  t0 = std::chrono::steady_clock::now();
  for (const auto& [info, payload] : segs) {
    PutSegmentArgs a;
    a.session_id = "put-baseline";
    a.round = info.ref().round();
    a.segment = info.ref().segment();
    a.layer_begin = info.layer_begin();
    a.layer_end = info.layer_end();
    if (!dst->PutSegment(a, payload).ok()) return 1;
    put_bytes += payload.size();
  }
  const double put_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf(
      "\n== Repair of one session (%zu segments) to a new replica, uncapped, against "
      "PutSegment of the same segments to the same store\n",
      segs.size());
  std::printf("%-34s %12s %10s %10s\n", "", "bytes", "MB/s", "ratio");
  const double put_mbs = put_bytes / put_s / 1e6, repair_mbs = repaired / repair_s / 1e6;
  std::printf("%-34s %12llu %10.1f %10.2f\n", "PutSegment, one client (baseline)",
              static_cast<unsigned long long>(put_bytes), put_mbs, 1.0);
  std::printf("%-34s %12llu %10.1f %10.2f\n", "repair (read survivor + write)",
              static_cast<unsigned long long>(repaired), repair_mbs, repair_mbs / put_mbs);

  // Small rounds, where a call's fixed cost (and with fsync the target's WAL
  // sync) is most of a round's copy: 200 rounds of two 16 KiB segments put
  // on the second store, repaired to the third, against one PutSegments call
  // a round of the same segments to the third store (another session).
  constexpr int kSmallRounds = 200;
  constexpr uint64_t kSmallBytes = 16 << 10;
  std::deque<std::string> small_payloads;  // The items' views point here.
  auto small_round = [&](const std::string& session, int r) {
    std::vector<PutSegmentsItem> items(2);
    for (uint32_t s = 0; s < 2; ++s) {
      PutSegmentArgs& a = items[s].args;
      a.session_id = session;
      a.round = static_cast<uint32_t>(r);
      a.segment = s;
      a.layer_begin = 0;
      a.layer_end = 1;
      items[s].payload =
          small_payloads.emplace_back(testing::MakePayload(kSmallBytes, 100 * r + s));
    }
    return items;
  };
  // Every segment stored, or the bench stops saying why.
  auto put_all = [](StoreClient* c, const std::vector<PutSegmentsItem>& items) {
    auto put = c->PutSegments(items);
    absl::Status st = put.status();
    for (size_t i = 0; st.ok() && i < put->size(); ++i) st = (*put)[i].status();
    if (!st.ok()) std::fprintf(stderr, "PutSegments: %s\n", st.ToString().c_str());
    return st.ok();
  };
  for (int r = 0; r < kSmallRounds; ++r) {
    if (!put_all(src.get(), small_round("small", r))) return 1;
  }
  std::vector<std::vector<PutSegmentsItem>> baseline_rounds;
  for (int r = 0; r < kSmallRounds; ++r) baseline_rounds.push_back(small_round("small-put", r));
  t0 = std::chrono::steady_clock::now();
  for (const auto& items : baseline_rounds) {
    if (!put_all(dst.get(), items)) return 1;
  }
  const double small_put_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  task.session = "small";
  const uint64_t copied_before = (*repairer)->stats().bytes_copied;
  t0 = std::chrono::steady_clock::now();
  rs = (*repairer)->Repair(task, &empty);
  const double small_repair_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!rs.ok()) {
    std::fprintf(stderr, "repair: %s\n", rs.ToString().c_str());
    return 1;
  }
  const uint64_t small_bytes = (*repairer)->stats().bytes_copied - copied_before;
  std::printf(
      "\n== Repair of a session of %d small rounds (2 x %llu KiB) to a new replica, against one "
      "PutSegments call a round of the same segments to the same store\n",
      kSmallRounds, static_cast<unsigned long long>(kSmallBytes >> 10));
  std::printf("%-34s %12s %10s %10s\n", "", "bytes", "ms", "speed");
  std::printf("%-34s %12llu %10.1f %10.2f\n", "PutSegments a round (baseline)",
              static_cast<unsigned long long>(small_bytes), small_put_s * 1e3, 1.0);
  std::printf("%-34s %12llu %10.1f %10.2f\n", "repair (read survivor + write)",
              static_cast<unsigned long long>(small_bytes), small_repair_s * 1e3,
              small_put_s / small_repair_s);
  return 0;
}

}  // namespace
}  // namespace kvtier

int main(int argc, char** argv) {
  int sessions = 100000, routes = 5000, rounds = 8;
  std::string etcd;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--sessions=", 0) == 0 && absl::SimpleAtoi(a.substr(11), &sessions) &&
        sessions > 0) {
      continue;
    }
    if (a.rfind("--routes=", 0) == 0 && absl::SimpleAtoi(a.substr(9), &routes) && routes > 0) {
      continue;
    }
    if (a.rfind("--rounds=", 0) == 0 && absl::SimpleAtoi(a.substr(9), &rounds) && rounds > 0) {
      continue;
    }
    if (a.rfind("--etcd=", 0) == 0) {
      etcd = a.substr(7);
      continue;
    }
    const bool help = a == "--help" || a == "-h";  // Asked for: stdout, exit 0.
    std::fprintf(help ? stdout : stderr,
                 "usage: kvtier-cluster-bench [--sessions=N] [--routes=N] [--rounds=N] "
                 "[--etcd=http://HOST:2379]\n");
    return help ? 0 : 2;
  }
  kvtier::Movement(sessions);
  if (int rc = kvtier::RouteLatency(routes, etcd); rc != 0) return rc;
  return kvtier::Replication(rounds);
}
