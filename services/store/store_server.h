// Assembles a running kvtier-store: the engine, auth, executor, metrics and
// the gRPC server (with health checking and reflection). Used by main() and
// by in-process tests and benchmarks.
#ifndef KVTIER_SERVICES_STORE_STORE_SERVER_H_
#define KVTIER_SERVICES_STORE_STORE_SERVER_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "cachestore/store.h"
#include "grpcpp/server.h"
#include "services/common/auth.h"
#include "services/common/cluster_join.h"
#include "services/store/store_service.h"

namespace kvtier {

class Executor;
class StoreMetrics;

struct StoreServerOptions {
  // gRPC listen address. Port 0 picks a free port. Default: 127.0.0.1:7070.
  std::string listen = "127.0.0.1:7070";
  // Prometheus /metrics address; empty disables it. Default: 127.0.0.1:9470.
  std::string metrics_listen = "127.0.0.1:9470";
  // PEM files for TLS; both empty = plaintext.
  std::string tls_cert;
  std::string tls_key;
  // PEM file of the CA that signs clients' certificates: mutual TLS, and a
  // client's certificate may stand for a token (auth.h). Empty: none.
  std::string tls_client_ca;
  // Tenants file (services/common/auth.h); empty = authentication off.
  std::string tenants_file;
  // Listen without a tenants file on a non-loopback address (auth is on by
  // default outside loopback). Default: false.
  bool allow_unauthenticated = false;
  // Threads running blocking store work. Default: 8.
  int executor_threads = 8;
  // How often idle sessions are checked against their TTL. Default: 10 s.
  int ttl_sweep_seconds = 10;
  cachestore::StoreOptions store;
  StoreServiceOptions service;
  // Joining a cluster (--controller); empty controller: standalone.
  ClusterOptions cluster;
};

// Thread-safe. Shutdown() (or destruction) stops serving, waits for calls in
// flight, then closes RocksDB.
class StoreServer {
 public:
  static absl::StatusOr<std::unique_ptr<StoreServer>> Start(StoreServerOptions options);
  ~StoreServer();

  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  void Shutdown();
  // Blocks until Shutdown() is called from another thread.
  void Wait();
  cachestore::Store* store() { return store_.get(); }
  StoreService* service() { return service_.get(); }
  cachestore::QuotaManager* quotas() { return quotas_.get(); }
  StoreMetrics* metrics() { return metrics_.get(); }

 private:
  StoreServer() = default;

  StoreServerOptions options_;
  Authenticator auth_;
  std::unique_ptr<cachestore::QuotaManager> quotas_;
  std::unique_ptr<cachestore::Store> store_;
  std::unique_ptr<Executor> executor_;
  std::unique_ptr<StoreMetrics> metrics_;
  std::unique_ptr<StoreService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<NodeAgent> agent_;  // Null outside a cluster.
  int port_ = 0;
  int metrics_port_ = 0;
  absl::Notification stop_;
  std::thread sweeper_;
  // A memory-pressure drop (DropColdRounds) is queued or running.
  std::atomic<bool> cold_drop_running_{false};
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_STORE_STORE_SERVER_H_
