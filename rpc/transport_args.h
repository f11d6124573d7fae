// gRPC transport settings for bulk K/V transfer, shared by servers and
// clients: large HTTP/2 frames and a large initial stream window, so
// megabyte payloads move with few frames and flow-control stalls.
//
// Larger TCP read chunks (grpc.experimental.tcp_*read_chunk_size) were tried
// and left out: they made no measurable difference here, and with TLS they
// make gRPC 1.51 leak a slice buffer per connection (LeakSanitizer).
#ifndef KVTIER_RPC_TRANSPORT_ARGS_H_
#define KVTIER_RPC_TRANSPORT_ARGS_H_

#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"

namespace kvtier {

void ApplyBulkTransportArgs(grpc::ChannelArguments* args);
void ApplyBulkTransportArgs(grpc::ServerBuilder* builder);

}  // namespace kvtier

#endif  // KVTIER_RPC_TRANSPORT_ARGS_H_
