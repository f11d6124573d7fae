// The conversation backends of refengine/conversation.h: the local full
// cache, one kvtier-worker (TierBackend) and a cluster through
// kvtier-controller (ClusterBackend), with failover and resume.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "grpcpp/client_context.h"
#include "refengine/conversation.h"
#include "rpc/dense_tensor.h"
#include "rpc/grpc_status.h"

namespace kvtier::refengine {
namespace {

class Local : public ConversationBackend {
 public:
  explicit Local(const model::ModelConfig& c) : full_(c), layered_(c, &full_) {}
  absl::Status AttendLayer(int layer, int pos0, int n, const float* q, const float* k,
                           const float* v, float* out) override {
    return layered_.AttendLayer(layer, pos0, n, q, k, v, out);
  }
  absl::Status BeginStep(bool, int, int) override { return absl::OkStatus(); }
  absl::Status EndStep() override { return absl::OkStatus(); }
  absl::Status EndRound() override { return absl::OkStatus(); }

 private:
  model::FullCacheAttention full_;
  model::PerTokenLayerAttention layered_;
};

class Tier : public TierSession {
 public:
  Tier(const v1::ModelSpec& spec, std::shared_ptr<grpc::Channel> ch, std::string session,
       std::string token, TierDeadlines deadlines, DecodeMux* mux)
      : spec_(spec),
        q_heads_(static_cast<int>(spec.num_q_heads())),
        kv_heads_(static_cast<int>(spec.num_kv_heads())),
        head_dim_(static_cast<int>(spec.head_dim())),
        stub_(v1::Worker::NewStub(ch)),
        session_(std::move(session)),
        token_(token),
        mux_(mux),
        deadlines_(deadlines) {}
  ~Tier() override {
    if (dstream_ != nullptr) {
      dctx_->TryCancel();
      dstream_->Finish().IgnoreError();  // Cancelled on purpose.
    }
  }

  void Disaggregate(const Disaggregation& pd) {
    dstub_ = v1::Worker::NewStub(pd.decode_channel);
    prefill_target_ = pd.prefill_target;
    decode_target_ = pd.decode_target;
  }
  // The worker that holds the session now.
  v1::Worker::Stub* Holder() const { return on_decode_ ? dstub_.get() : stub_.get(); }

  const std::vector<TierRound>& rounds() const override { return rounds_; }
  const v1::Policy& effective_policy() const override { return effective_; }
  bool on_device() const override { return on_device_; }
  bool speculation_on_device() const override { return spec_on_device_; }

  // A speculating session sends each decode layer's next-layer query.
  bool WantsNextLayerQuery() const override { return !effective_.speculation_skew().empty(); }
  absl::Status NextLayerQuery(int layer, int pos0, int n, const float* q_next) override {
    (void)pos0;
    if (n == 1) {
      q_next_.assign(q_next, q_next + static_cast<size_t>(q_heads_) * head_dim_);
      q_next_layer_ = layer;
    }
    return absl::OkStatus();
  }

  // Every call carries a deadline: a worker (or a store behind it) that
  // stops costs the conversation this long, then a precise error.
  std::unique_ptr<grpc::ClientContext> Context(absl::Duration deadline) const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    if (!token_.empty()) ctx->AddMetadata("authorization", "Bearer " + token_);
    // A service mesh keeps a conversation on its worker by this header
    // (deploy/k8s/overlays/mesh: consistent hashing on it).
    ctx->AddMetadata("x-kvtier-session", session_);
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    return ctx;
  }

  // `stores`: the session's store replicas (empty: the worker's own);
  // `resume`: rebuild it from the store (next_round() says where it goes
  // on).
  absl::Status Open(const v1::Policy& policy, const std::vector<std::string>& stores = {},
                    bool resume = false, std::optional<uint32_t> resume_at = std::nullopt) {
    v1::OpenSessionRequest r;
    r.set_session_id(session_);
    *r.mutable_model() = spec_;
    *r.mutable_policy() = policy;
    for (const std::string& a : stores) r.add_store_addresses(a);
    r.set_resume(resume);
    if (resume_at.has_value()) r.set_resume_at_round(*resume_at);
    v1::OpenSessionResponse resp;
    auto ctx = Context(deadlines_.call);
    KVT_RETURN_IF_ERROR(FromGrpc(stub_->OpenSession(ctx.get(), r, &resp), "OpenSession"));
    effective_ = resp.effective_policy();
    on_device_ = resp.on_device();
    spec_on_device_ = resp.speculation_on_device();
    next_round_ = resp.next_round();
    return absl::OkStatus();
  }
  uint32_t next_round() const { return next_round_; }
  // The reports of rounds stored before this worker took the session over.
  void set_rounds(std::vector<TierRound> r) { rounds_ = std::move(r); }
  // Drops the open streams without finishing them (the worker is gone).
  void Abandon() {
    if (pstream_ != nullptr) {
      pctx_->TryCancel();
      pstream_->Finish().IgnoreError();
      pstream_.reset();
    }
    if (dstream_ != nullptr) {
      dctx_->TryCancel();
      dstream_->Finish().IgnoreError();
      dstream_.reset();
    }
  }

  absl::Status Close(bool delete_from_store) override {
    v1::CloseSessionRequest r;
    r.set_session_id(session_);
    r.set_delete_from_store(delete_from_store);
    v1::CloseSessionResponse resp;
    KVT_RETURN_IF_ERROR(CloseDecodeStream());
    auto ctx = Context(deadlines_.call);
    return FromGrpc(Holder()->CloseSession(ctx.get(), r, &resp), "CloseSession");
  }

  absl::Status BeginStep(bool prefill, int n, int question_tokens) override {
    prefill_ = prefill;
    question_ = question_tokens;
    if (prefill) {
      pctx_ = Context(deadlines_.step);
      pstream_ = Holder()->Prefill(pctx_.get());
      step_start_ = std::chrono::steady_clock::now();
      // A first prefill of the round on the prefill worker is handed off.
      hand_off_ = dstub_ != nullptr && !on_decode_;
    } else if (mux_ == nullptr && dstream_ == nullptr) {
      // One Decode stream for the round's steps, not one per token.
      dctx_ = Context(deadlines_.round);
      dstream_ = Holder()->Decode(dctx_.get());
    }
    (void)n;
    return absl::OkStatus();
  }

  absl::Status AttendLayer(int layer, int pos0, int n, const float* q, const float* k,
                           const float* v, float* out) override {
    (void)pos0;
    const int hd = head_dim_;
    if (prefill_) {
      // Token slices of at most kChunkBytes per message, like the store's
      // chunks, instead of one message as large as the layer.
      const int64_t es = wire_ == v1::DTYPE_FP32 ? 4 : 2;
      const int64_t row = static_cast<int64_t>(q_heads_ + 2 * kv_heads_) * hd * es;
      const int per = static_cast<int>(std::max<int64_t>(1, kChunkBytes / row));
      for (int t = 0; t < n; t += per) {
        const int m = std::min(per, n - t);
        v1::LayerRequest req;
        if (layer == 0 && t == 0) {
          req.set_session_id(session_);
          if (hand_off_) req.set_transfer_to(decode_target_);
        }
        req.set_layer(layer);
        req.set_question_tokens(question_);
        WriteDense(q, t, m, q_heads_, hd, wire_, req.mutable_q());
        WriteDense(k, t, m, kv_heads_, hd, wire_, req.mutable_k());
        WriteDense(v, t, m, kv_heads_, hd, wire_, req.mutable_v());
        req.set_more_chunks(t + m < n);
        if (!pstream_->Write(req)) {
          return BrokenPrefill(layer);
        }
      }
      size_t got = 0;  // Output rows so far.
      const size_t qrow = static_cast<size_t>(q_heads_) * hd;
      v1::LayerResponse resp;
      do {
        if (!pstream_->Read(&resp)) {
          return BrokenPrefill(layer);
        }
        const int64_t rows = resp.o().shape_size() == 3 ? resp.o().shape(0) : -1;
        if (rows < 1 || got + rows > static_cast<size_t>(n)) {
          return absl::InternalError(absl::StrCat("Prefill layer ", layer, ": bad output"));
        }
        KVT_RETURN_IF_ERROR(ReadDenseExactly(resp.o(), out + got * qrow, rows * qrow,
                                             absl::StrCat("Prefill layer ", layer).c_str()));
        got += rows;
        if (resp.has_recall()) {
          last_recall_ = resp.recall();
          has_recall_ = true;
        }
        if (resp.has_transfer()) transfer_ = resp.transfer();
      } while (resp.more_chunks());
      if (got != static_cast<size_t>(n)) {
        return absl::InternalError(absl::StrCat("Prefill layer ", layer, ": short output"));
      }
      return absl::OkStatus();
    }
    v1::DecodeRequest req;
    auto* item = req.add_items();
    item->set_session_id(session_);
    item->set_layer(layer);
    WriteDense(q, 0, 1, q_heads_, hd, wire_, item->mutable_q());
    WriteDense(k, 0, 1, kv_heads_, hd, wire_, item->mutable_k());
    WriteDense(v, 0, 1, kv_heads_, hd, wire_, item->mutable_v());
    if (q_next_layer_ == layer) {
      WriteDense(q_next_.data(), 0, 1, q_heads_, hd, wire_, item->mutable_q_next());
      q_next_layer_ = -1;
    }
    if (mux_ != nullptr) {
      return mux_->Attend(std::move(*item), out, static_cast<size_t>(q_heads_) * hd,
                          layer + 1 == static_cast<int>(spec_.num_layers()));
    }
    v1::DecodeResponse resp;
    if (!dstream_->Write(req) || !dstream_->Read(&resp)) {
      absl::Status s = FromGrpc(dstream_->Finish(), absl::StrCat("Decode layer ", layer));
      dstream_.reset();
      return s;
    }
    if (resp.o_size() != 1) {
      return absl::InternalError(absl::StrCat("Decode layer ", layer, ": bad output"));
    }
    return ReadDenseExactly(resp.o(0), out, static_cast<size_t>(q_heads_) * hd,
                            absl::StrCat("Decode layer ", layer).c_str());
  }

  // The Prefill stream broke: its status, and the stream is gone (a stream
  // is finished once).
  absl::Status BrokenPrefill(int layer) {
    absl::Status s = FromGrpc(pstream_->Finish(), absl::StrCat("Prefill layer ", layer));
    pstream_.reset();
    return s;
  }

  absl::Status EndStep() override {
    if (!prefill_) return absl::OkStatus();  // The Decode stream stays open.
    if (pstream_ == nullptr) return absl::FailedPreconditionError("no Prefill stream");
    pstream_->WritesDone();
    grpc::Status s = pstream_->Finish();
    pstream_.reset();
    if (s.ok() && !has_prefill_ms_) {
      prefill_ms_ =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - step_start_)
              .count();
      has_prefill_ms_ = true;
    }
    if (s.ok() && hand_off_) on_decode_ = true;  // The session lives there now.
    return FromGrpc(s, "Prefill");
  }

  absl::Status CloseDecodeStream() {
    if (dstream_ == nullptr) return absl::OkStatus();
    dstream_->WritesDone();
    grpc::Status s = dstream_->Finish();
    dstream_.reset();
    return FromGrpc(s, "Decode");
  }

  absl::Status EndRound() override {
    v1::EndRoundRequest r;
    r.set_session_id(session_);
    v1::EndRoundResponse resp;
    KVT_RETURN_IF_ERROR(CloseDecodeStream());
    auto ctx = Context(deadlines_.call);
    KVT_RETURN_IF_ERROR(FromGrpc(Holder()->EndRound(ctx.get(), r, &resp), "EndRound"));
    TierRound t = RoundReport(resp, has_recall_ ? &last_recall_ : nullptr, prefill_ms_);
    has_prefill_ms_ = false;
    if (transfer_.has_value()) {
      t.handed_off = true;
      t.transfer_path = transfer_->path();
      t.transfer_wire_bytes = transfer_->wire_bytes();
      t.transfer_reused_bytes = transfer_->reused_bytes();
      t.transfer_raw_bytes = transfer_->past_raw_bytes() + transfer_->open_bytes();
      t.transfer_ms = transfer_->transfer_ms();
      t.transfer_exposed_ms = transfer_->exposed_ms();
      t.transfer_drain_ms = transfer_->drain_ms();
      t.transfer_import_ms = transfer_->receiver_import_ms();
      t.transfer_device_copy_ms = transfer_->receiver_device_copy_ms();
      t.transfer_tail_wait_ms = transfer_->receiver_tail_wait_ms();
      t.transfer_receiver_span_ms = transfer_->receiver_span_ms();
      t.transfer_receiver_busy_ms = transfer_->receiver_busy_ms();
      t.transfer_device_bytes = transfer_->device_bytes();
      t.device_refusal = transfer_->device_refusal();
      t.nccl_links_reused += transfer_->device_link_reused() ? 1 : 0;
      transfer_.reset();
    }
    if (on_decode_) {
      // Back to the prefill worker for the next round.
      v1::SendSessionRequest back;
      back.set_session_id(session_);
      back.set_target(prefill_target_);
      v1::SendSessionResponse sent;
      auto bctx = Context(deadlines_.call);
      KVT_RETURN_IF_ERROR(FromGrpc(dstub_->SendSession(bctx.get(), back, &sent), "SendSession"));
      on_decode_ = false;
      t.return_wire_bytes = sent.report().wire_bytes();
      t.return_reused_bytes = sent.report().reused_bytes();
      t.return_ms = sent.report().transfer_ms();
      t.return_path = sent.report().path();
      t.return_device_bytes = sent.report().device_bytes();
      if (t.device_refusal.empty()) t.device_refusal = sent.report().device_refusal();
      t.nccl_links_reused += sent.report().device_link_reused() ? 1 : 0;
    }
    rounds_.push_back(std::move(t));
    last_recall_.Clear();
    has_recall_ = false;
    return absl::OkStatus();
  }

 private:
  v1::ModelSpec spec_;
  int q_heads_, kv_heads_, head_dim_;
  std::unique_ptr<v1::Worker::Stub> stub_;
  std::string session_, token_;
  bool prefill_ = false;
  int question_ = 0;
  // Disaggregation: the decode worker (null: none) and where the session is.
  std::unique_ptr<v1::Worker::Stub> dstub_;
  std::string prefill_target_, decode_target_;
  bool on_decode_ = false, hand_off_ = false;
  std::optional<v1::TransferReport> transfer_;
  std::chrono::steady_clock::time_point step_start_;
  double prefill_ms_ = 0;
  bool has_prefill_ms_ = false;
  static constexpr int64_t kChunkBytes = int64_t{1} << 20;
  DecodeMux* const mux_;
  // The model's dtype: what q/k/v travel in (half the bytes for fp16).
  const v1::DType wire_ = spec_.dtype() == v1::DTYPE_FP16 || spec_.dtype() == v1::DTYPE_BF16
                              ? spec_.dtype()
                              : v1::DTYPE_FP32;
  TierDeadlines deadlines_;
  std::unique_ptr<grpc::ClientContext> pctx_, dctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::LayerRequest, v1::LayerResponse>> pstream_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> dstream_;
  v1::RecallDecision last_recall_;
  bool has_recall_ = false;
  v1::Policy effective_;
  bool on_device_ = false;
  bool spec_on_device_ = false;
  uint32_t next_round_ = 0;
  std::vector<TierRound> rounds_;
  // The next layer's approximate query of the decode step in flight.
  std::vector<float> q_next_;
  int q_next_layer_ = -1;
};

class Cluster : public ClusterSession {
 public:
  Cluster(const v1::ModelSpec& spec, SessionRouter* router, std::string session, v1::Policy policy,
          std::string token, TierDeadlines deadlines, absl::Duration store_failover,
          std::string skew)
      : spec_(spec),
        router_(router),
        session_(std::move(session)),
        policy_(std::move(policy)),
        token_(std::move(token)),
        deadlines_(deadlines),
        store_failover_(store_failover),
        skew_(std::move(skew)) {}

  // Routes and opens; a worker that cannot be reached at open is avoided.
  absl::Status Open() {
    KVT_ASSIGN_OR_RETURN(route_, router_->Route(session_));
    absl::Status s = OpenOn(/*resume=*/false);
    for (int i = 0; i < 3 && WorkerFailoverCandidate(s) &&
                    !router_->Answers(route_.worker_address(), absl::Seconds(1));
         ++i) {
      KVT_ASSIGN_OR_RETURN(route_, router_->Failover(session_, route_));
      s = OpenOn(/*resume=*/false);
    }
    return s;
  }

  const std::vector<TierRound>& rounds() const override { return inner_->rounds(); }
  const v1::Policy& effective_policy() const override { return inner_->effective_policy(); }
  bool on_device() const override { return inner_->on_device(); }
  bool speculation_on_device() const override { return inner_->speculation_on_device(); }
  const std::vector<Failover>& failovers() const override { return failovers_; }
  std::string worker_node_id() const override { return route_.worker_node_id(); }
  std::vector<std::string> store_node_ids() const override {
    return {route_.store_node_ids().begin(), route_.store_node_ids().end()};
  }

  absl::Status RefreshRoute() override {
    KVT_ASSIGN_OR_RETURN(route_, router_->Refresh(session_));
    return absl::OkStatus();
  }

  absl::Status Close(bool delete_from_store) override {
    absl::Status s = inner_->Close(delete_from_store);
    router_->Forget(session_);
    return s;
  }
  absl::Status BeginStep(bool prefill, int n, int question_tokens) override {
    return inner_->BeginStep(prefill, n, question_tokens);
  }
  absl::Status AttendLayer(int layer, int pos0, int n, const float* q, const float* k,
                           const float* v, float* out) override {
    return inner_->AttendLayer(layer, pos0, n, q, k, v, out);
  }
  bool WantsNextLayerQuery() const override { return inner_->WantsNextLayerQuery(); }
  absl::Status NextLayerQuery(int layer, int pos0, int n, const float* q_next) override {
    return inner_->NextLayerQuery(layer, pos0, n, q_next);
  }
  absl::Status EndStep() override { return inner_->EndStep(); }

  // A store replica that died makes EndRound fail UNAVAILABLE until the
  // controller declares it dead and the worker writes to its replacement;
  // the round is still open on the worker, so EndRound is simply retried
  // while the worker itself answers.
  absl::Status EndRound() override {
    const absl::Time until = absl::Now() + store_failover_;
    absl::Duration backoff = absl::Milliseconds(200);
    for (;;) {
      absl::Status s = inner_->EndRound();
      if (s.ok() || !WorkerFailoverCandidate(s) || absl::Now() + backoff > until ||
          !router_->Answers(route_.worker_address(), absl::Seconds(1))) {
        return s;
      }
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, absl::Seconds(2));
    }
  }

  absl::StatusOr<uint32_t> Recover(uint32_t round, const absl::Status& failure) override {
    // NOT_FOUND from the worker of an open session: it restarted and lost
    // the session (a restart on the same address); resume it there.
    if (!WorkerFailoverCandidate(failure) && !absl::IsNotFound(failure)) return failure;
    const absl::Time t0 = absl::Now();
    Failover f;
    f.round = round;
    f.failure = failure.ToString();
    // With disaggregation the session may have been on its decode worker:
    // when that one is gone, the decode steps move (to another decode-role
    // worker, or to the session's own worker) and the session resumes on its
    // worker from the store.
    const bool decode_gone = !route_.decode_worker_address().empty() &&
                             !router_->Answers(route_.decode_worker_address(), absl::Seconds(1));
    f.from = decode_gone ? route_.decode_worker_node_id() : route_.worker_node_id();
    inner_->Abandon();
    std::vector<TierRound> history = inner_->rounds();
    // Until a resume works or store_failover_ is spent: a store that stopped
    // answering fails the resume until the controller has replaced it.
    const absl::Time until = t0 + store_failover_;
    absl::Duration backoff = absl::Milliseconds(200);
    absl::Status s;
    for (;;) {
      if (router_->Answers(route_.worker_address(), absl::Seconds(1))) {
        // The worker lives (a stream broke, or a step outlived its
        // deadline): drop its copy of the session and resume it there, with
        // the replicas the controller names now.
        CloseOnRouteWorker();
        KVT_ASSIGN_OR_RETURN(route_, decode_gone ? router_->FailoverDecode(session_, route_)
                                                 : router_->Refresh(session_));
      } else {
        KVT_ASSIGN_OR_RETURN(route_, router_->Failover(session_, route_));
      }
      // The open round was never acknowledged: whatever of it reached the
      // store goes, and it is sent again.
      s = OpenOn(/*resume=*/true, round);
      if (absl::IsAlreadyExists(s)) {
        // That worker still holds an older copy (it had the session before).
        CloseOnRouteWorker();
        s = OpenOn(/*resume=*/true, round);
      }
      if (s.ok() || !WorkerFailoverCandidate(s) || absl::Now() + backoff > until) break;
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, absl::Seconds(2));
    }
    uint32_t next = 0;
    if (absl::IsNotFound(s) && round == 0) {
      s = OpenOn(/*resume=*/false);  // Nothing stored yet: round 0 was open.
    } else if (s.ok()) {
      next = inner_->next_round();
    }
    if (!s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("failover after ", failure.ToString(), ": ", s.message()));
    }
    if (next != round) {
      return absl::DataLossError(absl::StrCat("the store resumes session ", session_, " at round ",
                                              next, ", but round ", round, " was open"));
    }
    history.resize(std::min<size_t>(history.size(), next));
    inner_->set_rounds(std::move(history));
    f.to = decode_gone && !route_.decode_worker_node_id().empty() ? route_.decode_worker_node_id()
                                                                  : route_.worker_node_id();
    f.recover_ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
    failovers_.push_back(f);
    return next;
  }

 private:
  // Closes the session (keeping its rounds) on the worker route_ names now,
  // and on its decode worker, which holds it between a hand-off and the
  // hand-back (NOT_FOUND where it is not).
  void CloseOnRouteWorker() {
    for (const std::string& w : {route_.worker_address(), route_.decode_worker_address()}) {
      if (w.empty() || (w != route_.worker_address() && !router_->Answers(w, absl::Seconds(1)))) {
        continue;
      }
      Tier(spec_, router_->Channel(w), session_, token_, deadlines_, nullptr)
          .Close(/*delete_from_store=*/false)
          .IgnoreError();
    }
  }

  absl::Status OpenOn(bool resume, std::optional<uint32_t> at = std::nullopt) {
    auto t = std::make_unique<Tier>(spec_, router_->Channel(route_.worker_address()), session_,
                                    token_, deadlines_, nullptr);
    if (!route_.decode_worker_address().empty()) {
      // Decode-role workers are live: each round's prefill hands the session
      // to the one the controller names, which decodes and hands it back.
      Disaggregation pd;
      pd.decode_channel = router_->Channel(route_.decode_worker_address());
      pd.prefill_target = route_.worker_address();
      pd.decode_target = route_.decode_worker_address();
      t->Disaggregate(pd);
    }
    std::vector<std::string> stores(route_.store_addresses().begin(),
                                    route_.store_addresses().end());
    v1::Policy policy = policy_;
    if (!skew_.empty()) {
      // Every worker that runs a step of the session holds the skew (an
      // upload of bytes it holds already is a no-op there).
      for (const std::string& w : {route_.worker_address(), route_.decode_worker_address()}) {
        if (w.empty()) continue;
        auto up = UploadSkew(router_->Channel(w), skew_, token_, deadlines_.call);
        if (!up.ok()) {
          return absl::Status(up.status().code(),
                              absl::StrCat(up.status().message(), " (worker ", w, ")"));
        }
        policy.set_speculation_skew(up->skew_id());
      }
    }
    absl::Status s = t->Open(policy, stores, resume, at);
    if (!s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat(s.message(), " (worker ", route_.worker_node_id(), ")"));
    }
    inner_ = std::move(t);
    return absl::OkStatus();
  }

  const v1::ModelSpec spec_;
  SessionRouter* const router_;
  const std::string session_;
  const v1::Policy policy_;
  const std::string token_;
  const TierDeadlines deadlines_;
  const absl::Duration store_failover_;
  v1::RouteResponse route_;
  std::unique_ptr<Tier> inner_;
  const std::string skew_;  // Skew file bytes; empty: no upload.
  std::vector<Failover> failovers_;
};

}  // namespace

std::unique_ptr<ConversationBackend> LocalBackend(const model::ModelConfig& c) {
  return std::make_unique<Local>(c);
}

absl::StatusOr<std::unique_ptr<TierSession>> TierBackend(
    const v1::ModelSpec& spec, std::shared_ptr<grpc::Channel> channel, const std::string& session,
    const v1::Policy& policy, const std::string& token, const TierDeadlines& deadlines,
    DecodeMux* decode, const Disaggregation* pd) {
  auto t = std::make_unique<Tier>(spec, std::move(channel), session, token, deadlines, decode);
  if (pd != nullptr) t->Disaggregate(*pd);
  KVT_RETURN_IF_ERROR(t->Open(policy));
  return std::unique_ptr<TierSession>(std::move(t));
}

TierRound RoundReport(const v1::EndRoundResponse& end, const v1::RecallDecision* recall,
                      double prefill_ms) {
  TierRound t;
  t.round = end.round();
  if (recall != nullptr) {
    t.recalled = true;
    t.selected.assign(recall->selected_rounds().begin(), recall->selected_rounds().end());
    t.scores.assign(recall->round_scores().begin(), recall->round_scores().end());
    t.bytes_fetched = recall->bytes_fetched();
    t.fetched_segments = recall->fetched_segments();
    t.fetch_ms = recall->fetch_ms();
    t.exposed_ms = recall->exposed_ms();
  }
  t.stored_bytes = end.stored_bytes();
  t.round_working_set_bytes = end.round_working_set_bytes();
  t.full_cache_bytes = end.full_cache_bytes();
  t.working_set_after = end.working_set_bytes();
  t.worker_memory = end.worker_memory();
  t.speculation.assign(end.speculation().begin(), end.speculation().end());
  t.pool = end.speculation_pool();
  t.prefill_ms = prefill_ms;
  return t;
}

absl::StatusOr<std::unique_ptr<ClusterSession>> ClusterBackend(
    const v1::ModelSpec& spec, SessionRouter* router, const std::string& session,
    const v1::Policy& policy, const std::string& token, const TierDeadlines& deadlines,
    absl::Duration store_failover, const std::string& skew) {
  auto c = std::make_unique<Cluster>(spec, router, session, policy, token, deadlines,
                                     store_failover, skew);
  KVT_RETURN_IF_ERROR(c->Open());
  return std::unique_ptr<ClusterSession>(std::move(c));
}

v1::ModelSpec SpecOf(const model::ModelConfig& c) {
  v1::ModelSpec spec;
  spec.set_num_layers(c.n_layers);
  spec.set_num_q_heads(c.n_heads);
  spec.set_num_kv_heads(c.n_kv_heads);
  spec.set_head_dim(c.head_dim());
  spec.set_dtype(v1::DTYPE_FP32);
  spec.set_rope_theta(c.rope_theta);
  if (c.sliding()) {
    for (int l = 0; l < c.n_layers; ++l) spec.add_layer_window(c.layer_window(l));
  }
  spec.set_model_digest(c.digest);
  return spec;
}

}  // namespace kvtier::refengine
