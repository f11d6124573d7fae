// absl::Status <-> grpc::Status. The codes are the same numbers, so the
// conversion is 1:1 and keeps the message.
#ifndef KVTIER_RPC_GRPC_STATUS_H_
#define KVTIER_RPC_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"

namespace kvtier {

grpc::Status ToGrpc(const absl::Status& s);
absl::Status FromGrpc(const grpc::Status& s);
// The same with `what` (the call, say "PutSkew") in front of the message.
absl::Status FromGrpc(const grpc::Status& s, absl::string_view what);

}  // namespace kvtier

#endif  // KVTIER_RPC_GRPC_STATUS_H_
