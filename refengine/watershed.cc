#include "refengine/watershed.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "base/status_macros.h"
#include "kernels/recall.h"

namespace kvtier::refengine {
namespace {

// A conversation's queries and keys at every layer, token-major.
struct Capture {
  int layers = 0, q_heads = 0, kv_heads = 0, d = 0;
  std::vector<std::vector<float>> q, k;  // Per layer [T, Hq, d] and [T, Hkv, d].
  std::vector<int64_t> round_begin;      // Plus one end entry.
  std::vector<int> question_tokens;      // Per round.
  std::vector<int> window;               // Per layer; empty: all global.
};

RoundDistributions Distributions(const Capture& c, int min_past) {
  RoundDistributions out;
  out.layers = c.layers;
  const int rounds = static_cast<int>(c.round_begin.size()) - 1;
  const int64_t tokens = c.round_begin.back();
  const size_t qrow = static_cast<size_t>(c.q_heads) * c.d;
  const size_t kvrow = static_cast<size_t>(c.kv_heads) * c.d;
  out.window = c.window;
  for (int r = std::max(1, min_past); r < rounds; ++r) {
    out.probe_round.push_back(r);
    out.dist.emplace_back(c.layers);
    out.probe_pos.push_back(c.round_begin[r]);
    out.round_end.emplace_back(c.round_begin.begin() + 1, c.round_begin.begin() + 1 + r);
  }
  for (int l = 0; l < c.layers; ++l) {
    // Head-major keys [Hkv][T, d], as RoundKeys wants them.
    std::vector<std::vector<float>> kh(c.kv_heads, std::vector<float>(tokens * c.d));
    for (int64_t t = 0; t < tokens; ++t) {
      for (int h = 0; h < c.kv_heads; ++h) {
        std::copy_n(&c.k[l][t * kvrow + h * c.d], c.d, &kh[h][t * c.d]);
      }
    }
    for (size_t p = 0; p < out.probe_round.size(); ++p) {
      const int r = out.probe_round[p];
      std::vector<RoundKeys> past(r);
      for (int j = 0; j < r; ++j) {
        for (int h = 0; h < c.kv_heads; ++h) {
          past[j].keys.push_back(&kh[h][c.round_begin[j] * c.d]);
          past[j].lens.push_back(c.round_begin[j + 1] - c.round_begin[j]);
        }
      }
      const int64_t b = c.round_begin[r];
      out.dist[p][l] =
          QAttention(c.q_heads, c.kv_heads, c.d, &c.q[l][b * qrow], static_cast<int64_t>(qrow),
                     c.question_tokens[r], past, &c.k[l][b * kvrow]);
    }
  }
  return out;
}

// Records every layer's q and k on their way to the full-cache attention.
class Recorder : public ConversationBackend {
 public:
  Recorder(const model::ModelConfig& c, Capture* cap) : inner_(LocalBackend(c)), cap_(cap) {}
  absl::Status AttendLayer(int layer, int pos0, int n, const float* q, const float* k,
                           const float* v, float* out) override {
    auto& ql = cap_->q[layer];
    auto& kl = cap_->k[layer];
    ql.insert(ql.end(), q, q + static_cast<size_t>(n) * cap_->q_heads * cap_->d);
    kl.insert(kl.end(), k, k + static_cast<size_t>(n) * cap_->kv_heads * cap_->d);
    return inner_->AttendLayer(layer, pos0, n, q, k, v, out);
  }
  absl::Status BeginStep(bool prefill, int n, int question_tokens) override {
    return inner_->BeginStep(prefill, n, question_tokens);
  }
  absl::Status EndStep() override { return inner_->EndStep(); }
  absl::Status EndRound() override { return inner_->EndRound(); }

 private:
  std::unique_ptr<ConversationBackend> inner_;
  Capture* cap_;
};

}  // namespace

RoundDistributions SyntheticChatDistributions(const traces::SyntheticChat& chat, int min_past) {
  const traces::SyntheticChatOptions& o = chat.options();
  Capture c;
  c.layers = o.layers;
  c.q_heads = o.q_heads;
  c.kv_heads = o.kv_heads;
  c.d = o.head_dim;
  c.question_tokens.assign(o.rounds, o.question_tokens);
  const int per = chat.tokens_per_round();
  const size_t qrow = static_cast<size_t>(o.q_heads) * o.head_dim;
  const size_t kvrow = static_cast<size_t>(o.kv_heads) * o.head_dim;
  const int64_t tokens = static_cast<int64_t>(o.rounds) * per;
  c.q.assign(o.layers, std::vector<float>(tokens * qrow));
  c.k.assign(o.layers, std::vector<float>(tokens * kvrow));
  std::vector<float> v(kvrow);
  for (int r = 0; r <= o.rounds; ++r) c.round_begin.push_back(static_cast<int64_t>(r) * per);
  for (int r = 0; r < o.rounds; ++r) {
    for (int t = 0; t < per; ++t) {
      const int64_t i = static_cast<int64_t>(r) * per + t;
      for (int l = 0; l < o.layers; ++l) {
        chat.Token(r, t, l, &c.q[l][i * qrow], &c.k[l][i * kvrow], v.data());
      }
    }
  }
  return Distributions(c, min_past);
}

absl::StatusOr<RoundDistributions> ModelDistributions(const model::Model& m,
                                                      const ConversationOptions& o, int min_past) {
  const model::ModelConfig& mc = m.config();
  Capture c;
  c.layers = mc.n_layers;
  c.q_heads = mc.n_heads;
  c.kv_heads = mc.n_kv_heads;
  c.d = mc.head_dim();
  c.question_tokens.assign(o.rounds, o.question_tokens);
  c.window = mc.window;
  c.q.resize(c.layers);
  c.k.resize(c.layers);
  Recorder rec(mc, &c);
  KVT_RETURN_IF_ERROR(RunConversation(m, o, &rec, nullptr, nullptr).status());
  const int per = o.question_tokens + o.answer_tokens;
  for (int r = 0; r <= o.rounds; ++r) c.round_begin.push_back(static_cast<int64_t>(r) * per);
  return Distributions(c, min_past);
}

absl::StatusOr<RoundDistributions> ReplayDistributions(
    const model::Model& m, const std::vector<ReplayConversation>& conversations, int min_past) {
  const model::ModelConfig& mc = m.config();
  KVT_RETURN_IF_ERROR(CheckConversations(conversations, mc));
  RoundDistributions out;
  out.layers = mc.n_layers;
  out.window = mc.window;
  for (const ReplayConversation& conv : conversations) {
    Capture c;
    c.layers = mc.n_layers;
    c.q_heads = mc.n_heads;
    c.kv_heads = mc.n_kv_heads;
    c.d = mc.head_dim();
    c.window = mc.window;
    c.q.resize(c.layers);
    c.k.resize(c.layers);
    c.round_begin.push_back(0);
    for (const ReplayRound& r : conv.rounds) {
      c.question_tokens.push_back(static_cast<int>(r.user.size()));
      c.round_begin.push_back(c.round_begin.back() +
                              static_cast<int64_t>(r.user.size() + r.assistant.size()));
    }
    Recorder rec(mc, &c);
    absl::StatusOr<Transcript> t = RunScript(m, conv.Script(), &rec, nullptr);
    if (!t.ok()) {
      return absl::Status(t.status().code(), absl::StrCat(conv.where, ": ", t.status().message()));
    }
    RoundDistributions d = Distributions(c, min_past);
    for (size_t p = 0; p < d.dist.size(); ++p) {
      out.dist.push_back(std::move(d.dist[p]));
      out.probe_round.push_back(d.probe_round[p]);
      out.probe_pos.push_back(d.probe_pos[p]);
      out.round_end.push_back(std::move(d.round_end[p]));
    }
  }
  return out;
}

WatershedReport AnalyzeWatershed(const RoundDistributions& d, double mass, double kl_threshold) {
  WatershedReport w;
  w.watershed = -1;
  w.mass = mass;
  w.kl_threshold = kl_threshold;
  const int L = d.layers;
  const size_t probes = d.dist.size();
  w.rounds_for_mass_mean.assign(L, 0.0);
  w.rounds_for_mass_max.assign(L, 0);
  for (size_t p = 0; p < probes; ++p) {
    w.past_rounds_mean += static_cast<double>(d.dist[p][0].size());
    for (int l = 0; l < L; ++l) {
      const int k = RoundsForMass(d.dist[p][l], mass);
      w.rounds_for_mass_mean[l] += k;
      w.rounds_for_mass_max[l] = std::max(w.rounds_for_mass_max[l], k);
    }
  }
  if (probes > 0) {
    w.past_rounds_mean /= static_cast<double>(probes);
    for (double& x : w.rounds_for_mass_mean) x /= static_cast<double>(probes);
  }
  // The past rounds of probe p that layer l can attend: every one at a
  // global layer, at a sliding one those not yet out of its window for the
  // question's first token (the worker's rule, worker/round_layout.h).
  auto at_stake = [&](size_t p, int l) {
    const int win = d.window.empty() ? 0 : d.window[l];
    std::vector<size_t> out;
    for (size_t j = 0; j < d.dist[p][l].size(); ++j) {
      if (win <= 0 || d.round_end[p][j] > d.probe_pos[p] - win + 1) out.push_back(j);
    }
    return out;
  };
  // P restricted to `keep` and renormalized.
  auto restrict = [](const std::vector<double>& x, const std::vector<size_t>& keep) {
    std::vector<double> y;
    double sum = 0;
    for (size_t j : keep) sum += x[j];
    for (size_t j : keep)
      y.push_back(sum > 0 ? x[j] / sum : 1.0 / static_cast<double>(keep.size()));
    return y;
  };
  w.at_stake_mean.assign(L, 0.0);
  for (size_t p = 0; p < probes; ++p) {
    for (int l = 0; l < L; ++l) w.at_stake_mean[l] += static_cast<double>(at_stake(p, l).size());
  }
  if (probes > 0) {
    for (double& x : w.at_stake_mean) x /= static_cast<double>(probes);
  }
  w.mean_kl.assign(std::max(0, L - 1), 0.0);
  for (int l = 0; l + 1 < L; ++l) {
    double sum = 0;
    int64_t n = 0;
    for (size_t p = 0; p < probes; ++p) {
      for (int l2 = l + 1; l2 < L; ++l2) {
        const bool slides = !d.window.empty() && d.window[l2] > 0;
        if (!slides) {
          sum += model::KlDivergence(d.dist[p][l2], d.dist[p][l]);
          ++n;
          continue;
        }
        const std::vector<size_t> keep = at_stake(p, l2);
        if (keep.empty()) continue;
        sum += model::KlDivergence(restrict(d.dist[p][l2], keep), restrict(d.dist[p][l], keep));
        ++n;
      }
    }
    w.mean_kl[l] = n > 0 ? sum / static_cast<double>(n) : 0;
  }
  if (!w.mean_kl.empty()) {
    const double cut = kl_threshold;
    w.watershed = -1;
    for (int l = static_cast<int>(w.mean_kl.size()) - 1; l >= 0 && w.mean_kl[l] <= cut; --l) {
      w.watershed = l;
    }
  }
  return w;
}

}  // namespace kvtier::refengine
