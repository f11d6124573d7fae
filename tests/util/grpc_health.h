// grpc.health.v1.Health/Check from a test, without the health proto's
// generated stubs (Debian ships none): the request and the answer are small
// enough to write and read by hand.
#ifndef KVTIER_TESTS_UTIL_GRPC_HEALTH_H_
#define KVTIER_TESTS_UTIL_GRPC_HEALTH_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "grpcpp/channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"

namespace kvtier::testing {

// The serving status of `service` ("" for the server overall): 1 SERVING,
// 2 NOT_SERVING; -1 when the call failed (NOT_FOUND for a name the server
// does not know); 0 for an answer that does not parse.
inline int GrpcHealthStatus(const std::shared_ptr<grpc::Channel>& channel,
                            const std::string& service = "") {
  grpc::GenericStub generic(channel);
  grpc::ClientContext ctx;
  std::string req_bytes;  // HealthCheckRequest{service = 1}.
  if (!service.empty()) {
    req_bytes = std::string("\x0a", 1) + static_cast<char>(service.size()) + service;
  }
  grpc::Slice slice(req_bytes);
  grpc::ByteBuffer req(&slice, 1), resp;
  absl::Notification done;
  grpc::Status status;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                    [&](grpc::Status s) {
                      status = s;
                      done.Notify();
                    });
  done.WaitForNotification();
  if (!status.ok()) return -1;
  std::vector<grpc::Slice> slices;
  if (!resp.Dump(&slices).ok()) return 0;
  std::string bytes;  // HealthCheckResponse{status = 1}.
  for (auto& sl : slices) bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  return bytes.size() == 2 && bytes[0] == '\x08' ? bytes[1] : 0;
}

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_UTIL_GRPC_HEALTH_H_
