// Sends raw bytes as the one request message of a unary gRPC method, the way
// a hostile or broken client would: for the tests that garbage gets a
// precise status.
#ifndef KVTIER_TESTS_UTIL_RAW_UNARY_H_
#define KVTIER_TESTS_UTIL_RAW_UNARY_H_

#include <memory>
#include <string>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/generic/generic_stub.h"

namespace kvtier::testing {

// `method`: "/kvtier.v1.Store/ListRounds", say. `token`: a bearer token, or
// empty for none.
inline grpc::Status RawUnary(const std::shared_ptr<grpc::Channel>& ch, const std::string& method,
                             const std::string& bytes, const std::string& token = "") {
  grpc::GenericStub generic(ch);
  grpc::ClientContext c;
  c.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  if (!token.empty()) c.AddMetadata("authorization", "Bearer " + token);
  grpc::Slice slice(bytes);
  grpc::ByteBuffer req(&slice, 1), resp;
  absl::Notification done;
  grpc::Status status;
  generic.UnaryCall(&c, method, grpc::StubOptions(), &req, &resp, [&](grpc::Status s) {
    status = std::move(s);
    done.Notify();
  });
  done.WaitForNotification();
  return status;
}

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_UTIL_RAW_UNARY_H_
