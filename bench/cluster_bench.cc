// kvtier-cluster-bench: what placement costs and how much it moves, each
// figure against a baseline from the same run.
//  - Movement: sessions placed on N nodes by weighted rendezvous hashing;
//    one node joins (N -> N+1) or leaves (N -> N-1); the fraction of
//    sessions whose first choice changes, against the ideal 1/(N+1) (join)
//    or 1/N (leave), and the spread of sessions over nodes (max/mean).
//  - Route latency: kvtier-controller in this process on 127.0.0.1, Route
//    for new and for placed sessions, p50 and p99, against a gRPC no-op on
//    the same server (the health check).
//
//   kvtier-cluster-bench [--sessions=N] [--routes=N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "controller/placement.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "services/controller/controller_server.h"

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

int RouteLatency(int routes) {
  ControllerServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_listen = "";
  o.controller.replicas = 2;
  o.controller.membership.warmup = absl::ZeroDuration();
  o.controller.membership.heartbeat_interval = absl::Seconds(60);  // No sweeps mid-run.
  auto server = ControllerServer::Start(o);
  if (!server.ok()) {
    std::fprintf(stderr, "controller: %s\n", server.status().ToString().c_str());
    return 1;
  }
  controller::Membership& m = (*server)->controller()->membership();
  for (int i = 0; i < 8; ++i) {
    (void)m.Register({absl::StrCat("store-", i), controller::NodeKind::kStore,
                      absl::StrCat("10.0.0.", i + 1, ":7070")});
    (void)m.Register({absl::StrCat("worker-", i), controller::NodeKind::kWorker,
                      absl::StrCat("10.0.1.", i + 1, ":7071")});
  }
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::Controller::NewStub(channel);
  grpc::GenericStub generic(channel);
  grpc::Slice empty_slice(std::string{});
  auto time_ms = [](auto&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  std::vector<double> noop, fresh, placed;
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
  }
  std::printf("\n== Route latency, %d calls each, 8 workers + 8 stores, R=2, loopback\n", routes);
  std::printf("%-28s %10s %10s %12s\n", "call", "p50 ms", "p99 ms", "p50 / no-op");
  const double base = Percentile(noop, 0.5);
  for (const auto& [name, v] : std::vector<std::pair<const char*, std::vector<double>*>>{
           {"gRPC no-op (health check)", &noop},
           {"Route, new session", &fresh},
           {"Route, placed session", &placed}}) {
    std::printf("%-28s %10.3f %10.3f %12.2f\n", name, Percentile(*v, 0.5), Percentile(*v, 0.99),
                Percentile(*v, 0.5) / base);
  }
  return 0;
}

}  // namespace
}  // namespace kvtier

int main(int argc, char** argv) {
  int sessions = 100000, routes = 5000;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--sessions=", 0) == 0 && absl::SimpleAtoi(a.substr(11), &sessions) &&
        sessions > 0) {
      continue;
    }
    if (a.rfind("--routes=", 0) == 0 && absl::SimpleAtoi(a.substr(9), &routes) && routes > 0) {
      continue;
    }
    std::fprintf(stderr, "usage: kvtier-cluster-bench [--sessions=N] [--routes=N]\n");
    return 2;
  }
  kvtier::Movement(sessions);
  return kvtier::RouteLatency(routes);
}
