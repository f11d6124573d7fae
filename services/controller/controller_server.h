// kvtier-controller as a server: the Controller service on a port, the
// lease sweeper, the repairer, health, reflection and metrics.
#ifndef KVTIER_SERVICES_CONTROLLER_CONTROLLER_SERVER_H_
#define KVTIER_SERVICES_CONTROLLER_CONTROLLER_SERVER_H_

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "controller/controller.h"
#include "grpcpp/server.h"
#include "services/common/auth.h"
#include "services/common/metrics_exposer.h"
#include "services/controller/controller_service.h"
#include "services/controller/etcd_backend.h"
#include "services/controller/repairer.h"

namespace kvtier {

struct ControllerServerOptions {
  // gRPC listen address; port 0 picks a free port. Default: 127.0.0.1:7072.
  std::string listen = "127.0.0.1:7072";
  // Prometheus /metrics; empty disables it. Default: 127.0.0.1:9472.
  std::string metrics_listen = "127.0.0.1:9472";
  std::string tenants_file;  // services/common/auth.h; empty = auth off.
  // Listen without a tenants file on a non-loopback address. Default: false.
  bool allow_unauthenticated = false;
  std::string tls_cert, tls_key;
  // PEM file of the CA that signs clients' certificates: mutual TLS, and a
  // client's certificate may stand for a token (auth.h). Empty: none.
  std::string tls_client_ca;
  controller::ControllerOptions controller;
  RepairOptions repair;
  // Where registered policies are kept (the file `policies`), created if
  // missing; empty keeps them in memory only (lost at a restart).
  std::string state_dir;
  PolicyServing policy;
  // The etcd back end (docs/cluster.md): etcd's client URLs; empty: the
  // embedded back end (this process only).
  std::vector<std::string> etcd_endpoints;
  std::string etcd_prefix = "/kvtier";
  // This replica's name in the leader election; empty: its listen address
  // with the bound port.
  std::string replica_id;
};

class ControllerServer {
 public:
  // INVALID_ARGUMENT for bad options; UNAVAILABLE when it cannot listen.
  static absl::StatusOr<std::unique_ptr<ControllerServer>> Start(ControllerServerOptions options);
  ~ControllerServer();  // Stops the sweeper, then shuts the server down.

  int port() const { return port_; }
  int metrics_port() const { return metrics_.port; }
  controller::Controller* controller() { return controller_.get(); }
  Repairer* repairer() { return repairer_.get(); }
  // True while this replica runs the background sweep (always when
  // embedded).
  bool leader() const { return coordination_->leader(); }
  // The Prometheus text of its metrics (what /metrics serves).
  std::string RenderMetrics() const;

 private:
  ControllerServer() = default;

  Authenticator auth_;
  std::unique_ptr<controller::Controller> controller_;
  std::unique_ptr<ControllerMetrics> metrics_registry_;
  std::unique_ptr<PolicyBook> policies_;
  std::unique_ptr<Coordination> coordination_;  // Embedded or EtcdBackend.
  std::unique_ptr<ControllerService> service_;
  std::unique_ptr<Repairer> repairer_;
  MetricsEndpoint metrics_;
  // Runs the calls when the back end does I/O (etcd); null: embedded.
  std::unique_ptr<Executor> blocking_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  absl::Notification stop_;
  std::thread sweeper_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_CONTROLLER_CONTROLLER_SERVER_H_
