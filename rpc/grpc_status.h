// absl::Status <-> grpc::Status. The codes are the same numbers, so the
// conversion is 1:1 and keeps the message.
#ifndef KVTIER_RPC_GRPC_STATUS_H_
#define KVTIER_RPC_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace kvtier {

grpc::Status ToGrpc(const absl::Status& s);
absl::Status FromGrpc(const grpc::Status& s);

}  // namespace kvtier

#endif  // KVTIER_RPC_GRPC_STATUS_H_
