#include "client/worker_client.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "grpcpp/client_context.h"
#include "rpc/dense_tensor.h"
#include "rpc/grpc_status.h"

namespace kvtier {

struct DecodeMux::Pending {
  v1::DecodeItem item;
  float* out = nullptr;
  size_t out_floats = 0;
  bool ends_step = false;
  absl::Status status;
  bool done = false;
};

struct DecodeMux::Stream {
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> rw;
  absl::Time opened;
};

DecodeMux::DecodeMux(std::shared_ptr<grpc::Channel> channel, std::string token,
                     absl::Duration deadline, std::optional<absl::Duration> rotate_after)
    : stub_(v1::Worker::NewStub(channel)),
      token_(std::move(token)),
      deadline_(deadline),
      rotate_after_(rotate_after.value_or(deadline / 2)) {
  thread_ = std::thread([this] { Loop(); });
}

DecodeMux::~DecodeMux() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

uint64_t DecodeMux::requests() const {
  absl::MutexLock lock(&mu_);
  return requests_;
}

uint64_t DecodeMux::items() const {
  absl::MutexLock lock(&mu_);
  return items_;
}

absl::Status DecodeMux::Attend(v1::DecodeItem item, float* out, size_t out_floats, bool ends_step) {
  Pending p;
  p.item = std::move(item);
  p.out = out;
  p.out_floats = out_floats;
  p.ends_step = ends_step;
  absl::MutexLock lock(&mu_);
  queue_.push_back(&p);
  mu_.Await(absl::Condition(&p.done));
  return p.status;
}

void DecodeMux::Loop() {
  // `cur` takes new steps; `old`, once `cur` was rotated, finishes the steps
  // begun on it. A session stays in `mid_step` (with its step's stream)
  // from its step's first item to its last.
  std::unique_ptr<Stream> cur, old;
  std::map<std::string, const Stream*> mid_step;
  auto forget = [&mid_step](const Stream* s) {
    for (auto it = mid_step.begin(); it != mid_step.end();) {
      it = it->second == s ? mid_step.erase(it) : std::next(it);
    }
  };
  auto close = [&](std::unique_ptr<Stream>* s, bool cancel) {
    if (*s == nullptr) return grpc::Status::OK;
    if (cancel) (*s)->ctx->TryCancel();
    (*s)->rw->WritesDone();
    grpc::Status st = (*s)->rw->Finish();
    forget(s->get());
    s->reset();
    return st;
  };
  // One request on *s with `part`'s items; fills their statuses and outputs.
  auto send = [&](std::unique_ptr<Stream>* s, const std::vector<Pending*>& part) {
    if (*s == nullptr) {
      *s = std::make_unique<Stream>();
      (*s)->ctx = std::make_unique<grpc::ClientContext>();
      if (!token_.empty()) (*s)->ctx->AddMetadata("authorization", "Bearer " + token_);
      (*s)->ctx->set_deadline(absl::ToChronoTime(absl::Now() + deadline_));
      (*s)->rw = stub_->Decode((*s)->ctx.get());
      (*s)->opened = absl::Now();
    }
    const Stream* on = s->get();
    v1::DecodeRequest req;
    std::vector<std::string> ids;
    for (Pending* p : part) {
      ids.push_back(p->item.session_id());
      *req.add_items() = std::move(p->item);
    }
    v1::DecodeResponse resp;
    absl::Status st;
    if (!(*s)->rw->Write(req) || !(*s)->rw->Read(&resp)) {
      st = FromGrpc(close(s, false), "Decode");
      if (st.ok()) st = absl::UnavailableError("Decode: the stream ended");
    } else if (resp.o_size() != static_cast<int>(part.size())) {
      st = absl::InternalError("Decode: the response does not hold one output per item");
      close(s, true).IgnoreError();
    }
    for (size_t i = 0; i < part.size(); ++i) {
      Pending* p = part[i];
      p->status = st;
      if (st.ok()) {
        p->status = ReadDenseExactly(resp.o(static_cast<int>(i)), p->out, p->out_floats, "Decode");
      }
      if (st.ok() && !p->ends_step) {
        mid_step[ids[i]] = on;
      } else {
        mid_step.erase(ids[i]);
      }
    }
  };
  for (;;) {
    std::vector<Pending*> batch;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](DecodeMux* m)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(m->mu_) { return m->stop_ || !m->queue_.empty(); },
          this));
      if (queue_.empty()) break;  // stop_ and drained.
      batch.swap(queue_);
      ++requests_;
      items_ += batch.size();
    }
    // A stream past 9/10 of its deadline is closed whatever is left on it
    // (those steps are rolled back); one past rotate_after takes no new step.
    if (old != nullptr && absl::Now() - old->opened > deadline_ * 9 / 10) {
      close(&old, false).IgnoreError();
    }
    if (cur != nullptr && old == nullptr && absl::Now() - cur->opened >= rotate_after_) {
      old = std::move(cur);
    }
    std::vector<Pending*> on_old, on_cur;
    for (Pending* p : batch) {
      auto it = mid_step.find(p->item.session_id());
      const bool continues_on_old =
          old != nullptr && it != mid_step.end() && it->second == old.get();
      (continues_on_old ? on_old : on_cur).push_back(p);
    }
    if (!on_old.empty()) send(&old, on_old);
    if (!on_cur.empty()) send(&cur, on_cur);
    if (old != nullptr && std::none_of(mid_step.begin(), mid_step.end(),
                                       [&](const auto& e) { return e.second == old.get(); })) {
      close(&old, false).IgnoreError();
    }
    absl::MutexLock lock(&mu_);
    for (Pending* p : batch) p->done = true;
  }
  close(&old, false).IgnoreError();
  close(&cur, false).IgnoreError();
}

absl::StatusOr<v1::PutSkewResponse> UploadSkew(std::shared_ptr<grpc::Channel> channel,
                                               const std::string& bytes, const std::string& token,
                                               absl::Duration deadline) {
  auto stub = v1::Worker::NewStub(std::move(channel));
  grpc::ClientContext ctx;
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  v1::PutSkewResponse resp;
  auto w = stub->PutSkew(&ctx, &resp);
  constexpr size_t kSlice = size_t{1} << 20;
  for (size_t at = 0; at < bytes.size(); at += kSlice) {
    v1::PutSkewRequest r;
    r.set_data(bytes.substr(at, kSlice));
    if (!w->Write(r)) break;  // Finish says why.
  }
  w->WritesDone();
  KVT_RETURN_IF_ERROR(FromGrpc(w->Finish(), "PutSkew"));
  return resp;
}

}  // namespace kvtier
