#include "worker/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "kernels/attention.h"
#include "worker/device_attention.h"

namespace kvtier::worker {
namespace {

double MsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

// One KV head of one layer of a past round: encoded K and V [1, len, d].
struct HeadKv {
  v1::EncodedTensor k, v;
  EncodedView kview, vview;
  int64_t len = 0;
};

struct RoundLayer {
  std::vector<HeadKv> heads;
  int64_t bytes = 0;  // Encoded bytes, wherever they live.
  // On a device session: the same K/V in device memory. The host tensors
  // are then dropped, except at layer L_w (recall scores its keys).
  std::unique_ptr<DeviceLayer> device;
};

// Parses a layer's tensors (2 per head, K then V) into a RoundLayer whose
// views point into its own tensors.
absl::StatusOr<std::unique_ptr<RoundLayer>> MakeLayer(std::vector<v1::EncodedTensor> tensors,
                                                      int kv_heads, int d) {
  if (static_cast<int>(tensors.size()) != 2 * kv_heads) {
    return absl::DataLossError("segment payload does not hold 2 tensors per KV head");
  }
  auto layer = std::make_unique<RoundLayer>();
  layer->heads.resize(kv_heads);
  for (int h = 0; h < kv_heads; ++h) {
    HeadKv& hk = layer->heads[h];
    hk.k = std::move(tensors[2 * h]);
    hk.v = std::move(tensors[2 * h + 1]);
    KVT_ASSIGN_OR_RETURN(hk.kview, ParseEncoded(hk.k));
    KVT_ASSIGN_OR_RETURN(hk.vview, ParseEncoded(hk.v));
    if (hk.kview.slabs != 1 || hk.kview.head_dim != d || hk.vview.tokens != hk.kview.tokens ||
        hk.vview.head_dim != d || hk.vview.slabs != 1) {
      return absl::DataLossError("segment tensor shape does not match the session's model");
    }
    hk.len = hk.kview.tokens;
    layer->bytes += EncodedTotalBytes(hk.k) + EncodedTotalBytes(hk.v);
  }
  return layer;
}

}  // namespace

CodecConfig SessionPolicy::RawFp32Codec() {
  CodecConfig c;
  c.codec = v1::CODEC_RAW;
  c.dtype = v1::DTYPE_FP32;
  return c;
}

evict::Policy SessionPolicy::NoEviction() {
  evict::Policy p;
  p.method = evict::Method::kNone;
  return p;
}

class Engine::Session {
 public:
  struct PastRound {
    uint32_t round = 0;
    int64_t tokens = 0;
    std::vector<std::unique_ptr<RoundLayer>> layers;  // Null: not resident.
    uint64_t stored_bytes = 0;
  };

  std::mutex mu;
  std::string id;
  ModelShape shape;
  SessionPolicy policy;
  int lw = 0;
  std::vector<PastRound> past;
  // The open round: per layer token-major q [t, Hq, d], k/v [t, Hkv, d].
  bool round_open = false;
  bool recalled = false;
  std::vector<std::vector<float>> q, k, v;
  int64_t tokens = 0;  // Committed tokens of the open round.
  // The step in flight: layers done so far and its token count.
  int next_layer = 0;
  int64_t step_n = 0;
  bool step_prefill = false;
  // Past rounds (indices into `past`) attended above L_w in this round.
  std::vector<size_t> selected;
  // The recall fetch in flight.
  std::future<absl::StatusOr<std::vector<std::string>>> fetch;
  std::vector<size_t> fetch_rounds;
  std::chrono::steady_clock::time_point fetch_start;
  std::shared_ptr<double> fetch_ms;
  // Set when the working set is on the GPU.
  std::unique_ptr<DeviceSession> device;
  // Rounds the open round recalled without a fetch, and earlier ones whose
  // report to the store failed (one entry per recall).
  std::vector<uint32_t> round_resident, unreported_recalls;
  SessionStats stats;

  // On a device session, uploads `rl` (a layer of a past round) and drops its
  // host tensors unless it is layer L_w. Nothing to do on a host session.
  absl::Status Place(RoundLayer& rl, int layer) {
    if (device == nullptr) return absl::OkStatus();
    std::vector<std::pair<EncodedView, EncodedView>> views;
    for (const HeadKv& hk : rl.heads) views.emplace_back(hk.kview, hk.vview);
    KVT_ASSIGN_OR_RETURN(rl.device, UploadLayer(views, shape.head_dim));
    if (layer != lw) {
      for (HeadKv& hk : rl.heads) {
        hk.k.Clear();
        hk.v.Clear();
        hk.kview = {};
        hk.vview = {};
      }
    }
    return absl::OkStatus();
  }

  uint64_t DeviceBytes() const {
    uint64_t b = 0;
    for (const PastRound& r : past) {
      for (const auto& l : r.layers) {
        if (l != nullptr && l->device != nullptr) b += static_cast<uint64_t>(l->device->bytes());
      }
    }
    return b;
  }

  int64_t WorkingSetBytes() const {
    int64_t b = 0;
    for (const PastRound& r : past) {
      for (const auto& l : r.layers) {
        if (l != nullptr) b += l->bytes;
      }
    }
    // The open round counts at the model's dtype, as an engine holds it.
    b += tokens * shape.layers * shape.kv_heads * shape.head_dim * 2 * shape.dtype_bytes;
    return b;
  }

  void NotePeak() {
    stats.device_bytes = DeviceBytes();
    stats.working_set_bytes = static_cast<uint64_t>(WorkingSetBytes());
    stats.peak_working_set_bytes = std::max(stats.peak_working_set_bytes, stats.working_set_bytes);
  }

  // The past rounds' layer data a token attends at `layer`: every resident
  // round up to L_w, the recalled ones above it.
  std::vector<const RoundLayer*> Visible(int layer) const {
    std::vector<const RoundLayer*> out;
    if (layer <= lw || !recalled) {
      for (const PastRound& r : past) {
        if (r.layers[layer] != nullptr) out.push_back(r.layers[layer].get());
      }
    } else {
      for (size_t i : selected) out.push_back(past[i].layers[layer].get());
    }
    return out;
  }

  // Appends n tokens' q/k/v to the open round at `layer`, then attends them
  // (positions tokens..tokens+n-1) over the visible past rounds plus the open
  // round. Rolls the step back on failure.
  absl::Status AppendAndAttend(int layer, int64_t n, const float* q, const float* k, const float* v,
                               float* out, KernelLevel level) {
    Append(layer, n, q, k, v);
    return Attend(layer, n, q, out, level);
  }
  void Append(int layer, int64_t n, const float* q, const float* k, const float* v);
  // Attends the n tokens appended last at `layer`; rolls the step back on
  // failure.
  absl::Status Attend(int layer, int64_t n, const float* q, float* out, KernelLevel level);

  // Marks `layer` done; after the last layer the step's n tokens commit.
  void EndLayer(int64_t n) {
    if (++next_layer < shape.layers) return;
    next_layer = 0;
    tokens += n;
    stats.tokens += static_cast<uint64_t>(n);
    NotePeak();
  }

  // Sends the open round's resident recalls and any earlier unreported ones
  // to the store in one RecordRecalls call. Returns the rounds counted; on
  // failure keeps them for the next report (the counters are advisory).
  std::vector<uint32_t> ReportResidentRecalls(SegmentStore* store) {
    std::vector<uint32_t> rounds = std::move(unreported_recalls);
    rounds.insert(rounds.end(), round_resident.begin(), round_resident.end());
    round_resident.clear();
    unreported_recalls.clear();
    if (!rounds.empty()) {
      absl::Status st = store->RecordRecalls(id, rounds);
      if (!st.ok()) {
        LogWarn("recall counters not sent; kept for the next round",
                {{"session", id}, {"rounds", rounds.size()}, {"error", st.ToString()}});
        unreported_recalls = std::move(rounds);
        rounds.clear();
      }
    }
    stats.pending_recall_counts = unreported_recalls.size();
    return rounds;
  }

  // Drops the step in flight: the open round goes back to `tokens`.
  void RollBackStep() {
    const size_t qrow = static_cast<size_t>(shape.q_heads) * shape.head_dim;
    const size_t kvrow = static_cast<size_t>(shape.kv_heads) * shape.head_dim;
    for (int l = 0; l < shape.layers; ++l) {
      q[l].resize(tokens * qrow);
      k[l].resize(tokens * kvrow);
      v[l].resize(tokens * kvrow);
    }
    if (step_prefill && tokens == 0) {
      round_open = false;
      recalled = false;
      selected.clear();
      round_resident.clear();
    }
    if (fetch.valid()) fetch.wait();
    fetch = {};
    next_layer = 0;
    step_n = 0;
  }
};

Engine::Engine(SegmentStore* store, EngineOptions options) : store_(store), options_(options) {}
Engine::~Engine() = default;

absl::Status Engine::OpenSession(const std::string& id, const ModelShape& shape,
                                 const SessionPolicy& policy) {
  if (id.empty() || id.size() > 128) {
    return absl::InvalidArgumentError("session id must have 1 to 128 characters");
  }
  if (shape.layers < 1 || shape.q_heads < 1 || shape.kv_heads < 1 ||
      shape.q_heads % shape.kv_heads != 0 || shape.head_dim < 1 || shape.head_dim > 1024 ||
      shape.dtype_bytes < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad model shape: layers ", shape.layers, ", q_heads ", shape.q_heads, ", kv_heads ",
        shape.kv_heads, " (must divide q_heads), head_dim ", shape.head_dim));
  }
  KVT_RETURN_IF_ERROR(ValidateCodecConfig(policy.codec));
  auto s = std::make_shared<Session>();
  s->id = id;
  s->shape = shape;
  s->policy = policy;
  s->lw = policy.watershed_layer >= 0 ? policy.watershed_layer : shape.layers / 3;
  if (s->lw >= shape.layers || (shape.layers > 1 && s->lw == shape.layers - 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "watershed layer ", s->lw, " must be below the last layer (", shape.layers, " layers)"));
  }
  if (policy.eviction.method != evict::Method::kNone) {
    KVT_RETURN_IF_ERROR(evict::ValidateBudget(policy.eviction.budget,
                                              policy.eviction.method == evict::Method::kStreaming
                                                  ? policy.eviction.sinks
                                                  : policy.eviction.score.window));
    if (policy.eviction.method == evict::Method::kProfile &&
        static_cast<int>(policy.eviction.layer_budgets.size()) != shape.layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer profile has ", policy.eviction.layer_budgets.size(),
                       " budgets for a ", shape.layers, "-layer model"));
    }
  }
  s->q.resize(shape.layers);
  s->k.resize(shape.layers);
  s->v.resize(shape.layers);
  using Placement = EngineOptions::Placement;
  if (options_.placement != Placement::kHost) {
    absl::Status why = DeviceStatus();
    if (why.ok()) why = DeviceSupportsCodec(policy.codec);
    if (why.ok()) {
      auto dev = NewDeviceSession(shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim);
      if (dev.ok()) {
        s->device = std::move(*dev);
        s->stats.on_device = true;
      } else {
        why = dev.status();  // kAuto falls back to host memory.
        LogWarn("device working set unavailable", {{"session", id}, {"error", why.ToString()}});
      }
    }
    if (!why.ok() && options_.placement == Placement::kDevice) {
      return absl::FailedPreconditionError(
          absl::StrCat("session ", id, " cannot have a device working set: ", why.message()));
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!sessions_.emplace(id, std::move(s)).second) {
    return absl::AlreadyExistsError(absl::StrCat("session ", id, " already exists"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Engine::Session>> Engine::Find(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return absl::NotFoundError(absl::StrCat("unknown session ", id));
  return it->second;
}

namespace {

// Attention of n new tokens (positions base..base+n-1 of the open round) at
// one layer over the visible past rounds plus the open round, causally.
absl::Status AttendLayer(const ModelShape& sh, const std::vector<const RoundLayer*>& rounds,
                         const std::vector<float>& cur_k, const std::vector<float>& cur_v,
                         int64_t base, int64_t n, const float* q, float* out, KernelLevel level) {
  const int d = sh.head_dim, rep = sh.q_heads / sh.kv_heads;
  std::vector<KvBlock> blocks;
  for (int64_t i = 0; i < n; ++i) {
    for (int h = 0; h < sh.kv_heads; ++h) {
      blocks.clear();
      for (const RoundLayer* r : rounds) {
        const HeadKv& hk = r->heads[h];
        if (hk.len > 0) blocks.push_back({hk.kview, hk.vview});
      }
      const int64_t visible = base + i + 1;
      const int64_t stride = static_cast<int64_t>(sh.kv_heads) * d;
      blocks.push_back(
          {EncodedView::Raw(v1::DTYPE_FP32, cur_k.data() + h * d, 1, visible, d, 0, stride),
           EncodedView::Raw(v1::DTYPE_FP32, cur_v.data() + h * d, 1, visible, d, 0, stride)});
      const int64_t row = i * sh.q_heads * d + static_cast<int64_t>(h) * rep * d;
      KVT_RETURN_IF_ERROR(DecodeAttention({rep, 1, d}, q + row, blocks, out + row, level));
    }
  }
  return absl::OkStatus();
}

}  // namespace

void Engine::Session::Append(int layer, int64_t n, const float* q, const float* k, const float* v) {
  const size_t qrow = static_cast<size_t>(shape.q_heads) * shape.head_dim,
               kvrow = static_cast<size_t>(shape.kv_heads) * shape.head_dim;
  this->q[layer].insert(this->q[layer].end(), q, q + n * qrow);
  this->k[layer].insert(this->k[layer].end(), k, k + n * kvrow);
  this->v[layer].insert(this->v[layer].end(), v, v + n * kvrow);
}

absl::Status Engine::Session::Attend(int layer, int64_t n, const float* q, float* out,
                                     KernelLevel level) {
  absl::Status st;
  if (device != nullptr) {
    std::vector<const DeviceLayer*> rounds;
    for (const RoundLayer* r : Visible(layer)) rounds.push_back(r->device.get());
    st = device->Attend(layer, rounds, this->k[layer].data(), this->v[layer].data(), tokens, n, q,
                        out);
  } else {
    st = AttendLayer(shape, Visible(layer), this->k[layer], this->v[layer], tokens, n, q, out,
                     level);
  }
  if (!st.ok()) RollBackStep();
  return st;
}

absl::StatusOr<std::optional<RecallReport>> Engine::PrefillLayer(const std::string& id, int layer,
                                                                 int64_t n, int64_t question_tokens,
                                                                 const float* q, const float* k,
                                                                 const float* v, float* out) {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Find(id));
  std::lock_guard<std::mutex> lock(s->mu);
  const ModelShape& sh = s->shape;
  if (layer < 0 || layer >= sh.layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " outside the model's ", sh.layers));
  }
  if (n < 1) return absl::InvalidArgumentError("a prefill needs at least one token");
  if (layer != s->next_layer) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " out of order: expected layer ", s->next_layer));
  }
  if (layer == 0) {
    s->step_n = n;
    s->step_prefill = true;
    if (!s->round_open) {
      s->round_open = true;
      s->recalled = false;
      s->selected.clear();
    }
  } else if (!s->step_prefill || n != s->step_n) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " carries ", n, " tokens; this step has ", s->step_n,
                     s->step_prefill ? "" : " (a decode step is in flight)"));
  }
  const int d = sh.head_dim;
  const size_t qrow = static_cast<size_t>(sh.q_heads) * d;
  std::optional<RecallReport> report;
  // Above L_w: wait for the recall fetch started at L_w and install it.
  if (layer == s->lw + 1 && s->fetch.valid()) {
    const auto wait_start = std::chrono::steady_clock::now();
    absl::StatusOr<std::vector<std::string>> got = s->fetch.get();
    const double exposed = MsSince(wait_start);
    if (!got.ok()) {
      s->RollBackStep();
      return absl::UnavailableError(absl::StrCat("recall fetch failed: ", got.status().message()));
    }
    std::vector<std::vector<std::unique_ptr<RoundLayer>>> parsed;
    for (size_t i = 0; i < got->size(); ++i) {
      v1::SegmentPayload payload;
      if (!payload.ParseFromString((*got)[i]) ||
          payload.tensors_size() != 2 * sh.kv_heads * (sh.layers - s->lw - 1)) {
        s->RollBackStep();
        return absl::DataLossError("recalled segment payload is malformed");
      }
      std::vector<std::unique_ptr<RoundLayer>> layers;
      for (int l = s->lw + 1; l < sh.layers; ++l) {
        std::vector<v1::EncodedTensor> t;
        const int first = 2 * sh.kv_heads * (l - s->lw - 1);
        for (int j = 0; j < 2 * sh.kv_heads; ++j) t.push_back(payload.tensors(first + j));
        auto rl = MakeLayer(std::move(t), sh.kv_heads, d);
        absl::Status placed = rl.ok() ? s->Place(**rl, l) : rl.status();
        if (!placed.ok()) {
          s->RollBackStep();
          return placed;
        }
        layers.push_back(std::move(*rl));
      }
      parsed.push_back(std::move(layers));
    }
    for (size_t i = 0; i < parsed.size(); ++i) {
      Session::PastRound& r = s->past[s->fetch_rounds[i]];
      for (int l = s->lw + 1; l < sh.layers; ++l) r.layers[l] = std::move(parsed[i][l - s->lw - 1]);
    }
    if (!s->stats.recalls.empty()) {
      RecallReport& rr = s->stats.recalls.back();
      rr.exposed_ms = exposed;
      rr.fetch_ms = *s->fetch_ms;
      for (const std::string& p : *got) rr.bytes_fetched += p.size();
      report = rr;
    }
  }
  const int64_t base = s->tokens;
  s->Append(layer, n, q, k, v);
  // Recall at L_w, once per round, from the round's first prefill. It needs
  // only this layer's queries and keys, so the fetch starts before this
  // layer's attention and overlaps with it too.
  if (layer == s->lw && !s->recalled && base == 0 && !s->past.empty() && sh.layers > 1) {
    std::vector<std::vector<float>> keys(s->past.size() * sh.kv_heads);
    std::vector<RoundKeys> rk(s->past.size());
    for (size_t r = 0; r < s->past.size(); ++r) {
      const RoundLayer& rl = *s->past[r].layers[s->lw];
      for (int h = 0; h < sh.kv_heads; ++h) {
        std::vector<float>& buf = keys[r * sh.kv_heads + h];
        buf.resize(static_cast<size_t>(rl.heads[h].len) * d);
        DecodeRows(rl.heads[h].kview, 0, 0, rl.heads[h].len, buf.data(), options_.level);
        rk[r].keys.push_back(buf.data());
        rk[r].lens.push_back(rl.heads[h].len);
      }
    }
    const int64_t qt = question_tokens > 0 ? std::min(question_tokens, n) : n;
    RecallReport rep;
    rep.round = static_cast<uint32_t>(s->stats.rounds);
    rep.scores = QAttention(sh.q_heads, sh.kv_heads, d, q, static_cast<int64_t>(qrow), qt, rk,
                            s->k[layer].data());
    const std::vector<uint32_t> pick =
        SelectRounds(rep.scores, s->policy.recall, s->policy.keep_recent_round);
    s->selected.assign(pick.begin(), pick.end());
    std::vector<SegmentStore::Segment> segs;
    s->fetch_rounds.clear();
    std::vector<uint32_t> resident;
    for (uint32_t i : pick) {
      rep.selected.push_back(s->past[i].round);
      if (s->past[i].layers[s->lw + 1] == nullptr) {
        segs.push_back({s->past[i].round, 1});
        s->fetch_rounds.push_back(i);
      } else {
        resident.push_back(s->past[i].round);
      }
    }
    // Reported at EndRound. Assigned, not appended: a rolled-back first
    // prefill recalls again.
    s->round_resident = std::move(resident);
    rep.fetched_segments = static_cast<int>(segs.size());
    if (!segs.empty()) {
      // ONE GetSegments call for every selected round, started now so that it
      // overlaps with the engine's work up to layer L_w + 1.
      auto fetch_ms = std::make_shared<double>(0);
      s->fetch_ms = fetch_ms;
      SegmentStore* store = store_;
      const std::string sid = s->id;
      s->fetch = std::async(std::launch::async, [store, sid, segs, fetch_ms]() {
        const auto t0 = std::chrono::steady_clock::now();
        auto r = store->Get(sid, segs);
        *fetch_ms = MsSince(t0);
        return r;
      });
    }
    s->recalled = true;
    s->stats.recalls.push_back(rep);
    report = rep;
  } else if (layer == s->lw && base == 0 && !s->recalled) {
    s->recalled = true;  // Nothing to recall: every past round stays visible.
    s->selected.clear();
    for (size_t i = 0; i < s->past.size(); ++i) s->selected.push_back(i);
  }
  KVT_RETURN_IF_ERROR(s->Attend(layer, n, q, out, options_.level));
  s->EndLayer(n);
  return report;
}

absl::Status Engine::DecodeLayer(const std::string& id, int layer, const float* q, const float* k,
                                 const float* v, float* out) {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Find(id));
  std::lock_guard<std::mutex> lock(s->mu);
  const ModelShape& sh = s->shape;
  if (layer < 0 || layer >= sh.layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " outside the model's ", sh.layers));
  }
  if (!s->round_open || s->tokens == 0) {
    return absl::FailedPreconditionError("decode before the round's first prefill");
  }
  if (layer != s->next_layer || (layer > 0 && s->step_prefill)) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " out of order: expected layer ", s->next_layer,
                     s->step_prefill && layer > 0 ? " of a prefill" : ""));
  }
  if (layer == 0) {
    s->step_n = 1;
    s->step_prefill = false;
  }
  KVT_RETURN_IF_ERROR(s->AppendAndAttend(layer, 1, q, k, v, out, options_.level));
  s->EndLayer(1);
  return absl::OkStatus();
}

absl::StatusOr<EndRoundReport> Engine::EndRound(const std::string& id) {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Find(id));
  std::lock_guard<std::mutex> lock(s->mu);
  const ModelShape& sh = s->shape;
  if (!s->round_open || s->tokens == 0) {
    return absl::FailedPreconditionError("EndRound without an open round");
  }
  if (s->next_layer != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("EndRound in the middle of a step (next layer ", s->next_layer, ")"));
  }
  const int d = sh.head_dim;
  const int64_t t = s->tokens;
  const uint64_t round_working_set = static_cast<uint64_t>(s->WorkingSetBytes());
  // Eviction per layer, then encoding of each KV head's kept tokens.
  std::vector<std::vector<v1::EncodedTensor>> enc(sh.layers);
  std::vector<float> qm(static_cast<size_t>(sh.q_heads) * t * d),
      km(static_cast<size_t>(sh.kv_heads) * t * d), vm(km.size()), hk, hv;
  for (int l = 0; l < sh.layers; ++l) {
    for (int64_t i = 0; i < t; ++i) {
      for (int h = 0; h < sh.q_heads; ++h)
        std::memcpy(&qm[(h * t + i) * d], &s->q[l][(i * sh.q_heads + h) * d], d * sizeof(float));
      for (int h = 0; h < sh.kv_heads; ++h) {
        std::memcpy(&km[(h * t + i) * d], &s->k[l][(i * sh.kv_heads + h) * d], d * sizeof(float));
        std::memcpy(&vm[(h * t + i) * d], &s->v[l][(i * sh.kv_heads + h) * d], d * sizeof(float));
      }
    }
    const evict::LayerQK x{sh.q_heads, sh.kv_heads, d, t, qm.data(), km.data()};
    KVT_ASSIGN_OR_RETURN(auto keep, evict::SelectTokens(s->policy.eviction, l, sh.layers, x));
    for (int h = 0; h < sh.kv_heads; ++h) {
      const int64_t len = static_cast<int64_t>(keep[h].size());
      hk.resize(len * d);
      hv.resize(len * d);
      for (int64_t i = 0; i < len; ++i) {
        std::memcpy(&hk[i * d], &km[(h * t + keep[h][i]) * d], d * sizeof(float));
        std::memcpy(&hv[i * d], &vm[(h * t + keep[h][i]) * d], d * sizeof(float));
      }
      const int64_t shape[3] = {1, len, d};
      KVT_ASSIGN_OR_RETURN(v1::EncodedTensor ek, Encode(s->policy.codec, v1::TENSOR_ROLE_KEY, shape,
                                                        hk.data(), options_.level));
      KVT_ASSIGN_OR_RETURN(v1::EncodedTensor ev, Encode(s->policy.codec, v1::TENSOR_ROLE_VALUE,
                                                        shape, hv.data(), options_.level));
      enc[l].push_back(std::move(ek));
      enc[l].push_back(std::move(ev));
    }
  }
  const uint32_t round = s->stats.rounds;
  const int lw = s->lw;
  auto payload_of = [&](int l0, int l1) {
    v1::SegmentPayload p;
    for (int l = l0; l < l1; ++l) {
      for (const auto& e : enc[l]) *p.add_tensors() = e;
    }
    return p.SerializeAsString();
  };
  EndRoundReport rep;
  rep.round = round;
  const std::string lower = payload_of(0, lw + 1);
  const std::string upper = lw + 1 < sh.layers ? payload_of(lw + 1, sh.layers) : std::string();
  // The round's working-set form, built (and on a GPU uploaded) before the
  // puts, so that a failure of either leaves the round open.
  Session::PastRound pr;
  pr.round = round;
  pr.tokens = t;
  for (int l = 0; l < sh.layers; ++l) {
    KVT_ASSIGN_OR_RETURN(auto rl, MakeLayer(std::move(enc[l]), sh.kv_heads, d));
    KVT_RETURN_IF_ERROR(s->Place(*rl, l));
    pr.layers.push_back(std::move(rl));
  }
  auto put_both = [&]() -> absl::Status {
    KVT_RETURN_IF_ERROR(store_->Put(s->id, {round, 0}, 0, lw + 1, lower));
    if (lw + 1 < sh.layers) {
      KVT_RETURN_IF_ERROR(store_->Put(s->id, {round, 1}, lw + 1, sh.layers, upper));
    }
    return absl::OkStatus();
  };
  absl::Status put = put_both();
  if (put.code() == absl::StatusCode::kAlreadyExists) {
    // An earlier EndRound of this round stored its lower segment and then
    // failed; the round may have grown since. Replace what is there.
    KVT_RETURN_IF_ERROR(store_->DropRound(s->id, round));
    put = put_both();
  }
  if (put.code() == absl::StatusCode::kAlreadyExists) {
    return absl::InternalError(
        absl::StrCat("round ", round, " is still in the store after a drop"));
  }
  KVT_RETURN_IF_ERROR(put);
  rep.stored_bytes += lower.size() + (lw + 1 < sh.layers ? upper.size() : 0);
  // The round becomes a past round of the working set.
  pr.stored_bytes = rep.stored_bytes;
  s->past.push_back(std::move(pr));
  if (s->policy.release_after_end_round) {
    for (auto& r : s->past) {
      for (int l = lw + 1; l < sh.layers; ++l) r.layers[l].reset();
    }
  }
  for (int l = 0; l < sh.layers; ++l) {
    s->q[l].clear();
    s->k[l].clear();
    s->v[l].clear();
  }
  rep.recalls_recorded = s->ReportResidentRecalls(store_);
  rep.full_bytes = static_cast<uint64_t>(t) * sh.layers * sh.kv_heads * d * 2 * sh.dtype_bytes;
  s->stats.full_cache_bytes += rep.full_bytes;
  s->tokens = 0;
  s->round_open = false;
  s->recalled = false;
  s->selected.clear();
  s->stats.rounds += 1;
  s->NotePeak();
  rep.working_set_bytes = s->stats.working_set_bytes;
  rep.round_working_set_bytes = round_working_set;
  rep.full_cache_bytes = s->stats.full_cache_bytes;
  return rep;
}

absl::Status Engine::CloseSession(const std::string& id, bool delete_from_store) {
  std::shared_ptr<Session> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) return absl::NotFoundError(absl::StrCat("unknown session ", id));
    s = it->second;
    sessions_.erase(it);
  }
  std::lock_guard<std::mutex> lock(s->mu);
  if (s->fetch.valid()) s->fetch.wait();
  if (delete_from_store) return store_->Delete(id);
  // The session's rounds stay in the store: their counters should be right.
  s->ReportResidentRecalls(store_);
  return absl::OkStatus();
}

absl::StatusOr<SessionStats> Engine::Stats(const std::string& id) const {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Find(id));
  std::lock_guard<std::mutex> lock(s->mu);
  SessionStats st = s->stats;
  st.working_set_bytes = static_cast<uint64_t>(s->WorkingSetBytes());
  st.device_bytes = s->DeviceBytes();
  st.full_cache_bytes += static_cast<uint64_t>(s->tokens) * s->shape.layers * s->shape.kv_heads *
                         s->shape.head_dim * 2 * s->shape.dtype_bytes;
  return st;
}

absl::StatusOr<SessionPolicy> Engine::Policy(const std::string& id) const {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Find(id));
  std::lock_guard<std::mutex> lock(s->mu);
  SessionPolicy p = s->policy;
  p.watershed_layer = s->lw;
  return p;
}

absl::StatusOr<ModelShape> Engine::Shape(const std::string& id) const {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Find(id));
  return s->shape;
}

uint64_t Engine::TotalWorkingSetBytes() const {
  std::vector<std::shared_ptr<Session>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, s] : sessions_) all.push_back(s);
  }
  uint64_t total = 0;
  for (const auto& s : all) {
    std::lock_guard<std::mutex> lock(s->mu);
    total += static_cast<uint64_t>(s->WorkingSetBytes());
  }
  return total;
}

std::vector<std::string> Engine::Sessions() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> ids;
  for (const auto& [id, s] : sessions_) ids.push_back(id);
  return ids;
}

}  // namespace kvtier::worker
