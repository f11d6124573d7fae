// kvtier-worker: the Worker gRPC service (proto/kvtier/v1/worker.proto) over
// worker::Engine, with auth, health checking, reflection and Prometheus
// metrics, as kvtier-store has them. Sessions are per tenant: two tenants
// may use the same session id without seeing each other.
#ifndef KVTIER_SERVICES_WORKER_WORKER_SERVER_H_
#define KVTIER_SERVICES_WORKER_WORKER_SERVER_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "base/executor.h"
#include "client/store_segments.h"
#include "grpcpp/server.h"
#include "rpc/policy_proto.h"
#include "services/common/auth.h"
#include "services/common/cluster_join.h"
#include "services/worker/replicated_segments.h"
#include "services/worker/worker_service.h"
#include "worker/engine.h"

namespace kvtier {

struct WorkerServerOptions {
  // gRPC listen address; port 0 picks a free port. Default: 127.0.0.1:7071.
  std::string listen = "127.0.0.1:7071";
  // Prometheus /metrics address; empty disables it. Default: 127.0.0.1:9471.
  std::string metrics_listen = "127.0.0.1:9471";
  std::string tls_cert, tls_key;  // PEM files; both empty = plaintext.
  // PEM file of the CA that signs clients' certificates: mutual TLS, and a
  // client's certificate may stand for a token (auth.h). Empty: none.
  std::string tls_client_ca;
  std::string tenants_file;  // services/common/auth.h; empty = auth off.
  // Listen without a tenants file on a non-loopback address (auth is on by
  // default outside loopback). Default: false.
  bool allow_unauthenticated = false;
  // kvtier-store to keep rounds in ("host:port"). Required.
  StoreClientOptions store;
  // Other stores a session may name as its replicas
  // (OpenSessionRequest.store_addresses) when the worker runs without a
  // controller (--replica_stores). With a controller, the stores it lists
  // are allowed as well. Any other address is PERMISSION_DENIED and never
  // dialled: the worker sends its store token only to these, --store and
  // the controller's stores. Default: none.
  std::vector<std::string> replica_stores;
  // Workers this one may hand sessions to (LayerRequest.transfer_to,
  // SendSessionRequest.target) besides the worker nodes its controller lists
  // (--peer_workers). Without a controller and without this list, any
  // target: hand-offs carry the caller's own token. Default: none.
  std::vector<std::string> peer_workers;
  worker::EngineOptions engine;
  // Store deadline of RPCs whose caller set none, and the chunking of
  // Prefill outputs (worker_service.h).
  WorkerServiceOptions service;
  // Threads that run attention (Prefill and Decode layers). Default: 0, the
  // number of CPUs.
  int compute_threads = 0;
  // Threads that run the calls reaching the store (OpenSession, EndRound,
  // CloseSession). Default: 8.
  int io_threads = 8;
  // Joining a cluster (--controller); empty controller: standalone.
  ClusterOptions cluster;
  // Skew files (kvtier calibrate infinigen) loaded before the worker serves,
  // as PutSkew would take them (--skew_dir): sessions whose policy names one
  // (a controller's per-model policy, say) speculate without an upload, and
  // a restarted worker has them again. Start fails INVALID_ARGUMENT or
  // DATA_LOSS naming the file that is not a skew file.
  std::vector<std::string> skew_files;
  // How often the worker asks its store (--store) whether it answers: while
  // it does not (UNAVAILABLE or DEADLINE_EXCEEDED within the interval), the
  // worker's gRPC health ("" and "kvtier.v1.Worker") is NOT_SERVING and
  // /readyz answers 503 naming the store. The worker starts not ready until
  // the first answer. Zero: no probe (always ready). Default: 2 s.
  absl::Duration store_probe_interval = absl::Seconds(2);
};

// Thread-safe.
class WorkerServer {
 public:
  // Connects the store client (without waiting for the store), then listens.
  // INVALID_ARGUMENT for bad options; UNAVAILABLE when it cannot listen.
  static absl::StatusOr<std::unique_ptr<WorkerServer>> Start(WorkerServerOptions options);
  ~WorkerServer();

  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  void Shutdown();
  void Wait();
  worker::Engine* engine() { return engine_.get(); }
  ReplicatedSegments* segments() { return segments_.get(); }
  std::string RenderMetrics() const;

 private:
  WorkerServer() = default;
  // Destroyed in reverse order: the server first (no more callbacks), then
  // the executors (their queued tasks run), then the engine and the store.
  Authenticator auth_;
  std::unique_ptr<ReplicatedSegments> segments_;
  std::unique_ptr<KnownNodes> peers_;  // Hand-off targets.
  // The skews (--skew_dir's and uploaded ones) the engine's sessions use.
  std::unique_ptr<worker::SkewRegistry> skews_;
  std::unique_ptr<worker::Engine> engine_;
  std::unique_ptr<WorkerMetrics> metrics_;
  std::unique_ptr<ControllerPolicies> policies_;  // Null outside a cluster.
  std::unique_ptr<Executor> io_, compute_;
  std::unique_ptr<WorkerService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<NodeAgent> agent_;  // Null outside a cluster.
  // The controller's placement epoch as the agent last heard it.
  std::shared_ptr<std::atomic<uint64_t>> agent_epoch_ = std::make_shared<std::atomic<uint64_t>>(0);
  int port_ = 0, metrics_port_ = 0;
  absl::Notification stop_;
  // Readiness: whether the store answers (ProbeStore), read by /readyz.
  struct StoreHealth;
  std::shared_ptr<StoreHealth> store_health_;
  std::unique_ptr<StoreClient> probe_client_;
  std::thread prober_;  // Joined first in the destructor.
  void ProbeStore(absl::Duration interval, const std::string& target);
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_WORKER_WORKER_SERVER_H_
