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

// TLS of a client channel to a kvtier node.
struct ClientTls {
  // PEM of the CA that signed the server's certificate; empty: plaintext.
  std::string root_certs;
  // Expected in the server's certificate instead of the target's host;
  // empty: the host.
  std::string server_name;
  // PEM of the client's own certificate chain and key, for servers that
  // require one (mutual TLS); empty: none presented.
  std::string cert_chain, private_key;
};

// Credentials of a client channel to a kvtier node: TLS when
// tls.root_certs is set (the server name override written into `args`),
// plaintext otherwise.
std::shared_ptr<grpc::ChannelCredentials> ClientChannelCredentials(const ClientTls& tls,
                                                                   grpc::ChannelArguments* args);
// The same without a client certificate.
std::shared_ptr<grpc::ChannelCredentials> ClientChannelCredentials(const std::string& root_certs,
                                                                   const std::string& server_name,
                                                                   grpc::ChannelArguments* args);

}  // namespace kvtier

#endif  // KVTIER_RPC_TRANSPORT_ARGS_H_
