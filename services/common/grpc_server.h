// What every kvtier server does to start serving: credentials (TLS when a
// certificate is given), health checking and reflection, one listening port,
// the service, then SERVING.
#ifndef KVTIER_SERVICES_COMMON_GRPC_SERVER_H_
#define KVTIER_SERVICES_COMMON_GRPC_SERVER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"

namespace kvtier {

struct GrpcServerSpec {
  std::string listen;             // host:port; port 0 picks one.
  std::string tls_cert, tls_key;  // PEM files; both empty = plaintext.
  // Server-specific builder settings (message limits, transport tuning).
  std::function<void(grpc::ServerBuilder&)> tune;
  // The service's full name for health checks, e.g. "kvtier.v1.Store".
  std::string health_name;
  // PEM file of the CA that signs clients' certificates: with TLS, every
  // client must present one it signed (mutual TLS). Empty: none asked for.
  std::string tls_client_ca;
};

// Builds and starts the server with `service` registered, sets its health
// (the overall "" and the service's own full name, e.g. "kvtier.v1.Store")
// to SERVING and writes the bound port to *port. UNAVAILABLE when it cannot
// listen; INVALID_ARGUMENT for unreadable TLS files.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(const GrpcServerSpec& spec,
                                                              grpc::Service* service, int* port);

}  // namespace kvtier

#endif  // KVTIER_SERVICES_COMMON_GRPC_SERVER_H_
