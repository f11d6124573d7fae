#include "refengine/inproc.h"

#include <chrono>
#include <optional>
#include <utility>
#include <vector>

#include "base/status_macros.h"
#include "encoded/encode.h"
#include "rpc/policy_proto.h"

namespace kvtier::refengine {
namespace {

class InProcess : public TierSession {
 public:
  InProcess(worker::Engine* engine, worker::SessionKey key, const worker::ModelShape& shape,
            v1::Policy effective)
      : engine_(engine), key_(std::move(key)), shape_(shape), effective_(std::move(effective)) {}

  const std::vector<TierRound>& rounds() const override { return rounds_; }
  const v1::Policy& effective_policy() const override { return effective_; }
  bool on_device() const override { return on_device_; }
  void set_on_device(bool b) { on_device_ = b; }
  bool speculation_on_device() const override { return spec_on_device_; }
  void set_speculation_on_device(bool b) { spec_on_device_ = b; }

  bool WantsNextLayerQuery() const override { return !effective_.speculation_skew().empty(); }
  absl::Status NextLayerQuery(int layer, int pos0, int n, const float* q_next) override {
    (void)pos0;
    if (n == 1) {
      q_next_.assign(q_next, q_next + static_cast<size_t>(shape_.q_heads) * shape_.head_dim);
      q_next_layer_ = layer;
    }
    return absl::OkStatus();
  }

  absl::Status BeginStep(bool prefill, int n, int question_tokens) override {
    (void)n;
    prefill_ = prefill;
    question_ = question_tokens;
    if (prefill) step_start_ = std::chrono::steady_clock::now();
    return absl::OkStatus();
  }

  absl::Status AttendLayer(int layer, int pos0, int n, const float* q, const float* k,
                           const float* v, float* out) override {
    (void)pos0;
    if (prefill_) {
      KVT_ASSIGN_OR_RETURN(std::optional<worker::RecallReport> r,
                           engine_->PrefillLayer(key_, layer, n, question_, q, k, v, out));
      if (r.has_value()) recall_ = RecallToProto(*r);
      return absl::OkStatus();
    }
    const float* qn = q_next_layer_ == layer ? q_next_.data() : nullptr;
    q_next_layer_ = -1;
    return engine_->DecodeLayer(key_, layer, q, k, v, out, qn);
  }

  absl::Status EndStep() override {
    if (prefill_ && !has_prefill_ms_) {
      prefill_ms_ =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - step_start_)
              .count();
      has_prefill_ms_ = true;
    }
    return absl::OkStatus();
  }

  absl::Status EndRound() override {
    KVT_ASSIGN_OR_RETURN(worker::EndRoundReport r, engine_->EndRound(key_));
    TierRound t =
        RoundReport(EndRoundToProto(r), recall_.has_value() ? &*recall_ : nullptr, prefill_ms_);
    has_prefill_ms_ = false;
    recall_.reset();
    rounds_.push_back(std::move(t));
    return absl::OkStatus();
  }

  absl::Status Close(bool delete_from_store) override {
    return engine_->CloseSession(key_, delete_from_store);
  }

 private:
  worker::Engine* const engine_;
  const worker::SessionKey key_;
  const worker::ModelShape shape_;
  const v1::Policy effective_;
  bool on_device_ = false;
  bool spec_on_device_ = false;
  bool prefill_ = false;
  int question_ = 0;
  std::optional<v1::RecallDecision> recall_;  // Of the round's first prefill.
  std::chrono::steady_clock::time_point step_start_;
  double prefill_ms_ = 0;
  bool has_prefill_ms_ = false;
  std::vector<float> q_next_;
  int q_next_layer_ = -1;
  std::vector<TierRound> rounds_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<TierSession>> InProcessBackend(worker::Engine* engine,
                                                              const v1::ModelSpec& spec,
                                                              const std::string& session,
                                                              const v1::Policy& policy) {
  KVT_ASSIGN_OR_RETURN(worker::ModelShape shape, ShapeFromProto(spec));
  KVT_ASSIGN_OR_RETURN(worker::SessionPolicy p, PolicyFromProto(policy, FromProto(spec.dtype())));
  worker::SessionKey key(session);
  KVT_RETURN_IF_ERROR(engine->OpenSession(key, shape, p));
  KVT_ASSIGN_OR_RETURN(worker::SessionStats st, engine->Stats(key));
  auto s = std::make_unique<InProcess>(engine, key, shape, EffectivePolicy(policy, st.policy));
  s->set_on_device(st.on_device);
  s->set_speculation_on_device(st.speculation_on_device);
  return std::unique_ptr<TierSession>(std::move(s));
}

}  // namespace kvtier::refengine
