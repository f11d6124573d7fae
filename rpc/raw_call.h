// A blocking wrapper over a generic (ByteBuffer) gRPC call, for the client's
// hand-framed streams. Each operation waits for its own completion.
#ifndef KVTIER_RPC_RAW_CALL_H_
#define KVTIER_RPC_RAW_CALL_H_

#include <memory>
#include <string>

#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"

namespace kvtier {

// Not thread-safe: one thread drives one call.
class RawCall {
 public:
  // Starts `method` (e.g. "/kvtier.v1.Store/PutSegment") on `channel`.
  RawCall(const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* ctx,
          const std::string& method);
  ~RawCall();

  // Each returns false once the call is over (then call Finish()).
  bool Write(const grpc::ByteBuffer& b);
  bool WritesDone();
  bool Read(grpc::ByteBuffer* b);
  // The call's final status. Call exactly once.
  grpc::Status Finish();

 private:
  bool Wait();

  grpc::GenericStub stub_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  bool started_ = false;
  bool finished_ = false;
};

}  // namespace kvtier

#endif  // KVTIER_RPC_RAW_CALL_H_
