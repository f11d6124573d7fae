#include "worker/session.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/attention.h"

namespace kvtier::worker {

double MsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

const char* StateName(SessionState s) {
  switch (s) {
    case SessionState::kIdle:
      return "idle";
    case SessionState::kOpen:
      return "open";
    case SessionState::kPrefill:
      return "prefill";
    case SessionState::kDecode:
      return "decode";
    case SessionState::kEnding:
      return "ending";
  }
  return "?";
}

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

absl::Status Engine::Session::CheckStep(int layer, int64_t n, bool prefill) const {
  if (layer < 0 || layer >= shape.layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " outside the model's ", shape.layers));
  }
  if (n < 1) return absl::InvalidArgumentError("a step needs at least one token");
  if (state == SessionState::kEnding) {
    return absl::FailedPreconditionError("EndRound of this session is running");
  }
  const bool in_step = state == SessionState::kPrefill || state == SessionState::kDecode;
  if (!prefill && (state == SessionState::kIdle || tokens == 0)) {
    return absl::FailedPreconditionError("decode before the round's first prefill");
  }
  if (layer == 0 && !in_step) return absl::OkStatus();
  if (layer != next_layer || !in_step) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " out of order: expected layer ", in_step ? next_layer : 0,
                     in_step ? absl::StrCat(" of a ", StateName(state), " step") : ""));
  }
  if ((state == SessionState::kPrefill) != prefill) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer, " of a ", prefill ? "prefill" : "decode", " step while a ",
        StateName(state), " step is in flight"));
  }
  if (n != step_n) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " carries ", n, " tokens; this step has ", step_n));
  }
  return absl::OkStatus();
}

void Engine::Session::BeginStep(int64_t n, bool prefill) {
  if (prefill && state == SessionState::kIdle) {
    recall = RecallState::kNone;
    selected.clear();
  }
  state = prefill ? SessionState::kPrefill : SessionState::kDecode;
  step_n = n;
  next_layer = 0;
}

absl::Status Engine::Session::Place(RoundLayer& rl, int layer) {
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

uint64_t Engine::Session::DeviceBytes() const {
  uint64_t b = 0;
  for (const PastRound& r : past) {
    for (const auto& l : r.layers) {
      if (l != nullptr && l->device != nullptr) b += static_cast<uint64_t>(l->device->bytes());
    }
  }
  return b;
}

int64_t Engine::Session::WorkingSetBytes() const {
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

void Engine::Session::NotePeak() {
  stats.device_bytes = DeviceBytes();
  stats.working_set_bytes = static_cast<uint64_t>(WorkingSetBytes());
  stats.peak_working_set_bytes = std::max(stats.peak_working_set_bytes, stats.working_set_bytes);
}

std::vector<const RoundLayer*> Engine::Session::Visible(int layer) const {
  std::vector<const RoundLayer*> out;
  if (layer <= lw || recall != RecallState::kReady) {
    for (const PastRound& r : past) {
      if (r.layers[layer] != nullptr) out.push_back(r.layers[layer].get());
    }
  } else {
    for (size_t i : selected) out.push_back(past[i].layers[layer].get());
  }
  return out;
}

void Engine::Session::Append(int layer, int64_t n, const float* qs, const float* ks,
                             const float* vs) {
  const size_t qrow = static_cast<size_t>(shape.q_heads) * shape.head_dim,
               kvrow = static_cast<size_t>(shape.kv_heads) * shape.head_dim;
  q[layer].insert(q[layer].end(), qs, qs + n * qrow);
  k[layer].insert(k[layer].end(), ks, ks + n * kvrow);
  v[layer].insert(v[layer].end(), vs, vs + n * kvrow);
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

absl::Status Engine::Session::Attend(int layer, int64_t n, const float* qs, float* out,
                                     KernelLevel level) {
  absl::Status st;
  if (device != nullptr) {
    std::vector<const DeviceLayer*> rounds;
    for (const RoundLayer* r : Visible(layer)) rounds.push_back(r->device.get());
    st = device->Attend(layer, rounds, k[layer].data(), v[layer].data(), tokens, n, qs, out);
  } else {
    st = AttendLayer(shape, Visible(layer), k[layer], v[layer], tokens, n, qs, out, level);
  }
  if (!st.ok()) RollBackStep();
  return st;
}

void Engine::Session::EndLayer(int64_t n) {
  if (++next_layer < shape.layers) return;
  next_layer = 0;
  state = SessionState::kOpen;
  tokens += n;
  stats.tokens += static_cast<uint64_t>(n);
  NotePeak();
}

void Engine::Session::RollBackStep() {
  const size_t qrow = static_cast<size_t>(shape.q_heads) * shape.head_dim;
  const size_t kvrow = static_cast<size_t>(shape.kv_heads) * shape.head_dim;
  for (int l = 0; l < shape.layers; ++l) {
    q[l].resize(tokens * qrow);
    k[l].resize(tokens * kvrow);
    v[l].resize(tokens * kvrow);
  }
  if (state == SessionState::kPrefill && tokens == 0) {
    // The round's first prefill: the round was never open, and its recall
    // (done from this prefill's queries) goes too.
    state = SessionState::kIdle;
    recall = RecallState::kNone;
    selected.clear();
    round_resident.clear();
    fetch.reset();
    fetch_rounds.clear();
  } else if (state == SessionState::kPrefill || state == SessionState::kDecode) {
    state = SessionState::kOpen;
  }
  next_layer = 0;
  step_n = 0;
}

void Engine::Session::CloseRound() {
  for (int l = 0; l < shape.layers; ++l) {
    q[l].clear();
    k[l].clear();
    v[l].clear();
  }
  tokens = 0;
  state = SessionState::kIdle;
  recall = RecallState::kNone;
  selected.clear();
  fetch.reset();
  fetch_rounds.clear();
}

}  // namespace kvtier::worker
