// gRPC transport settings for bulk K/V transfer, shared by servers and
// clients: large HTTP/2 frames and a large initial stream window, so
// megabyte payloads move with few frames and flow-control stalls.
//
// Larger TCP read chunks (grpc.experimental.tcp_*read_chunk_size) were tried
// and left out: they made no measurable difference here, and with TLS they
// make gRPC 1.51 leak a slice buffer per connection (LeakSanitizer).
#ifndef KVTIER_RPC_TRANSPORT_ARGS_H_
#define KVTIER_RPC_TRANSPORT_ARGS_H_

#include <memory>
#include <string>

#include "grpcpp/security/credentials.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"

namespace kvtier {

void ApplyBulkTransportArgs(grpc::ChannelArguments* args);
void ApplyBulkTransportArgs(grpc::ServerBuilder* builder);

// Client channels between kvtier nodes: a peer that went away is tried again
// every 100 ms to 1 s (gRPC's default backoff grows to 120 s), so a
// restarted store, worker or controller is reached again within about a
// second, not minutes later (the failure of LMCache #651).
void ApplyReconnectArgs(grpc::ChannelArguments* args);

// Credentials of a client channel to a kvtier node: TLS when `root_certs`
// (PEM of the CA) is set, with `server_name` expected in the certificate
// instead of the target's host when set (written into `args`); plaintext
// otherwise.
std::shared_ptr<grpc::ChannelCredentials> ClientChannelCredentials(const std::string& root_certs,
                                                                   const std::string& server_name,
                                                                   grpc::ChannelArguments* args);

}  // namespace kvtier

#endif  // KVTIER_RPC_TRANSPORT_ARGS_H_
