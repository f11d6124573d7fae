#include "services/worker/worker_service.h"

#include <atomic>
#include <cctype>
#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/names.h"
#include "base/status_macros.h"
#include "encoded/encode.h"
#include "rpc/dense_tensor.h"
#include "rpc/grpc_status.h"
#include "rpc/policy_proto.h"
#include "rpc/wire_format.h"

namespace kvtier {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

size_t DtypeBytes(v1::DType t) { return t == v1::DTYPE_FP16 || t == v1::DTYPE_BF16 ? 2 : 4; }

}  // namespace

WorkerService::WorkerService(worker::Engine* engine, const Authenticator* auth,
                             WorkerMetrics* metrics, Executor* compute, Executor* io,
                             WorkerServiceOptions options, ReplicatedSegments* replicas,
                             ControllerPolicies* policies, KnownNodes* peers)
    : engine_(engine),
      transfer_(engine),
      auth_(auth),
      metrics_(metrics),
      compute_(compute),
      io_(io),
      options_(options),
      replicas_(replicas),
      policies_(policies),
      known_peers_(peers) {
  if (options_.skew_upload_idle > absl::ZeroDuration()) {
    skew_watchdog_ = std::thread([this] { WatchIdleSkewUploads(); });
  }
}

WorkerService::~WorkerService() {
  stop_.Notify();
  if (skew_watchdog_.joinable()) skew_watchdog_.join();
}

absl::StatusOr<worker::SessionKey> WorkerService::Key(const grpc::CallbackServerContext& ctx,
                                                      const std::string& session) const {
  KVT_ASSIGN_OR_RETURN(Principal p, auth_->Authenticate(ctx));
  KVT_RETURN_IF_ERROR(Authenticator::RequireWrite(p));
  KVT_RETURN_IF_ERROR(ValidateName("session_id", session));
  // Without authentication every caller is one tenant; its sessions go to
  // the store under the worker's own store tenant.
  return worker::SessionKey(auth_->enabled() ? p.tenant : std::string(), session);
}

CallOptions WorkerService::StoreCall(const grpc::CallbackServerContext& ctx) const {
  CallOptions call;
  const auto deadline = ctx.deadline();
  if (deadline != std::chrono::system_clock::time_point::max()) {
    call.deadline = absl::FromChrono(deadline);
  }
  call.deadline = call.DeadlineOr(options_.store_deadline);
  return call;
}

void WorkerService::UpdateWorkingSet() {
  const worker::Engine::Totals t = engine_->totals();
  metrics_->WorkingSet(static_cast<double>(t.working_set_bytes));
  metrics_->Sessions(static_cast<double>(t.sessions));
  metrics_->HandoffCache(static_cast<double>(transfer_.HandoffTotals().bytes));
}

grpc::Status WorkerService::Done(const char* method, const absl::Status& s) {
  metrics_->Request(method, s);
  return ToGrpc(s);
}

// ---- Unary calls: each runs on the io executor and finishes from there. ----

template <typename Req, typename Resp>
grpc::ServerUnaryReactor* WorkerService::Unary(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* raw, grpc::ByteBuffer* out,
    const char* method,
    absl::Status (WorkerService::*work)(grpc::CallbackServerContext&, const Req&, Resp*)) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  io_->Schedule([this, ctx, raw, out, method, work, reactor] {
    Req req;
    Resp resp;
    // Parsed here, not by gRPC, so that garbage is INVALID_ARGUMENT with a
    // reason rather than INTERNAL without one.
    absl::Status s = wire::Parse(*raw, &req);
    if (s.ok()) s = (this->*work)(*ctx, req, &resp);
    if (s.ok()) *out = wire::Serialize(resp);
    UpdateWorkingSet();
    reactor->Finish(Done(method, s));
  });
  return reactor;
}

grpc::ServerUnaryReactor* WorkerService::OpenSession(grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* req,
                                                     grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, "OpenSession", &WorkerService::DoOpenSession);
}
grpc::ServerUnaryReactor* WorkerService::EndRound(grpc::CallbackServerContext* ctx,
                                                  const grpc::ByteBuffer* req,
                                                  grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, "EndRound", &WorkerService::DoEndRound);
}
grpc::ServerUnaryReactor* WorkerService::CloseSession(grpc::CallbackServerContext* ctx,
                                                      const grpc::ByteBuffer* req,
                                                      grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, "CloseSession", &WorkerService::DoCloseSession);
}

grpc::ServerUnaryReactor* WorkerService::SendSession(grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* req,
                                                     grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, "SendSession", &WorkerService::DoSendSession);
}
grpc::ServerUnaryReactor* WorkerService::HeldRounds(grpc::CallbackServerContext* ctx,
                                                    const grpc::ByteBuffer* req,
                                                    grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, "HeldRounds", &WorkerService::DoHeldRounds);
}

absl::Status WorkerService::DoOpenSession(grpc::CallbackServerContext& ctx,
                                          const v1::OpenSessionRequest& req,
                                          v1::OpenSessionResponse* resp) {
  KVT_ASSIGN_OR_RETURN(worker::SessionKey id, Key(ctx, req.session_id()));
  KVT_ASSIGN_OR_RETURN(worker::ModelShape shape, ShapeFromProto(req.model()));
  KVT_ASSIGN_OR_RETURN(worker::SessionPolicy policy,
                       PolicyFromProto(req.policy(), FromProto(req.model().dtype())));
  // No Policy at all (not a default one): the model's, from the controller.
  const bool follow = !req.has_policy() && policies_ != nullptr;
  v1::Policy requested = req.policy();
  if (follow) {
    KVT_ASSIGN_OR_RETURN(std::optional<v1::GetPolicyResponse> a,
                         policies_->ForOpen(id, req.model(), StoreCall(ctx)));
    if (a.has_value()) {
      KVT_ASSIGN_OR_RETURN(policy, PolicyFromAnswer(*a, FromProto(req.model().dtype())));
      requested = a->policy();
    }
  }
  if (req.store_addresses_size() > 0) {
    if (replicas_ == nullptr) {
      return absl::FailedPreconditionError("this worker cannot use per-session store replicas");
    }
    if (engine_->Shape(id).ok()) {
      return absl::AlreadyExistsError(absl::StrCat("session ", id.ToString(), " already exists"));
    }
    // Set before the session exists and undone if it cannot open: a
    // session's rounds never go anywhere but its replicas.
    KVT_RETURN_IF_ERROR(replicas_->SetReplicas(
        id.tenant, id.session, {req.store_addresses().begin(), req.store_addresses().end()},
        StoreCall(ctx)));
  }
  uint32_t next_round = 0;
  absl::Status s;
  if (req.resume()) {
    std::optional<uint32_t> at;
    if (req.has_resume_at_round()) at = req.resume_at_round();
    absl::StatusOr<uint32_t> n = engine_->ResumeSession(id, shape, policy, StoreCall(ctx), at);
    s = n.status();
    if (n.ok()) next_round = *n;
  } else {
    s = engine_->OpenSession(id, shape, policy);
  }
  if (!s.ok()) {
    if (req.store_addresses_size() > 0 && !absl::IsAlreadyExists(s)) {
      replicas_->Forget(id.tenant, id.session);
    }
    return s;
  }
  if (follow) policies_->Follow(id, req.model());
  KVT_ASSIGN_OR_RETURN(worker::SessionStats st, engine_->Stats(id));
  *resp->mutable_effective_policy() = EffectivePolicy(requested, st.policy);
  resp->set_on_device(st.on_device);
  resp->set_speculation_on_device(st.speculation_on_device);
  resp->set_next_round(next_round);
  return absl::OkStatus();
}

absl::Status WorkerService::DoEndRound(grpc::CallbackServerContext& ctx,
                                       const v1::EndRoundRequest& req, v1::EndRoundResponse* resp) {
  KVT_ASSIGN_OR_RETURN(worker::SessionKey id, Key(ctx, req.session_id()));
  KVT_ASSIGN_OR_RETURN(worker::EndRoundReport r, engine_->EndRound(id, StoreCall(ctx)));
  *resp = EndRoundToProto(r);
  metrics_->Speculation(r.speculation);
  metrics_->Pool(r.pool);
  metrics_->Stored(r.stored_bytes);
  return absl::OkStatus();
}

absl::Status WorkerService::DoCloseSession(grpc::CallbackServerContext& ctx,
                                           const v1::CloseSessionRequest& req,
                                           v1::CloseSessionResponse*) {
  KVT_ASSIGN_OR_RETURN(worker::SessionKey id, Key(ctx, req.session_id()));
  absl::Status s = engine_->CloseSession(id, req.delete_from_store(), StoreCall(ctx));
  if (policies_ != nullptr) policies_->Forget(id);
  if (replicas_ != nullptr && !absl::IsNotFound(s)) replicas_->Forget(id.tenant, id.session);
  return s;
}

// ---- Prefill ----

// One layer at a time: its chunks are read and converted on the compute
// executor, the layer runs there (the wait for a recall fetch at L_w + 1
// included, never on a callback thread), and its output goes back in slices.
// Exactly one Finish() on every path, from the executor; nothing touches
// `this` after it.
class WorkerService::PrefillReactor
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  PrefillReactor(WorkerService* svc, grpc::CallbackServerContext* ctx)
      : svc_(svc), ctx_(ctx), call_(svc->StoreCall(*ctx)) {
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // The client half-closed, or the call broke.
      svc_->compute_->Schedule([this] { EndOfStream(); });
      return;
    }
    svc_->compute_->Schedule([this] { OnMessage(); });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      svc_->compute_->Schedule([this] { Fail(absl::CancelledError("the client went away")); });
      return;
    }
    out_msgs_.pop_front();
    if (!out_msgs_.empty()) {
      StartWrite(&out_msgs_.front());
    } else {
      StartRead(&in_);
    }
  }

  void OnDone() override { delete this; }

 private:
  void OnMessage() {
    // Parsed here, not by gRPC, so that garbage is INVALID_ARGUMENT rather
    // than a read that just ends.
    absl::Status s = wire::Parse(in_, &req_);
    if (s.ok()) s = Accumulate();
    if (!s.ok()) {
      Fail(s);
      return;
    }
    if (req_.more_chunks()) {
      StartRead(&in_);
      return;
    }
    s = RunLayer();
    if (!s.ok()) Fail(s);
  }

  // Adds one message's token slice to the layer being gathered.
  absl::Status Accumulate() {
    if (!id_.has_value()) {
      if (svc_->options_.role == WorkerServiceOptions::Role::kDecode) {
        return absl::FailedPreconditionError(
            "this worker only decodes (--role=decode): prefill on a prefill worker with "
            "LayerRequest.transfer_to naming this one");
      }
      if (req_.session_id().empty()) {
        return absl::InvalidArgumentError("the first LayerRequest must name the session");
      }
      KVT_ASSIGN_OR_RETURN(id_, svc_->Key(*ctx_, req_.session_id()));
      session_ = req_.session_id();
      KVT_ASSIGN_OR_RETURN(shape_, svc_->engine_->Shape(*id_));
    } else if (!req_.session_id().empty() && req_.session_id() != session_) {
      return absl::InvalidArgumentError("a Prefill stream carries one session");
    }
    if (!gathering_) {
      if (!req_.transfer_to().empty() && req_.layer() != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("transfer_to is set on layer 0 of a step, not on layer ", req_.layer()));
      }
      if (req_.layer() == 0) transfer_to_ = req_.transfer_to();
      layer_ = static_cast<int>(req_.layer());
      question_ = req_.question_tokens();
      dtype_ = req_.q().dtype();
      q_.clear();
      k_.clear();
      v_.clear();
      gathering_ = true;
    } else if (static_cast<int>(req_.layer()) != layer_) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", req_.layer(), " arrived before the last chunk of layer ", layer_));
    }
    const int d = shape_.head_dim;
    // A whole layer in one message is read where it lies, in its dtype: the
    // engine's append is then its only copy into the worker (and K/V in the
    // model's dtype are not converted).
    direct_ = false;
    if (q_.empty() && !req_.more_chunks()) {
      KVT_ASSIGN_OR_RETURN(const int64_t qt, DenseTokens(req_.q(), shape_.q_heads, d, "q"));
      KVT_ASSIGN_OR_RETURN(const int64_t kt, DenseTokens(req_.k(), shape_.kv_heads, d, "k"));
      KVT_ASSIGN_OR_RETURN(const int64_t vt, DenseTokens(req_.v(), shape_.kv_heads, d, "v"));
      if (qt != kt || kt != vt) {
        return absl::InvalidArgumentError(
            absl::StrCat("q carries ", qt, " tokens, k ", kt, " and v ", vt));
      }
      direct_ = true;
      direct_tokens_ = qt;
      return absl::OkStatus();
    }
    const size_t q0 = q_.size(), k0 = k_.size();
    KVT_RETURN_IF_ERROR(AppendDense(req_.q(), shape_.q_heads, d, "q", &q_));
    KVT_RETURN_IF_ERROR(AppendDense(req_.k(), shape_.kv_heads, d, "k", &k_));
    KVT_RETURN_IF_ERROR(AppendDense(req_.v(), shape_.kv_heads, d, "v", &v_));
    const size_t qt = (q_.size() - q0) / (static_cast<size_t>(shape_.q_heads) * d);
    const size_t kt = (k_.size() - k0) / (static_cast<size_t>(shape_.kv_heads) * d);
    if (qt != kt || v_.size() != k_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("q carries ", qt, " tokens, k ", kt, " and v ",
                       (v_.size() - k0) / (static_cast<size_t>(shape_.kv_heads) * d)));
    }
    return absl::OkStatus();
  }

  absl::Status RunLayer() {
    gathering_ = false;
    const int d = shape_.head_dim;
    const int64_t n =
        direct_ ? direct_tokens_
                : static_cast<int64_t>(q_.size() / (static_cast<size_t>(shape_.q_heads) * d));
    auto rows = [](const v1::DenseTensor& t) {
      return worker::Rows(FromProto(t.dtype()), t.data().data());
    };
    const worker::Rows q = direct_ ? rows(req_.q()) : worker::Rows(q_.data());
    const worker::Rows k = direct_ ? rows(req_.k()) : worker::Rows(k_.data());
    const worker::Rows v = direct_ ? rows(req_.v()) : worker::Rows(v_.data());
    out_.resize(static_cast<size_t>(n) * shape_.q_heads * d);
    if (layer_ == 0) {
      sender_.reset();
      if (!transfer_to_.empty()) {
        // The hand-off's stream opens before the step runs: a session that
        // cannot be exported is refused with nothing done.
        KVT_ASSIGN_OR_RETURN(sender_, svc_->NewSender(*ctx_, *id_, transfer_to_));
        KVT_RETURN_IF_ERROR(sender_->Begin());
      }
    }
    const auto t0 = std::chrono::steady_clock::now();
    auto recall =
        svc_->engine_->PrefillLayer(*id_, layer_, n, question_, q, k, v, out_.data(), call_);
    if (!recall.ok()) {
      // A failed recall rolled its step back already; any other failure
      // leaves our step in flight, which EndOfStream/Fail roll back.
      return recall.status();
    }
    svc_->metrics_->Layer("prefill", SecondsSince(t0));
    in_step_ = layer_ + 1 < shape_.layers;
    std::optional<v1::TransferReport> transfer;
    if (sender_ != nullptr) {
      // This layer goes out now, while the next ones compute.
      absl::Status sent = sender_->SendLayer(layer_);
      if (!sent.ok() && in_step_) return sent;
      if (!in_step_) {
        absl::StatusOr<v1::TransferReport> report =
            sent.ok() ? sender_->Finish() : absl::StatusOr<v1::TransferReport>(sent);
        svc_->metrics_->Sent(sender_->path(), report);
        sender_.reset();
        if (!report.ok()) {
          // The step committed here; undone, so that it can be sent again.
          absl::Status undo = svc_->transfer_.RevertPrefill(*id_, n);
          return absl::Status(
              report.status().code(),
              absl::StrCat(report.status().message(),
                           undo.ok()
                               ? "; the prefill step was undone on this worker: send it again"
                               : absl::StrCat("; undoing the step failed: ", undo.ToString())));
        }
        svc_->ForgetMoved(*id_);
        transfer = std::move(*report);
      }
    }
    // The output in slices of at most max_response_bytes.
    const size_t row = static_cast<size_t>(shape_.q_heads) * d * DtypeBytes(dtype_);
    const int64_t per = std::max<int64_t>(
        1, static_cast<int64_t>(svc_->options_.max_response_bytes / std::max<size_t>(row, 1)));
    v1::LayerResponse r;
    for (int64_t t = 0; t < n; t += per) {
      r.Clear();
      r.set_layer(static_cast<uint32_t>(layer_));
      WriteDense(out_.data(), t, std::min(per, n - t), shape_.q_heads, d, dtype_, r.mutable_o());
      r.set_more_chunks(t + per < n);
      if (!r.more_chunks() && recall->has_value()) {
        const worker::RecallReport& rr = **recall;
        *r.mutable_recall() = RecallToProto(rr);
        svc_->metrics_->Recall(rr, rr.fetched_segments > 0 && rr.bytes_fetched > 0);
      }
      if (!r.more_chunks() && transfer.has_value()) *r.mutable_transfer() = *transfer;
      out_msgs_.push_back(wire::Serialize(r));
    }
    StartWrite(&out_msgs_.front());
    return absl::OkStatus();
  }

  // The client closed its side: fine between steps, a rolled-back step in
  // the middle of one.
  void EndOfStream() {
    absl::Status s;
    if (in_step_ || gathering_) {
      s = absl::FailedPreconditionError(
          absl::StrCat("the Prefill stream ended in the middle of a step (after layer ", layer_,
                       "); the step was rolled back"));
    }
    Fail(s);
  }

  void Fail(const absl::Status& s) {
    sender_.reset();  // A hand-off in flight is cancelled: the receiver keeps nothing.
    if (in_step_ && id_.has_value()) {
      // Deliberately ignored: NOT_FOUND when the session was closed meanwhile.
      svc_->engine_->AbortStep(*id_).IgnoreError();
    }
    svc_->UpdateWorkingSet();
    Finish(svc_->Done("Prefill", s));
  }

  WorkerService* const svc_;
  grpc::CallbackServerContext* const ctx_;
  const CallOptions call_;
  grpc::ByteBuffer in_;
  v1::LayerRequest req_;
  std::optional<worker::SessionKey> id_;
  std::string session_;
  worker::ModelShape shape_;
  // The layer being gathered from its chunks.
  bool gathering_ = false;
  int layer_ = 0;
  int64_t question_ = 0;
  v1::DType dtype_ = v1::DTYPE_FP32;
  std::vector<float> q_, k_, v_, out_;
  // The layer is req_'s own bytes (one message), `direct_tokens_` rows.
  bool direct_ = false;
  int64_t direct_tokens_ = 0;
  // This stream has layers of an unfinished step in the engine.
  bool in_step_ = false;
  // The step's hand-off (transfer_to on its layer 0), while it runs.
  std::string transfer_to_;
  std::unique_ptr<SessionSender> sender_;
  std::deque<grpc::ByteBuffer> out_msgs_;
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* WorkerService::Prefill(
    grpc::CallbackServerContext* ctx) {
  return new PrefillReactor(this, ctx);
}

// ---- Decode ----

// One DecodeRequest at a time. Its items are grouped by session; the groups
// run in parallel on the compute executor (one group on the thread that read
// the request, the others as tasks), items of a group in their order, and
// the last group to finish writes the response. Nothing waits for anything.
class WorkerService::DecodeReactor
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  DecodeReactor(WorkerService* svc, grpc::CallbackServerContext* ctx) : svc_(svc), ctx_(ctx) {
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      svc_->compute_->Schedule([this] { EndOfStream(); });
      return;
    }
    svc_->compute_->Schedule([this] { OnRequest(); });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      svc_->compute_->Schedule([this] { Fail(absl::CancelledError("the client went away")); });
      return;
    }
    StartRead(&in_);
  }

  void OnDone() override { delete this; }

 private:
  struct Item {
    worker::SessionKey key{""};
    worker::ModelShape shape;
  };

  void OnRequest() {
    if (svc_->options_.role == WorkerServiceOptions::Role::kPrefill) {
      Fail(absl::FailedPreconditionError(
          "this worker only prefills (--role=prefill): decode on the worker the prefill handed "
          "the session to (LayerRequest.transfer_to)"));
      return;
    }
    if (absl::Status s = wire::Parse(in_, &req_); !s.ok()) {
      Fail(s);
      return;
    }
    resp_.Clear();
    items_.clear();
    {
      absl::MutexLock lock(&mu_);
      first_error_ = absl::OkStatus();
    }
    std::map<worker::SessionKey, std::vector<int>> groups;
    std::vector<const std::vector<int>*> order;
    for (int i = 0; i < req_.items_size(); ++i) {
      const v1::DecodeItem& it = req_.items(i);
      Item item;
      absl::Status s = [&]() -> absl::Status {
        auto known = keys_.find(it.session_id());
        if (known == keys_.end()) {
          KVT_ASSIGN_OR_RETURN(worker::SessionKey key, svc_->Key(*ctx_, it.session_id()));
          known = keys_.emplace(it.session_id(), std::move(key)).first;
        }
        item.key = known->second;
        // Looked up per request: a session may be closed and opened again.
        KVT_ASSIGN_OR_RETURN(item.shape, svc_->engine_->Shape(item.key));
        return absl::OkStatus();
      }();
      if (!s.ok()) {
        Fail(absl::Status(s.code(), absl::StrCat("item ", i, ": ", s.message())));
        return;
      }
      auto [g, inserted] = groups.try_emplace(item.key);
      if (inserted) order.push_back(&g->second);
      g->second.push_back(i);
      items_.push_back(std::move(item));
      resp_.add_o();
    }
    if (order.empty()) {
      Respond();
      return;
    }
    pending_.store(static_cast<int>(order.size()));
    for (size_t g = 1; g < order.size(); ++g) {
      svc_->compute_->Schedule([this, group = *order[g]] { RunGroup(group); });
    }
    RunGroup(*order[0]);
  }

  void RunGroup(const std::vector<int>& group) {
    std::vector<float> out;
    for (int i : group) {
      const v1::DecodeItem& it = req_.items(i);
      const Item& item = items_[i];
      const int d = item.shape.head_dim;
      absl::Status s = [&]() -> absl::Status {
        // Every tensor is read where it lies, in its dtype (the engine
        // copies K/V in the model's dtype and widens what it must).
        auto rows = [&](const v1::DenseTensor& t, int heads,
                        const char* what) -> absl::StatusOr<worker::Rows> {
          KVT_ASSIGN_OR_RETURN(const int64_t tokens, DenseTokens(t, heads, d, what));
          if (tokens != 1) {
            return absl::InvalidArgumentError("a decode item carries exactly one token");
          }
          return worker::Rows(FromProto(t.dtype()), t.data().data());
        };
        KVT_ASSIGN_OR_RETURN(const worker::Rows qp, rows(it.q(), item.shape.q_heads, "q"));
        KVT_ASSIGN_OR_RETURN(const worker::Rows kp, rows(it.k(), item.shape.kv_heads, "k"));
        KVT_ASSIGN_OR_RETURN(const worker::Rows vp, rows(it.v(), item.shape.kv_heads, "v"));
        worker::Rows qn;
        if (it.has_q_next()) {
          KVT_ASSIGN_OR_RETURN(qn, rows(it.q_next(), item.shape.q_heads, "q_next"));
        }
        out.resize(static_cast<size_t>(item.shape.q_heads) * d);
        const auto t0 = std::chrono::steady_clock::now();
        KVT_RETURN_IF_ERROR(svc_->engine_->DecodeLayer(item.key, static_cast<int>(it.layer()), qp,
                                                       kp, vp, out.data(), qn));
        svc_->metrics_->Layer("decode", SecondsSince(t0));
        WriteDense(out.data(), 0, 1, item.shape.q_heads, d, it.q().dtype(), resp_.mutable_o(i));
        return absl::OkStatus();
      }();
      absl::MutexLock lock(&mu_);
      if (!s.ok()) {
        if (first_error_.ok()) {
          first_error_ = absl::Status(s.code(), absl::StrCat("item ", i, " (session ",
                                                             it.session_id(), "): ", s.message()));
        }
        break;
      }
      if (static_cast<int>(it.layer()) + 1 < item.shape.layers) {
        in_step_.insert(item.key);
      } else {
        in_step_.erase(item.key);
      }
    }
    if (pending_.fetch_sub(1) != 1) return;
    // The last group: the response is complete.
    absl::Status s;
    {
      absl::MutexLock lock(&mu_);
      s = first_error_;
    }
    if (!s.ok()) {
      Fail(s);
      return;
    }
    Respond();
  }

  void Respond() {
    out_ = wire::Serialize(resp_);
    StartWrite(&out_);
  }

  void EndOfStream() {
    bool mid_step;
    {
      absl::MutexLock lock(&mu_);
      mid_step = !in_step_.empty();
    }
    Fail(mid_step ? absl::FailedPreconditionError("the Decode stream ended in the middle of a "
                                                  "step; the step was rolled back")
                  : absl::OkStatus());
  }

  void Fail(const absl::Status& s) {
    std::set<worker::SessionKey> abort;
    {
      absl::MutexLock lock(&mu_);
      abort.swap(in_step_);
    }
    // Deliberately ignored: NOT_FOUND when a session was closed meanwhile.
    for (const worker::SessionKey& key : abort) svc_->engine_->AbortStep(key).IgnoreError();
    Finish(svc_->Done("Decode", s));
  }

  WorkerService* const svc_;
  grpc::CallbackServerContext* const ctx_;
  grpc::ByteBuffer in_, out_;
  v1::DecodeRequest req_;
  v1::DecodeResponse resp_;
  // Per item of req_: the engine key and shape (from keys_).
  std::vector<Item> items_;
  // Session id -> engine key, authenticated once per stream.
  std::map<std::string, worker::SessionKey> keys_;
  std::atomic<int> pending_{0};
  absl::Mutex mu_;
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
  // Sessions whose current step this stream has begun and not finished.
  std::set<worker::SessionKey> in_step_ ABSL_GUARDED_BY(mu_);
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* WorkerService::Decode(
    grpc::CallbackServerContext* ctx) {
  return new DecodeReactor(this, ctx);
}

}  // namespace kvtier
