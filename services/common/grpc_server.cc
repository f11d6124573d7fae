#include "services/common/grpc_server.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "services/common/server_credentials.h"

namespace kvtier {

absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(const GrpcServerSpec& spec,
                                                              grpc::Service* service, int* port) {
  KVT_ASSIGN_OR_RETURN(auto creds,
                       MakeServerCredentials(spec.tls_cert, spec.tls_key, spec.tls_client_ca));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(spec.listen, creds, port);
  builder.RegisterService(service);
  if (spec.tune) spec.tune(builder);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", spec.listen));
  }
  server->GetHealthCheckService()->SetServingStatus(true);
  // Probes that name the service (a kubelet's grpc probe with `service:`,
  // a mesh's health check) get its own status, not NOT_FOUND.
  if (!spec.health_name.empty()) {
    server->GetHealthCheckService()->SetServingStatus(spec.health_name, true);
  }
  return server;
}

}  // namespace kvtier
