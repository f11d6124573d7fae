#include "worker/engine.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/log.h"
#include "base/names.h"
#include "base/status_macros.h"
#include "kernels/crc32c.h"
#include "worker/device/attention.h"
#include "worker/session.h"

namespace kvtier::worker {

CodecConfig SessionPolicy::RawFp32Codec() {
  CodecConfig c;
  c.codec = Codec::kRaw;
  c.dtype = DType::kFp32;
  return c;
}

evict::Policy SessionPolicy::NoEviction() {
  evict::Policy p;
  p.method = evict::Method::kNone;
  return p;
}

Engine::Engine(SegmentStore* store, EngineOptions options)
    : store_(store),
      options_(options),
      handoff_(std::make_unique<HandoffCache>(options.handoff_cache_bytes, options.clock)),
      own_skews_(options.skews == nullptr ? std::make_unique<SkewRegistry>() : nullptr),
      skews_(options.skews != nullptr ? options.skews : own_skews_.get()),
      fetch_executor_(options.fetch_executor) {
  if (fetch_executor_ == nullptr) {
    own_fetch_executor_ = std::make_unique<Executor>(std::max(1, options_.fetch_threads));
    fetch_executor_ = own_fetch_executor_.get();
  }
}

Engine::~Engine() {
  absl::MutexLock lock(&fetches_mu_);
  fetches_mu_.Await(absl::Condition(
      +[](int* n) { return *n == 0; }, &fetches_in_flight_));
}

absl::Status ValidateRoundPolicy(const ModelShape& shape, const SessionPolicy& policy) {
  KVT_RETURN_IF_ERROR(ValidateCodecConfig(policy.codec));
  // On a sliding model speculation runs at the global layers only
  // (DecodeLayer); a sliding layer attends over the positions inside its
  // window, which a round that lost tokens to the speculation pool no longer
  // records. (Eviction spares sliding layers: EndRound.)
  if (shape.sliding() && policy.speculation.pool_bytes > 0) {
    return absl::InvalidArgumentError(
        "speculation_pool_bytes is not supported on a model with sliding-window layers: the "
        "pool drops tokens from rounds, and a sliding layer needs every token's position; "
        "speculate without a pool (0)");
  }
  if (policy.eviction.method != evict::Method::kNone) {
    // What the budget must exceed: StreamingLLM's sinks, SnapKV-family's
    // observation window; H2O reads no window (as ParsePolicy validates).
    const evict::Method m = policy.eviction.method;
    KVT_RETURN_IF_ERROR(evict::ValidateBudget(
        policy.eviction.budget, m == evict::Method::kStreaming ? policy.eviction.sinks
                                : m == evict::Method::kH2o     ? 0
                                                               : policy.eviction.score.window));
    if (policy.eviction.method == evict::Method::kProfile &&
        static_cast<int>(policy.eviction.layer_budgets.size()) != shape.layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer profile has ", policy.eviction.layer_budgets.size(),
                       " budgets for a ", shape.layers, "-layer model"));
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::ResolveSpeculation(const ModelShape& shape, const SessionPolicy& policy,
                                        bool on_device,
                                        std::shared_ptr<const spec::SkewModel>* skew) const {
  skew->reset();
  const SessionPolicy::Speculation& sp = policy.speculation;
  if (sp.pool_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("speculation pool cap ", sp.pool_bytes, " must be 0 (none) or more bytes"));
  }
  if (sp.pool_low_bytes < 0 || sp.pool_low_bytes > sp.pool_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("speculation pool low mark ", sp.pool_low_bytes,
                                                   " must be 0 (the cap) or between 1 and ",
                                                   "the pool cap (", sp.pool_bytes, " bytes)"));
  }
  if (sp.skew.empty()) {
    if (sp.pool_bytes > 0) {
      return absl::InvalidArgumentError(
          "a speculation pool cap needs speculation (a skew): the pool evicts by speculation's "
          "fetch counts");
    }
    return absl::OkStatus();
  }
  if (!(sp.alpha > 0) || !std::isfinite(sp.alpha)) {
    return absl::InvalidArgumentError(
        absl::StrCat("speculation alpha ", sp.alpha, " must be a finite number above 0"));
  }
  if (sp.budget < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("speculation budget ", sp.budget, " must be 0 (none) or more"));
  }
  if (on_device) {
    return absl::FailedPreconditionError(
        "this session's past rounds are in device memory; speculation keeps them in the host "
        "pool and speculates on the GPU: open the session with speculation on");
  }
  *skew = skews_->Find(sp.skew);
  if (*skew == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "unknown skew ", sp.skew, ": upload the skew file to this worker first (PutSkew)"));
  }
  const spec::SkewModel& m = **skew;
  if (m.layers != shape.layers || m.q_heads != shape.q_heads || m.kv_heads != shape.kv_heads ||
      m.head_dim != shape.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "skew ", sp.skew, " (", m.model, ") is for ", m.layers, " layers, ", m.q_heads,
        " q heads, ", m.kv_heads, " kv heads, head_dim ", m.head_dim, "; the session's model has ",
        shape.layers, ", ", shape.q_heads, ", ", shape.kv_heads, ", ", shape.head_dim));
  }
  return absl::OkStatus();
}

absl::Status Engine::AttachSpeculator(Session& s) const {
  s.mu.AssertHeld();
  KVT_RETURN_IF_ERROR(DeviceStatus());  // No device: speculation runs on the CPU.
  auto sd = NewDeviceSpeculator(s.shape.layers, s.shape.q_heads, s.shape.kv_heads, s.shape.head_dim,
                                s.skew->partial_columns());
  if (!sd.ok()) {
    LogWarn("speculation stays on the CPU",
            {{"session", s.key.ToString()}, {"error", sd.status().ToString()}});
    return sd.status();
  }
  s.spec_device = std::move(*sd);
  s.stats.speculation_on_device = true;
  return absl::OkStatus();
}

absl::Status Engine::UpdatePolicy(const SessionKey& id, SessionPolicy policy) {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Find(id));
  KVT_RETURN_IF_ERROR(ValidateRoundPolicy(s->shape, policy));
  absl::MutexLock lock(&s->mu);
  if (s->device != nullptr) KVT_RETURN_IF_ERROR(DeviceSupportsCodec(policy.codec));
  std::shared_ptr<const spec::SkewModel> skew;
  KVT_RETURN_IF_ERROR(ResolveSpeculation(s->shape, policy, s->device != nullptr, &skew));
  policy.watershed_layer = s->lw;
  s->policy = std::move(policy);
  const bool same_shape = s->skew != nullptr && skew != nullptr &&
                          s->skew->partial_columns() == skew->partial_columns();
  s->skew = std::move(skew);
  s->gather = Session::Gather();
  if (s->skew == nullptr) {
    s->spec_device.reset();
  } else if (s->spec_device == nullptr || !same_shape) {
    s->spec_device.reset();
    if (s->device == nullptr && options_.placement != EngineOptions::Placement::kHost) {
      (void)AttachSpeculator(*s);  // Without a device it speculates on the CPU.
    }
  }
  s->stats.speculation_on_device = s->spec_device != nullptr;
  return absl::OkStatus();
}

std::vector<Engine::SessionEntry> Engine::Sessions() const {
  std::vector<SessionEntry> out;
  const int64_t now = options_.clock->NowUnixMs();
  absl::MutexLock lock(&mu_);
  for (const auto& [key, s] : sessions_) {
    out.push_back({key, std::max<int64_t>(0, now - s->last_active_ms.load())});
  }
  return out;
}

absl::StatusOr<std::shared_ptr<Engine::Session>> Engine::CreateSession(
    const SessionKey& id, const ModelShape& shape, const SessionPolicy& policy) {
  return CreateSession(id, shape, policy, /*allow_device=*/true);
}

absl::Status CheckShape(const ModelShape& shape) {
  if (shape.layers < 1 || shape.q_heads < 1 || shape.kv_heads < 1 ||
      shape.q_heads % shape.kv_heads != 0 || shape.head_dim < 1 || shape.head_dim > 1024 ||
      shape.dtype_bytes() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad model shape: layers ", shape.layers, ", q_heads ", shape.q_heads,
                     ", kv_heads ", shape.kv_heads, " (must divide q_heads), head_dim ",
                     shape.head_dim, ", dtype fp16, bf16 or fp32"));
  }
  if (!shape.window.empty() && static_cast<int>(shape.window.size()) != shape.layers) {
    return absl::InvalidArgumentError(absl::StrCat("bad model shape: ", shape.window.size(),
                                                   " layer windows for ", shape.layers, " layers"));
  }
  for (int w : shape.window) {
    if (w < 0) return absl::InvalidArgumentError("bad model shape: a negative layer window");
  }
  return absl::OkStatus();
}

absl::StatusOr<int> WatershedLayer(const ModelShape& shape, const SessionPolicy& policy) {
  const int lw = policy.watershed_layer >= 0 ? policy.watershed_layer : shape.layers / 3;
  if (lw >= shape.layers || (shape.layers > 1 && lw == shape.layers - 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "watershed layer ", lw, " must be below the last layer (", shape.layers, " layers)"));
  }
  return lw;
}

bool Engine::TriesDevice(const SessionPolicy& policy) const {
  return options_.placement != EngineOptions::Placement::kHost && policy.speculation.skew.empty();
}

absl::Status Engine::DeviceReads(const SessionPolicy& policy) {
  KVT_RETURN_IF_ERROR(DeviceStatus());
  return DeviceSupportsCodec(policy.codec);
}

absl::StatusOr<std::shared_ptr<Engine::Session>> Engine::CreateSession(
    const SessionKey& id, const ModelShape& shape, const SessionPolicy& policy, bool allow_device,
    std::unique_ptr<DeviceSession> prepared) {
  KVT_RETURN_IF_ERROR(ValidateName("session_id", id.session));
  if (!id.tenant.empty()) KVT_RETURN_IF_ERROR(ValidateName("tenant", id.tenant));
  KVT_RETURN_IF_ERROR(CheckShape(shape));
  KVT_ASSIGN_OR_RETURN(const int lw, WatershedLayer(shape, policy));
  KVT_RETURN_IF_ERROR(ValidateRoundPolicy(shape, policy));
  if (const size_t n = RoundLayout(shape, lw).size(); n > kMaxRoundSegments) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the model's sliding and global layers alternate so often that a round would be ", n,
        " segments (watershed layer ", lw, "); the store takes at most ", kMaxRoundSegments));
  }
  auto s = std::make_shared<Session>(id, shape, policy, lw, options_.clock);
  {
    absl::MutexLock lock(&s->mu);
    std::random_device rd;
    do {
      s->incarnation = (uint64_t{rd()} << 32) | rd();
    } while (s->incarnation == 0);
    s->open.resize(shape.layers);
    using Placement = EngineOptions::Placement;
    // A speculating session keeps its past rounds in the host pool; the GPU,
    // if any, speculates and attends over what it gathers (below).
    // Sliding-window layers attend on the host (the device kernels attend
    // over whole rounds).
    const bool tries_device = allow_device && TriesDevice(policy) && !shape.sliding();
    if (shape.sliding() && allow_device && options_.placement == Placement::kDevice) {
      return absl::FailedPreconditionError(
          absl::StrCat("session ", id.ToString(),
                       " cannot have a device working set: its model has sliding-window layers, "
                       "which attend on the host"));
    }
    if (tries_device && prepared != nullptr) {
      s->device = std::move(prepared);
      s->stats.on_device = true;
    } else if (tries_device) {
      absl::Status why = DeviceReads(policy);
      if (why.ok()) {
        auto dev = NewDeviceSession(shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim);
        if (dev.ok()) {
          s->device = std::move(*dev);
          s->stats.on_device = true;
        } else {
          why = dev.status();  // kAuto falls back to host memory.
          LogWarn("device working set unavailable",
                  {{"session", id.ToString()}, {"error", why.ToString()}});
        }
      }
      if (!why.ok() && options_.placement == Placement::kDevice) {
        return absl::FailedPreconditionError(absl::StrCat(
            "session ", id.ToString(), " cannot have a device working set: ", why.message()));
      }
    }
    KVT_RETURN_IF_ERROR(ResolveSpeculation(shape, policy, s->device != nullptr, &s->skew));
    if (s->skew != nullptr && options_.placement != Placement::kHost && allow_device) {
      absl::Status why = AttachSpeculator(*s);
      if (!why.ok() && options_.placement == Placement::kDevice) {
        return absl::FailedPreconditionError(absl::StrCat(
            "session ", id.ToString(), " cannot speculate on a device: ", why.message()));
      }
    }
  }
  return s;
}

absl::Status Engine::CheckRoomLocked(const SessionKey& id) const {
  if (sessions_.count(id) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("session ", id.ToString(), " already exists"));
  }
  if (options_.max_sessions > 0 && static_cast<int>(sessions_.size()) >= options_.max_sessions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the worker holds its maximum of ", options_.max_sessions,
                     " sessions (--max_sessions); close one first"));
  }
  const EngineOptions::TenantLimit* l = LimitFor(id.tenant);
  if (l != nullptr && l->max_sessions > 0) {
    auto use = tenants_.find(id.tenant);
    if (use != tenants_.end() && use->second.sessions >= l->max_sessions) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "tenant '", id.tenant, "' holds its maximum of ", l->max_sessions,
          " sessions (its max_sessions in the tenants file, or --tenant_max_sessions); close one "
          "first"));
    }
  }
  return absl::OkStatus();
}

const EngineOptions::TenantLimit* Engine::LimitFor(const std::string& tenant) const {
  auto l = options_.tenant_limits.find(tenant);
  if (l != options_.tenant_limits.end()) return &l->second;
  const EngineOptions::TenantLimit& d = options_.default_tenant_limit;
  return d.max_sessions > 0 || d.max_working_set_bytes > 0 ? &d : nullptr;
}

Engine::TenantUse& Engine::UseOf(const std::string& tenant) {
  TenantUse& use = tenants_[tenant];
  if (use.limit == nullptr) use.limit = LimitFor(tenant);
  return use;
}

absl::Status Engine::IncomingHold::Grow(uint64_t bytes) {
  auto* use = static_cast<TenantUse*>(use_);
  KVT_RETURN_IF_ERROR(engine_->CheckBudgetFor(tenant_, use->limit, use->bytes.load(), bytes));
  use->bytes.fetch_add(static_cast<int64_t>(bytes));
  engine_->working_set_total_.fetch_add(static_cast<int64_t>(bytes));
  bytes_ += bytes;
  return absl::OkStatus();
}

Engine::IncomingHold::~IncomingHold() {
  static_cast<TenantUse*>(use_)->bytes.fetch_sub(static_cast<int64_t>(bytes_));
  engine_->working_set_total_.fetch_sub(static_cast<int64_t>(bytes_));
}

absl::Status Engine::Insert(const SessionKey& id, std::shared_ptr<Session> s) {
  absl::MutexLock lock(&mu_);
  KVT_RETURN_IF_ERROR(CheckRoomLocked(id));
  TenantUse& use = UseOf(id.tenant);
  ++use.sessions;
  s->tenant = &use;
  sessions_.emplace(id, std::move(s));
  return absl::OkStatus();
}

absl::Status Engine::OpenSession(const SessionKey& id, const ModelShape& shape,
                                 const SessionPolicy& policy) {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, CreateSession(id, shape, policy));
  KVT_RETURN_IF_ERROR(Insert(id, std::move(s)));
  handoff_->Erase(id);  // Rounds of an earlier life of the name.
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> Engine::ResumeSession(const SessionKey& id, const ModelShape& shape,
                                               const SessionPolicy& policy, const CallOptions& call,
                                               std::optional<uint32_t> at_round) {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, CreateSession(id, shape, policy));
  {
    absl::MutexLock lock(&mu_);
    if (sessions_.count(id) != 0) {
      return absl::AlreadyExistsError(absl::StrCat("session ", id.ToString(), " already exists"));
    }
  }
  // Everything is read before the session is visible: nobody can step it
  // half rebuilt.
  const CallOptions store_call = s->ForStore({StoreDeadline(call), {}});
  KVT_ASSIGN_OR_RETURN(std::vector<SegmentStore::StoredRound> stored,
                       store_->List(id.session, store_call));
  const int lw = s->lw;
  if (at_round.has_value()) {
    // The caller never saw these acknowledged: they go, and it sends the
    // first again.
    while (!stored.empty() && stored.back().round >= *at_round) {
      KVT_RETURN_IF_ERROR(store_->DropRound(id.session, stored.back().round, store_call));
      LogWarn("unacknowledged round dropped at resume",
              {{"session", id.ToString()}, {"round", stored.back().round}});
      stored.pop_back();
    }
    // Earlier rounds may be missing (dropped by the store under pressure);
    // the round before at_round may not.
    if (stored.empty() ? *at_round != 0 : stored.back().round + 1 != *at_round) {
      return absl::InvalidArgumentError(absl::StrCat("resume at round ", *at_round,
                                                     ": the store holds ", stored.size(),
                                                     " earlier rounds of session ", id.ToString()));
    }
  }
  // Each stored round against this session's layout (round_layout.h): a
  // segment of another index or layer range means another watershed layer
  // or model; a missing one is a round whose EndRound never finished when
  // it is the last (its worker died between the puts: never acknowledged,
  // so it goes and the engine sends it again), a sliding segment of a round
  // that left its window, or lost data.
  const std::vector<SegmentSpan> layout = RoundLayout(shape, lw);
  auto missing = [&](const SegmentStore::StoredRound& r) -> absl::StatusOr<uint64_t> {
    uint64_t absent = 0;
    for (const SegmentSpan& sp : layout) absent |= uint64_t{1} << sp.index;
    for (const SegmentStore::StoredSegment& g : r.segments) {
      if (g.segment >= layout.size() ||
          g.layer_begin != static_cast<uint32_t>(layout[g.segment].begin) ||
          g.layer_end != static_cast<uint32_t>(layout[g.segment].end)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "stored round ", r.round, " does not fit this policy: its segment ", g.segment,
            " covers layers [", g.layer_begin, ", ", g.layer_end, "), and with L_w = ", lw,
            " this model's rounds are ", layout.size(), " segments"));
      }
      absent &= ~(uint64_t{1} << g.segment);
    }
    return absent;
  };
  if (!at_round.has_value() && !stored.empty()) {
    KVT_ASSIGN_OR_RETURN(const uint64_t absent, missing(stored.back()));
    if (absent != 0) {
      const uint32_t half = stored.back().round;
      KVT_RETURN_IF_ERROR(store_->DropRound(id.session, half, store_call));
      stored.pop_back();
      LogWarn("half-stored last round dropped at resume",
              {{"session", id.ToString()}, {"round", half}});
    }
  }
  // K/V of another model never comes back: a round recorded under another
  // identity refuses the resume (identities unknown on either side pass).
  for (const SegmentStore::StoredRound& r : stored) {
    if (r.model != 0 && shape.model_digest != 0 && r.model != shape.model_digest) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "stored round %d of session %s holds K/V of model %016x; this session's model is "
          "%016x",
          r.round, id.ToString(), r.model, shape.model_digest));
    }
  }
  // Every round's stored lower segments, in one call.
  std::vector<SegmentStore::Segment> lower;
  std::vector<uint64_t> absent(stored.size());
  for (size_t i = 0; i < stored.size(); ++i) {
    KVT_ASSIGN_OR_RETURN(absent[i], missing(stored[i]));
    for (const SegmentSpan& sp : layout) {
      if ((absent[i] >> sp.index & 1) == 0) {
        if (!sp.upper) lower.push_back({stored[i].round, sp.index});
      } else if (!sp.windowed) {
        return absl::DataLossError(absl::StrCat("stored round ", stored[i].round, " of session ",
                                                id.ToString(), " lacks its segment ", sp.index,
                                                " (layers [", sp.begin, ", ", sp.end, "))"));
      }
    }
  }
  std::vector<std::string> payloads;
  if (!lower.empty()) {
    KVT_ASSIGN_OR_RETURN(payloads, store_->Get(id.session, lower, store_call));
  }
  {
    absl::MutexLock lock(&s->mu);
    size_t next = 0;  // Into lower and payloads.
    for (size_t i = 0; i < stored.size(); ++i) {
      Session::PastRound pr;
      pr.round = stored[i].round;
      pr.layers.resize(shape.layers);  // Upper layers stay in the store until recalled.
      for (; next < lower.size() && lower[next].round == pr.round; ++next) {
        const SegmentSpan& sp = layout[lower[next].segment];
        auto payload = std::make_shared<const std::string>(std::move(payloads[next]));
        pr.stored_bytes += payload->size();
        KVT_ASSIGN_OR_RETURN(auto layers, MakeLayers(std::move(payload), sp.layers(),
                                                     shape.kv_heads, shape.head_dim));
        for (int l = sp.begin; l < sp.end; ++l) {
          KVT_RETURN_IF_ERROR(s->Place(*layers[l - sp.begin], l));
          pr.layers[l] = std::move(layers[l - sp.begin]);
        }
      }
      // Layer 0 unless it slides and left (then L_w, which never does).
      const RoundLayer* counted =
          pr.layers[0] != nullptr ? pr.layers[0].get() : pr.layers[lw].get();
      for (const HeadKv& h : counted->heads) pr.tokens = std::max(pr.tokens, h.len);
      s->stats.full_cache_bytes += static_cast<uint64_t>(s->TokenBytes(pr.tokens));
      s->past.push_back(std::move(pr));
    }
    // Sliding segments not stored must be ones their rounds left; stored
    // ones that were left (a drop that failed) are dropped at the next
    // EndRound.
    s->pending_drops = s->MarkLeftWindows(s->PastTokens());
    for (size_t i = 0; i < stored.size(); ++i) {
      if (const uint64_t lost = absent[i] & ~s->past[i].left; lost != 0) {
        return absl::DataLossError(absl::StrCat(
            "stored round ", stored[i].round, " of session ", id.ToString(), " lacks segment ",
            std::countr_zero(lost), ", a sliding segment still inside its window"));
      }
      std::erase_if(s->pending_drops, [&](const SegmentStore::Segment& x) {
        return x.round == stored[i].round && (absent[i] >> x.segment & 1) != 0;
      });
    }
    s->stats.rounds = stored.empty() ? 0 : stored.back().round + 1;
    s->NotePeak();
  }
  KVT_RETURN_IF_ERROR(Insert(id, s));
  handoff_->Erase(id);  // Rounds of an earlier life of the session.
  absl::MutexLock lock(&s->mu);
  Account(*s);
  LogInfo("session resumed from the store",
          {{"session", id.ToString()}, {"rounds", stored.size()}, {"next_round", s->stats.rounds}});
  return static_cast<uint32_t>(s->stats.rounds);
}

void Engine::Account(Session& s) {
  s.mu.AssertHeld();
  const int64_t now = s.WorkingSetBytes();
  working_set_total_.fetch_add(now - s.accounted);
  s.tenant->bytes.fetch_add(now - s.accounted);
  s.accounted = now;
}

absl::Status Engine::CheckBudget(const Session& s, uint64_t bytes) const {
  return CheckBudgetFor(s.key.tenant, s.tenant->limit, s.tenant->bytes.load(), bytes);
}

absl::Status Engine::CheckBudgetFor(const std::string& tenant,
                                    const EngineOptions::TenantLimit* limit, int64_t tenant_bytes,
                                    uint64_t bytes) const {
  if (options_.max_working_set_bytes != 0) {
    const uint64_t total = static_cast<uint64_t>(std::max<int64_t>(0, working_set_total_.load()));
    if (total + bytes > options_.max_working_set_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the step needs ", bytes, " working-set bytes; the worker holds ", total,
                       " of its ", options_.max_working_set_bytes, " (--max_working_set_mb)"));
    }
  }
  if (limit != nullptr && limit->max_working_set_bytes != 0) {
    const uint64_t mine = static_cast<uint64_t>(std::max<int64_t>(0, tenant_bytes));
    if (mine + bytes > limit->max_working_set_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the step needs ", bytes, " working-set bytes; tenant '", tenant, "' holds ", mine,
          " of its ", limit->max_working_set_bytes,
          " (its max_working_set_mb in the tenants file, or --tenant_max_working_set_mb)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Engine::Session>> Engine::Find(const SessionKey& id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end())
    return absl::NotFoundError(absl::StrCat("unknown session ", id.ToString()));
  return it->second;
}

absl::StatusOr<std::optional<RecallReport>> Engine::PrefillLayer(const SessionKey& id, int layer,
                                                                 int64_t n, int64_t question_tokens,
                                                                 const Rows& q, const Rows& k,
                                                                 const Rows& v, float* out,
                                                                 const CallOptions& call) {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Find(id));
  // Layer L_w + 1 first waits for the recall fetch started at L_w, without
  // the session lock: Stats, other sessions' steps and CloseSession go on.
  std::shared_ptr<Fetch> fetch;
  {
    absl::MutexLock lock(&s->mu);
    KVT_RETURN_IF_ERROR(s->CheckStep(layer, n, /*prefill=*/true));
    if (layer == s->lw + 1 && s->recall == RecallState::kFetching) fetch = s->fetch;
  }
  bool arrived = true;
  double exposed_ms = 0;
  if (fetch != nullptr) {
    const auto wait_start = std::chrono::steady_clock::now();
    arrived = fetch->done.WaitForNotificationWithDeadline(StoreDeadline(call));
    exposed_ms = MsSince(wait_start);
  }
  absl::MutexLock lock(&s->mu);
  auto result = PrefillLocked(s.get(), layer, n, question_tokens, q, k, v, out, call, fetch,
                              arrived, exposed_ms);
  Account(*s);
  return result;
}

absl::StatusOr<std::optional<RecallReport>> Engine::PrefillLocked(
    Session* s, int layer, int64_t n, int64_t question_tokens, const Rows& q, const Rows& k,
    const Rows& v, float* out, const CallOptions& call, const std::shared_ptr<Fetch>& fetch,
    bool arrived, double exposed_ms) {
  s->mu.AssertHeld();
  KVT_RETURN_IF_ERROR(s->CheckStep(layer, n, /*prefill=*/true));
  KVT_RETURN_IF_ERROR(s->CheckValues(layer, n, q, k, v));
  if (layer == 0) KVT_RETURN_IF_ERROR(CheckBudget(*s, static_cast<uint64_t>(s->TokenBytes(n))));
  std::optional<RecallReport> report;
  if (fetch != nullptr) {
    if (s->fetch != fetch) {
      return absl::AbortedError("the step was abandoned while it waited for its recall");
    }
    KVT_ASSIGN_OR_RETURN(report, InstallFetch(*s, fetch, arrived, exposed_ms));
  }
  if (layer == 0) s->BeginStep(n, /*prefill=*/true);
  const int64_t base = s->tokens;
  const int64_t d = s->shape.head_dim, kv_count = n * s->shape.kv_heads * d;
  std::vector<float> qbuf, kbuf, vbuf;
  const float* qf = Fp32Rows(q, n * s->shape.q_heads * d, &qbuf);
  s->Append(layer, n, qf, k, v);
  // Recall at L_w, once per round, from the round's first prefill. It needs
  // only this layer's queries and keys, so the fetch starts before this
  // layer's attention and overlaps with it too.
  if (layer == s->lw && base == 0 && s->recall == RecallState::kNone) {
    if (!s->past.empty() && s->shape.layers > 1) {
      report = StartRecall(*s, n, question_tokens, qf, Fp32Rows(k, kv_count, &kbuf), call);
    } else {
      s->recall = RecallState::kReady;  // Nothing to recall.
      s->selected.clear();
    }
  }
  // The step's own K/V are read again in fp32 on the device path only (the
  // host path attends over the open round).
  const bool device = s->device != nullptr;
  KVT_RETURN_IF_ERROR(s->Attend(layer, n, qf, device ? Fp32Rows(k, kv_count, &kbuf) : nullptr,
                                device ? Fp32Rows(v, kv_count, &vbuf) : nullptr, out,
                                options_.level));
  s->EndLayer(n);
  return report;
}

absl::Status Engine::DecodeLayer(const SessionKey& id, int layer, const Rows& q, const Rows& k,
                                 const Rows& v, float* out, const Rows& q_next_rows) {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Find(id));
  absl::MutexLock lock(&s->mu);
  KVT_RETURN_IF_ERROR(s->CheckStep(layer, 1, /*prefill=*/false));
  KVT_RETURN_IF_ERROR(s->CheckValues(layer, 1, q, k, v));
  const int64_t d = s->shape.head_dim, kv_count = s->shape.kv_heads * d;
  std::vector<float> qbuf, kbuf, vbuf, qnbuf;
  // Layer + 1's tokens are speculated only when it is a global layer: a
  // sliding layer attends over its window, dense.
  const bool speculate = !q_next_rows.empty() && s->skew != nullptr &&
                         layer + 1 < s->shape.layers && s->shape.layer_window(layer + 1) == 0;
  const float* q_next = speculate ? Fp32Rows(q_next_rows, s->shape.q_heads * d, &qnbuf) : nullptr;
  if (speculate) {
    const int64_t count = int64_t{s->shape.q_heads} * s->shape.head_dim;
    for (int64_t i = 0; i < count; ++i) {
      if (!std::isfinite(q_next[i])) {
        return absl::InvalidArgumentError(
            absl::StrCat("layer ", layer, ": q_next[0, ", i / s->shape.head_dim, ", ",
                         i % s->shape.head_dim, "] is ", q_next[i], "; values must be finite"));
      }
    }
  }
  if (layer == 0) {
    KVT_RETURN_IF_ERROR(CheckBudget(*s, static_cast<uint64_t>(s->TokenBytes(1))));
    s->BeginStep(1, /*prefill=*/false);
  }
  const float* qf = Fp32Rows(q, s->shape.q_heads * d, &qbuf);
  s->Append(layer, 1, qf, k, v);
  absl::Status st;
  if (s->spec_device != nullptr) {
    // Attention on one GPU stream, layer + 1's selection on the other.
    st = s->DecodeOnDevice(layer, qf, out, q_next, options_.level);
  } else {
    const bool device = s->device != nullptr;
    st = s->Attend(layer, 1, qf, device ? Fp32Rows(k, kv_count, &kbuf) : nullptr,
                   device ? Fp32Rows(v, kv_count, &vbuf) : nullptr, out, options_.level);
    // Layer + 1's tokens are picked now, from its approximate query; its
    // attention reads what this gathers.
    if (st.ok() && speculate) s->Speculate(layer + 1, q_next, options_.level);
  }
  if (st.ok()) s->EndLayer(1);
  if (!st.ok() || layer + 1 == s->shape.layers) Account(*s);
  return st;
}

absl::Status Engine::AbortStep(const SessionKey& id) {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Find(id));
  absl::MutexLock lock(&s->mu);
  if (s->state == SessionState::kPrefill || s->state == SessionState::kDecode) s->RollBackStep();
  Account(*s);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Engine::Session>> Engine::Remove(const SessionKey& id) {
  std::shared_ptr<Session> s;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) {
      return absl::NotFoundError(absl::StrCat("unknown session ", id.ToString()));
    }
    s = it->second;
    sessions_.erase(it);
    --s->tenant->sessions;
  }
  absl::MutexLock lock(&s->mu);
  working_set_total_.fetch_sub(s->accounted);
  s->tenant->bytes.fetch_sub(s->accounted);
  s->accounted = 0;
  return s;
}

absl::Status Engine::CloseSession(const SessionKey& id, bool delete_from_store,
                                  const CallOptions& call) {
  // The session leaves the totals now, whatever the store says below.
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Remove(id));
  handoff_->Erase(id);
  const CallOptions store_call = s->ForStore({StoreDeadline(call), {}});
  if (delete_from_store) return store_->Delete(id.session, store_call);
  // The session's rounds stay in the store: their counters should be right.
  std::vector<uint32_t> rounds;
  {
    absl::MutexLock lock(&s->mu);
    rounds = s->unreported_recalls;
    rounds.insert(rounds.end(), s->round_resident.begin(), s->round_resident.end());
  }
  if (!rounds.empty()) {
    absl::Status st = store_->RecordRecalls(id.session, rounds, store_call);
    if (!st.ok()) {
      LogWarn("recall counters of a closed session not sent",
              {{"session", id.ToString()}, {"rounds", rounds.size()}, {"error", st.ToString()}});
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<SessionStats> Engine::Stats(const SessionKey& id) const {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Find(id));
  absl::MutexLock lock(&s->mu);
  SessionStats st = s->stats;
  st.working_set_bytes = static_cast<uint64_t>(s->WorkingSetBytes());
  st.device_bytes = s->DeviceBytes();
  st.full_cache_bytes += static_cast<uint64_t>(s->TokenBytes(s->tokens));
  st.policy = s->policy;
  st.policy.watershed_layer = s->lw;
  return st;
}

absl::StatusOr<ModelShape> Engine::Shape(const SessionKey& id) const {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Find(id));
  return s->shape;
}

Engine::Totals Engine::totals() const {
  Totals t;
  t.working_set_bytes = static_cast<uint64_t>(std::max<int64_t>(0, working_set_total_.load()));
  absl::MutexLock lock(&mu_);
  t.sessions = static_cast<int>(sessions_.size());
  return t;
}

}  // namespace kvtier::worker
