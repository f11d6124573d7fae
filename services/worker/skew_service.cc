// WorkerService's PutSkew: a client's InfiniGen skew file, streamed in
// slices, admitted and charged per tenant, parsed once at the end into the
// engine's SkewRegistry (docs/speculation.md).
#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "rpc/grpc_status.h"
#include "rpc/wire_format.h"
#include "services/common/idle_read.h"
#include "services/worker/worker_service.h"

namespace kvtier {

// PutSkew: the slices gathered in order, parsed once at the end. Admitted
// per caller tenant (skew_uploads_per_tenant) and watched for idleness
// (skew_upload_idle) while it waits for its client, as the store watches
// its uploads. Exactly one Finish(), through End() or Fail().
class WorkerService::SkewReactor : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  SkewReactor(WorkerService* svc, grpc::CallbackServerContext* ctx, grpc::ByteBuffer* resp)
      : svc_(svc), ctx_(ctx), resp_(resp) {
    absl::Status s = [&]() -> absl::Status {
      KVT_ASSIGN_OR_RETURN(Principal p, svc_->auth_->Authenticate(*ctx_));
      KVT_RETURN_IF_ERROR(Authenticator::RequireWrite(p));
      // Skew slots are the worker's own: charged to the token's tenant.
      // Without authentication they are the operator's, never dropped.
      caller_ = p.caller;
      tenant_ = svc_->auth_->enabled() ? p.caller : std::string();
      return svc_->AdmitSkewUpload(this, caller_);
    }();
    if (!s.ok()) {
      Finish(svc_->Done("PutSkew", s));
      return;
    }
    admitted_ = true;
    StartSendInitialMetadata();  // Tells the client it was admitted.
    Read();
  }

  // For the idle watchdog (services/common/idle_read.h): since when the
  // stream has waited for its client's next message.
  std::optional<absl::Time> waiting_since() const { return idle_.since(); }
  // Called by the watchdog under skew_mu_ with what waiting_since() said:
  // when it takes the stream, it fails DEADLINE_EXCEEDED on the io executor.
  void CancelIdle(absl::Time since) {
    if (!idle_.Take(since)) return;
    svc_->io_->Schedule([this] {
      Fail(absl::DeadlineExceededError(
          absl::StrCat("PutSkew idle for ", absl::FormatDuration(svc_->options_.skew_upload_idle),
                       " (no message from the client); the worker ended it")));
    });
  }

  void OnReadDone(bool ok) override {
    if (!idle_.ReadDone()) return;  // The watchdog failed the stream.
    if (!ok) {
      svc_->io_->Schedule([this] { End(); });
      return;
    }
    req_.Clear();
    absl::Status s = wire::Parse(msg_, &req_);
    if (s.ok() && req_.data().size() > kChunkLimit) {
      s = absl::InvalidArgumentError(
          absl::StrCat("a PutSkew slice of ", req_.data().size(), " bytes; at most ", kChunkLimit));
    }
    if (s.ok() && bytes_.size() + req_.data().size() > kFileLimit) {
      s = absl::InvalidArgumentError(absl::StrCat("skew file past ", kFileLimit >> 20, " MiB"));
    }
    if (s.ok()) s = svc_->ChargeSkewBytes(caller_, req_.data().size());
    if (!s.ok()) {
      Fail(s);
      return;
    }
    charged_ += req_.data().size();
    bytes_ += req_.data();
    Read();
  }

  void OnDone() override { delete this; }

 private:
  static constexpr size_t kChunkLimit = size_t{1} << 20;
  static constexpr size_t kFileLimit = size_t{256} << 20;

  void Read() {
    idle_.Waiting();
    StartRead(&msg_);
  }

  void End() {
    absl::Status s = [&]() -> absl::Status {
      if (bytes_.empty()) return absl::InvalidArgumentError("PutSkew carried no bytes");
      KVT_ASSIGN_OR_RETURN(std::string id, svc_->engine_->skews().Put(bytes_, tenant_));
      const std::shared_ptr<const spec::SkewModel> m = svc_->engine_->skews().Find(id);
      v1::PutSkewResponse resp;
      resp.set_skew_id(id);
      resp.set_layers(static_cast<uint32_t>(m->layers));
      resp.set_model(m->model);
      *resp_ = wire::Serialize(resp);
      return absl::OkStatus();
    }();
    Fail(s);
  }

  // Finishes the call with `s` (OK included), after giving back its slot.
  void Fail(const absl::Status& s) {
    bytes_.clear();
    bytes_.shrink_to_fit();
    if (admitted_) svc_->EndSkewUpload(this, caller_, charged_);
    Finish(svc_->Done("PutSkew", s));
  }

  WorkerService* const svc_;
  grpc::CallbackServerContext* const ctx_;
  grpc::ByteBuffer* const resp_;
  std::string caller_, tenant_;
  bool admitted_ = false;
  uint64_t charged_ = 0;  // Bytes counted against the caller's share.
  IdleRead idle_;
  grpc::ByteBuffer msg_;
  v1::PutSkewRequest req_;
  std::string bytes_;
};

absl::Status WorkerService::AdmitSkewUpload(SkewReactor* r, const std::string& caller) {
  absl::MutexLock lock(&skew_mu_);
  SkewUploads& mine = skew_uploads_[caller];
  // Without authentication every caller is one tenant: no share to keep.
  if (auth_->enabled() && options_.skew_uploads_per_tenant > 0 &&
      mine.open >= options_.skew_uploads_per_tenant) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tenant '", caller, "' has ", mine.open, " PutSkew stream(s) open, its limit of ",
        options_.skew_uploads_per_tenant, " (--skew_uploads_per_tenant)"));
  }
  ++mine.open;
  skew_reactors_.insert(r);
  return absl::OkStatus();
}

absl::Status WorkerService::ChargeSkewBytes(const std::string& caller, uint64_t bytes) {
  absl::MutexLock lock(&skew_mu_);
  SkewUploads& mine = skew_uploads_[caller];
  if (auth_->enabled() && options_.skew_upload_bytes_per_tenant > 0 &&
      mine.bytes + bytes > options_.skew_upload_bytes_per_tenant) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tenant '", caller, "' has ", mine.bytes, " bytes of PutSkew streams in flight; ", bytes,
        " more would pass its limit of ", options_.skew_upload_bytes_per_tenant,
        " (--skew_upload_mb_per_tenant)"));
  }
  mine.bytes += bytes;
  return absl::OkStatus();
}

void WorkerService::EndSkewUpload(SkewReactor* r, const std::string& caller, uint64_t bytes) {
  absl::MutexLock lock(&skew_mu_);
  SkewUploads& mine = skew_uploads_[caller];
  mine.bytes -= std::min(mine.bytes, bytes);
  if (--mine.open <= 0) skew_uploads_.erase(caller);
  skew_reactors_.erase(r);
}

void WorkerService::WatchIdleSkewUploads() {
  const absl::Duration timeout = options_.skew_upload_idle;
  const absl::Duration tick = std::clamp(timeout / 4, absl::Milliseconds(10), absl::Seconds(1));
  while (!stop_.WaitForNotificationWithTimeout(tick)) {
    const absl::Time now = absl::Now();
    absl::MutexLock lock(&skew_mu_);
    for (SkewReactor* r : skew_reactors_) {
      std::optional<absl::Time> since = r->waiting_since();
      if (since.has_value() && now - *since > timeout) r->CancelIdle(*since);
    }
  }
}

grpc::ServerReadReactor<grpc::ByteBuffer>* WorkerService::PutSkew(grpc::CallbackServerContext* ctx,
                                                                  grpc::ByteBuffer* resp) {
  return new SkewReactor(this, ctx, resp);
}
}  // namespace kvtier
