#include "rpc/raw_call.h"

namespace kvtier {

RawCall::RawCall(const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* ctx,
                 const std::string& method)
    : stub_(channel) {
  call_ = stub_.PrepareCall(ctx, method, &cq_);
  call_->StartCall(this);
  started_ = Wait();
}

RawCall::~RawCall() {
  if (!finished_) Finish();
  cq_.Shutdown();
  void* tag;
  bool ok;
  while (cq_.Next(&tag, &ok)) {
  }
}

bool RawCall::Wait() {
  void* tag;
  bool ok = false;
  if (!cq_.Next(&tag, &ok)) return false;
  return ok;
}

bool RawCall::Write(const grpc::ByteBuffer& b) {
  if (!started_) return false;
  call_->Write(b, this);
  return Wait();
}

bool RawCall::WritesDone() {
  if (!started_) return false;
  call_->WritesDone(this);
  return Wait();
}

bool RawCall::Read(grpc::ByteBuffer* b) {
  if (!started_) return false;
  call_->Read(b, this);
  return Wait();
}

grpc::Status RawCall::Finish() {
  finished_ = true;
  grpc::Status status;
  call_->Finish(&status, this);
  Wait();
  return status;
}

}  // namespace kvtier
