#include "services/worker/controller_policies.h"

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "encoded/encode.h"
#include "rpc/policy_proto.h"

namespace kvtier {
namespace {

// Each GetPolicy of a pass gets this long; a pass is background work.
constexpr absl::Duration kPassCallDeadline = absl::Seconds(2);

}  // namespace

ControllerPolicies::ControllerPolicies(std::shared_ptr<ControllerClient> controller,
                                       worker::Engine* engine, Executor* io)
    : controller_(std::move(controller)), engine_(engine), io_(io) {}

ControllerPolicies::~ControllerPolicies() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](bool* running) { return !*running; }, &pass_running_));
}

absl::StatusOr<std::optional<v1::GetPolicyResponse>> ControllerPolicies::ForOpen(
    const worker::SessionKey& id, const v1::ModelSpec& model, const CallOptions& call) {
  v1::GetPolicyRequest req;
  req.set_session_id(id.session);
  *req.mutable_model() = model;
  CallOptions c = call;
  c.tenant = id.tenant;  // The end tenant's session (a node token acts for it).
  absl::StatusOr<v1::GetPolicyResponse> r = controller_->GetPolicy(req, c);
  if (absl::IsNotFound(r.status())) return std::nullopt;
  if (!r.ok()) {
    return absl::Status(r.status().code(),
                        absl::StrCat("the session opened without a Policy, and kvtier-controller "
                                     "could not give its model's: ",
                                     r.status().message()));
  }
  absl::StatusOr<worker::SessionPolicy> p = PolicyFromAnswer(*r, FromProto(model.dtype()));
  if (!p.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("kvtier-controller's policy for model '",
                                                   model.name(), "': ", p.status().message()));
  }
  return std::optional<v1::GetPolicyResponse>(*std::move(r));
}

void ControllerPolicies::Follow(const worker::SessionKey& id, const v1::ModelSpec& model) {
  absl::MutexLock lock(&mu_);
  SetTightenedLocked(id, false);
  followed_[id] = Followed{model, false};
}

void ControllerPolicies::Forget(const worker::SessionKey& id) {
  absl::MutexLock lock(&mu_);
  SetTightenedLocked(id, false);
  followed_.erase(id);
}

void ControllerPolicies::SetTightenedLocked(const worker::SessionKey& id, bool tightened) {
  auto f = followed_.find(id);
  if (f == followed_.end() || f->second.tightened == tightened) return;
  f->second.tightened = tightened;
  if (tightened) {
    ++tightened_now_;
  } else {
    --tightened_now_;
  }
}

void ControllerPolicies::OnHeartbeat(const v1::HeartbeatResponse& hb) {
  const v1::PressureLevel level = hb.pressure();
  const int64_t cold = static_cast<int64_t>(hb.cold_idle_ms());
  {
    absl::MutexLock lock(&mu_);
    if (pass_running_ || followed_.empty()) return;
    const bool pressed = level == v1::PRESSURE_MODERATE || level == v1::PRESSURE_HIGH;
    if (!pressed && tightened_now_ == 0) return;
    pass_running_ = true;
  }
  io_->Schedule([this, level, cold] { Pass(level, cold); });
}

void ControllerPolicies::Pass(v1::PressureLevel level, int64_t cold_idle_ms) {
  const bool pressed = level == v1::PRESSURE_MODERATE || level == v1::PRESSURE_HIGH;
  std::map<worker::SessionKey, Followed> followed;
  std::string node_id;
  {
    absl::MutexLock lock(&mu_);
    followed = followed_;
    node_id = node_id_;
  }
  for (const auto& [id, idle] : engine_->Sessions()) {
    auto it = followed.find(id);
    if (it == followed.end()) continue;
    const bool cold = cold_idle_ms > 0 && idle >= cold_idle_ms;
    // Under pressure: cold sessions not yet tightened. Without: tightened
    // ones go back. A tightened session that became active again stays
    // tight until the pressure is gone (its rounds were stored that way).
    const bool ask = pressed ? (cold && !it->second.tightened) : it->second.tightened;
    if (!ask) continue;
    v1::GetPolicyRequest req;
    req.set_session_id(id.session);
    *req.mutable_model() = it->second.model;
    req.set_idle_ms(static_cast<uint64_t>(pressed ? idle : 0));
    req.set_node_id(node_id);
    CallOptions call = CallOptions::Within(kPassCallDeadline);
    call.tenant = id.tenant;
    absl::StatusOr<v1::GetPolicyResponse> r = controller_->GetPolicy(req, call);
    if (!r.ok()) {
      LogWarn("GetPolicy for a session under memory pressure failed",
              {{"session", id.ToString()}, {"error", r.status().ToString()}});
      continue;
    }
    if (r->tightened() == it->second.tightened) continue;
    absl::StatusOr<worker::SessionPolicy> p =
        PolicyFromAnswer(*r, FromProto(it->second.model.dtype()));
    absl::Status st = p.ok() ? engine_->UpdatePolicy(id, *std::move(p)) : p.status();
    if (absl::IsNotFound(st)) {
      Forget(id);
      continue;
    }
    if (!st.ok()) {
      LogWarn("cannot apply the controller's policy to a session",
              {{"session", id.ToString()}, {"error", st.ToString()}});
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      SetTightenedLocked(id, r->tightened());
    }
    (r->tightened() ? tightened_ : restored_).fetch_add(1);
    LogInfo(r->tightened() ? "cold session's policy tightened under memory pressure"
                           : "session's registered policy restored",
            {{"session", id.ToString()},
             {"idle_ms", idle},
             {"codec", v1::Codec_Name(r->policy().codec())},
             {"bits", r->policy().codec_params().bits()},
             {"budget_tokens", r->policy().budget_tokens()}});
  }
  absl::MutexLock lock(&mu_);
  pass_running_ = false;
}

}  // namespace kvtier
