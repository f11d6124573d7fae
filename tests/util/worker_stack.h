// A kvtier-store child process (RocksDB in a temp dir), alone with the
// worker's SegmentStore over it, or with an in-process kvtier-worker in front
// of it, both on 127.0.0.1 port 0, for the tests of
// the worker service and of the engines that drive it. Header-only: tests
// that include it link kvtier_worker_service.
#ifndef KVTIER_TESTS_UTIL_WORKER_STACK_H_
#define KVTIER_TESTS_UTIL_WORKER_STACK_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "client/store_segments.h"
#include "grpcpp/create_channel.h"
#include "services/worker/worker_server.h"
#include "testing/store_process.h"
#include "testing/test_util.h"

namespace kvtier::testing {

// A kvtier-store child process and the worker's SegmentStore over it, for
// tests that drive worker::Engine directly.
class StoreStack {
 public:
  // `store_flags` go to kvtier-store; `token` is the SegmentStore's bearer
  // token.
  absl::Status Start(std::vector<std::string> store_flags = {}, std::string token = "") {
    dir_ = std::make_unique<TempDir>();
    store_ = std::make_unique<StoreProcess>(dir_->path() + "/db", std::move(store_flags));
    if (absl::Status s = store_->Start(); !s.ok()) return s;
    StoreClientOptions o;
    o.target = store_->target();
    o.token = std::move(token);
    o.deadline = absl::Seconds(10);
    auto client = StoreClient::Connect(o);
    if (!client.ok()) return client.status();
    // The store answers once before the test's first call: on a loaded
    // machine a fresh process can take longer than one connection attempt
    // to finish the HTTP/2 handshake, and the first put would fail
    // UNAVAILABLE. Each Stats call waits for the connection up to its
    // deadline; the process is real, so this waits on it, not on a clock.
    absl::Status ready;
    for (int attempt = 0; attempt < 30; ++attempt) {
      ready = (*client)->Stats(CallOptions::Within(absl::Seconds(1))).status();
      if (ready.ok()) break;
      // Timed: a real kvtier-store process that is starting.
      absl::SleepFor(absl::Milliseconds(100));  // A failed attempt may return at once.
    }
    if (!ready.ok()) return ready;
    segments_ = std::make_unique<StoreSegments>(std::move(*client));
    return absl::OkStatus();
  }

  StoreProcess* store() { return store_.get(); }
  StoreSegments* segments() { return segments_.get(); }

 private:
  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<StoreProcess> store_;
  std::unique_ptr<StoreSegments> segments_;
};

struct WorkerStackOptions {
  // The worker's deadline for store calls whose RPC came without one
  // (WorkerServiceOptions::store_deadline).
  absl::Duration store_deadline = absl::Seconds(10);
  // Extra kvtier-store flags (a tenants file, limits).
  std::vector<std::string> store_flags;
  // The worker's tenants file (empty: auth off) and its store token.
  std::string worker_tenants_file;
  std::string store_token;
  // The worker's metrics/health address ("" = none) and store probe.
  std::string metrics_listen;
  absl::Duration store_probe_interval = absl::Seconds(2);
  // PEM files: the worker serves TLS (channel() then does not reach it).
  std::string worker_tls_cert, worker_tls_key;
};

class WorkerStack {
 public:
  absl::Status Start(absl::Duration store_deadline = absl::Seconds(10)) {
    WorkerStackOptions o;
    o.store_deadline = store_deadline;
    return Start(std::move(o));
  }
  absl::Status Start(WorkerStackOptions options) {
    if (absl::Status s = stack_.Start(options.store_flags, options.store_token); !s.ok()) {
      return s;
    }
    WorkerServerOptions o;
    o.listen = "127.0.0.1:0";
    o.metrics_listen = options.metrics_listen;
    o.store_probe_interval = options.store_probe_interval;
    o.tenants_file = options.worker_tenants_file;
    o.tls_cert = options.worker_tls_cert;
    o.tls_key = options.worker_tls_key;
    o.store.target = stack_.store()->target();
    o.store.token = options.store_token;
    o.store.deadline = absl::Seconds(10);
    o.service.store_deadline = options.store_deadline;
    auto server = WorkerServer::Start(o);
    if (!server.ok()) return server.status();
    server_ = std::move(*server);
    channel_ = grpc::CreateChannel(worker_target(), grpc::InsecureChannelCredentials());
    return absl::OkStatus();
  }

  std::string worker_target() const { return "127.0.0.1:" + std::to_string(server_->port()); }
  StoreProcess* store() { return stack_.store(); }
  WorkerServer* server() { return server_.get(); }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

 private:
  StoreStack stack_;
  std::unique_ptr<WorkerServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_UTIL_WORKER_STACK_H_
