// kvtier-worker: the Worker gRPC service (proto/kvtier/v1/worker.proto) over
// worker::Engine, with auth, health checking, reflection and Prometheus
// metrics, as kvtier-store has them. Sessions are per tenant: two tenants
// may use the same session id without seeing each other.
#ifndef KVTIER_SERVICES_WORKER_WORKER_SERVER_H_
#define KVTIER_SERVICES_WORKER_WORKER_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/server.h"
#include "kvtier/v1/worker.grpc.pb.h"
#include "services/common/auth.h"
#include "services/worker/store_segments.h"
#include "worker/engine.h"

namespace kvtier {

struct WorkerServerOptions {
  // gRPC listen address; port 0 picks a free port. Default: 127.0.0.1:7071.
  std::string listen = "127.0.0.1:7071";
  // Prometheus /metrics address; empty disables it. Default: 127.0.0.1:9471.
  std::string metrics_listen = "127.0.0.1:9471";
  std::string tls_cert, tls_key;  // PEM files; both empty = plaintext.
  std::string tenants_file;       // services/common/auth.h; empty = auth off.
  // kvtier-store to keep rounds in ("host:port"). Required.
  StoreClientOptions store;
  worker::EngineOptions engine;
};

// Converts the wire policy to the engine's: zero fields take the published
// defaults (ALGORITHMS.md). INVALID_ARGUMENT for an unknown method, codec or
// recall strategy, or a bad parameter. CODEC_RAW (and unset) stores the
// model's own dtype (`model_dtype`; fp32 when unspecified): lossless.
absl::StatusOr<worker::SessionPolicy> PolicyFromProto(const v1::Policy& p,
                                                      v1::DType model_dtype = v1::DTYPE_FP32);
absl::StatusOr<worker::ModelShape> ShapeFromProto(const v1::ModelSpec& m);

class WorkerMetrics;
class WorkerService;

class WorkerServer {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerServer>> Start(WorkerServerOptions options);
  ~WorkerServer();

  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  void Shutdown();
  void Wait();
  worker::Engine* engine() { return engine_.get(); }
  StoreSegments* segments() { return segments_.get(); }
  std::string RenderMetrics() const;

 private:
  WorkerServer() = default;
  Authenticator auth_;
  std::unique_ptr<StoreSegments> segments_;
  std::unique_ptr<worker::Engine> engine_;
  std::unique_ptr<WorkerMetrics> metrics_;
  std::unique_ptr<WorkerService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0, metrics_port_ = 0;
  absl::Notification stop_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_WORKER_WORKER_SERVER_H_
