// gRPC transport settings for bulk K/V transfer, shared by servers and
// clients: large HTTP/2 frames, a large initial stream window, and large TCP
// reads, so megabyte payloads move in few syscalls and flow-control stalls.
#ifndef KVTIER_SERVICES_COMMON_TRANSPORT_ARGS_H_
#define KVTIER_SERVICES_COMMON_TRANSPORT_ARGS_H_

#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"

namespace kvtier {

void ApplyBulkTransportArgs(grpc::ChannelArguments* args);
void ApplyBulkTransportArgs(grpc::ServerBuilder* builder);

}  // namespace kvtier

#endif  // KVTIER_SERVICES_COMMON_TRANSPORT_ARGS_H_
