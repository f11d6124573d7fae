#include "traces/trace.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace kvtier::traces {
namespace {

// Records every layer's q/k/v on the way through a full-precision cache.
class Capture : public model::AttentionBackend {
 public:
  explicit Capture(const model::ModelConfig& c) : c_(c), full_(c), q_(c.n_layers) {}
  absl::Status Attend(int layer, int pos, const float* q, const float* k, const float* v,
                      float* out) override {
    q_[layer].insert(q_[layer].end(), q, q + c_.q_dim());
    return full_.Attend(layer, pos, q, k, v, out);
  }
  const model::FullCacheAttention& full() const { return full_; }
  const std::vector<float>& queries(int layer) const { return q_[layer]; }

 private:
  model::ModelConfig c_;
  model::FullCacheAttention full_;
  std::vector<std::vector<float>> q_;
};

std::vector<float> UnitVector(std::mt19937_64& rng, int d) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> u(d);
  double norm = 0;
  for (float& x : u) {
    x = n(rng);
    norm += x * x;
  }
  for (float& x : u) x = static_cast<float>(x / std::sqrt(norm));
  return u;
}

}  // namespace

absl::StatusOr<KvTrace> CaptureModelTrace(const model::Model& m, const std::vector<int>& tokens,
                                          int n_queries, const std::string& name) {
  const model::ModelConfig& c = m.config();
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n_queries < 1 || n_queries >= n) {
    return absl::InvalidArgumentError("a model trace needs 1 <= queries < tokens");
  }
  Capture cap(c);
  model::Forward f(m);
  for (int64_t pos = 0; pos < n; ++pos) {
    KVT_RETURN_IF_ERROR(f.Step(tokens[pos], static_cast<int>(pos), &cap, nullptr));
  }
  KvTrace t;
  t.name = name;
  t.layers = c.n_layers;
  t.q_heads = c.n_heads;
  t.kv_heads = c.n_kv_heads;
  t.head_dim = c.head_dim();
  t.queries = n_queries;
  t.tokens = n - n_queries;
  t.token_ids = tokens;
  const int hd = t.head_dim, kv = c.kv_dim();
  t.k.resize(static_cast<size_t>(t.layers) * t.kv_heads * t.tokens * hd);
  t.v.resize(t.k.size());
  t.q.resize(static_cast<size_t>(t.layers) * t.q_heads * t.queries * hd);
  for (int l = 0; l < t.layers; ++l) {
    const auto& kc = cap.full().keys(l);
    const auto& vc = cap.full().values(l);
    for (int h = 0; h < t.kv_heads; ++h) {
      float* kd = t.k.data() + ((static_cast<int64_t>(l) * t.kv_heads + h) * t.tokens) * hd;
      float* vd = t.v.data() + ((static_cast<int64_t>(l) * t.kv_heads + h) * t.tokens) * hd;
      for (int64_t p = 0; p < t.tokens; ++p) {
        std::copy_n(kc.begin() + p * kv + h * hd, hd, kd + p * hd);
        std::copy_n(vc.begin() + p * kv + h * hd, hd, vd + p * hd);
      }
    }
    const auto& qc = cap.queries(l);
    t.q_tokens.resize(static_cast<size_t>(t.layers) * t.q_heads * t.tokens * hd);
    for (int h = 0; h < t.q_heads; ++h) {
      float* qt = t.q_tokens.data() + ((static_cast<int64_t>(l) * t.q_heads + h) * t.tokens) * hd;
      for (int64_t p = 0; p < t.tokens; ++p)
        std::copy_n(qc.begin() + p * c.q_dim() + h * hd, hd, qt + p * hd);
    }
    for (int h = 0; h < t.q_heads; ++h) {
      float* qd = t.q.data() + ((static_cast<int64_t>(l) * t.q_heads + h) * t.queries) * hd;
      for (int64_t i = 0; i < t.queries; ++i) {
        std::copy_n(qc.begin() + (t.tokens + i) * c.q_dim() + h * hd, hd, qd + i * hd);
      }
    }
  }
  return t;
}

absl::StatusOr<KvTrace> MakeSyntheticTrace(const SyntheticOptions& o) {
  if (o.layers < 1 || o.kv_heads < 1 || o.q_heads < o.kv_heads || o.q_heads % o.kv_heads != 0 ||
      o.head_dim < 2 || o.rounds < 1 || o.tokens_per_round < 1 || o.queries < 1 ||
      o.outlier_channels < 0 || o.outlier_channels > o.head_dim || o.sink_tokens < 0 ||
      o.sink_tokens > o.tokens_per_round || o.focus_rounds < 0 || o.focus_rounds >= o.rounds ||
      !(o.min_concentration > 0) || o.max_concentration < o.min_concentration) {
    return absl::InvalidArgumentError("synthetic trace options out of range");
  }
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  KvTrace t;
  t.name = absl::StrCat("synthetic-d", o.head_dim, "-h", o.q_heads, "x", o.kv_heads, "-r", o.rounds,
                        o.group_concentration ? "-kvgroup" : "");
  t.layers = o.layers;
  t.q_heads = o.q_heads;
  t.kv_heads = o.kv_heads;
  t.head_dim = o.head_dim;
  t.tokens = static_cast<int64_t>(o.rounds) * o.tokens_per_round;
  t.queries = o.queries;
  for (int r = 0; r < o.rounds; ++r)
    t.round_begin.push_back(static_cast<int64_t>(r) * o.tokens_per_round);
  // The question (last round) attends to `focus_rounds` earlier rounds.
  std::vector<int> earlier(o.rounds - 1);
  std::iota(earlier.begin(), earlier.end(), 0);
  std::shuffle(earlier.begin(), earlier.end(), rng);
  t.focus_rounds.assign(earlier.begin(), earlier.begin() + o.focus_rounds);
  std::sort(t.focus_rounds.begin(), t.focus_rounds.end());
  // Per-query-head concentration, log-uniform and shuffled across heads.
  const int spread = o.group_concentration ? o.kv_heads : o.q_heads;
  std::vector<float> beta(spread);
  for (int j = 0; j < spread; ++j) {
    const double f = spread == 1 ? 0.5 : static_cast<double>(j) / (spread - 1);
    beta[j] = static_cast<float>(o.min_concentration *
                                 std::pow(o.max_concentration / o.min_concentration, f));
  }
  std::shuffle(beta.begin(), beta.end(), rng);
  if (o.group_concentration) {
    std::vector<float> per_q(o.q_heads);
    for (int j = 0; j < o.q_heads; ++j) per_q[j] = beta[j / (o.q_heads / o.kv_heads)];
    beta = std::move(per_q);
  }
  const int d = o.head_dim;
  const float sqrt_d = std::sqrt(static_cast<float>(d));
  t.k.resize(static_cast<size_t>(o.layers) * o.kv_heads * t.tokens * d);
  t.v.resize(t.k.size());
  t.q.resize(static_cast<size_t>(o.layers) * o.q_heads * o.queries * d);
  const int rep = o.q_heads / o.kv_heads;
  for (int l = 0; l < o.layers; ++l) {
    for (int h = 0; h < o.kv_heads; ++h) {
      std::vector<std::vector<float>> topic(o.rounds), vmean(o.rounds);
      for (int r = 0; r < o.rounds; ++r) {
        topic[r] = UnitVector(rng, d);
        vmean[r].resize(d);
        for (float& x : vmean[r]) x = gauss(rng);
      }
      const std::vector<float> sink = UnitVector(rng, d);
      std::vector<int> outlier(d, 0);
      for (int c = 0; c < o.outlier_channels; ++c) {
        int ch;
        do {
          ch = static_cast<int>(rng() % d);
        } while (outlier[ch] != 0);
        outlier[ch] = (rng() & 1) ? 1 : -1;
      }
      float* kd = t.k.data() + ((static_cast<int64_t>(l) * o.kv_heads + h) * t.tokens) * d;
      float* vd = t.v.data() + ((static_cast<int64_t>(l) * o.kv_heads + h) * t.tokens) * d;
      for (int64_t tok = 0; tok < t.tokens; ++tok) {
        const int r = static_cast<int>(tok / o.tokens_per_round);
        const bool is_sink = tok < o.sink_tokens;
        const float a = 0.5f + uni(rng);
        for (int c = 0; c < d; ++c) {
          float k = gauss(rng);
          k += is_sink ? o.sink_strength * sqrt_d * sink[c] / 2.0f
                       : o.topic_strength * a * topic[r][c] * sqrt_d / 4.0f;
          if (outlier[c] != 0) k = outlier[c] * o.outlier_magnitude * (1.0f + 0.15f * gauss(rng));
          kd[tok * d + c] = k;
          vd[tok * d + c] = gauss(rng) + vmean[r][c];
        }
      }
      if (o.token_queries) {
        t.q_tokens.resize(static_cast<size_t>(o.layers) * o.q_heads * t.tokens * d);
        for (int j = 0; j < rep; ++j) {
          const int qh = h * rep + j;
          float* qd =
              t.q_tokens.data() + ((static_cast<int64_t>(l) * o.q_heads + qh) * t.tokens) * d;
          for (int64_t tok = 0; tok < t.tokens; ++tok) {
            const int r = static_cast<int>(tok / o.tokens_per_round);
            double norm = 0;
            std::vector<float> dir(d);
            for (int c = 0; c < d; ++c) {
              float x = 0.5f * sink[c] + topic[r][c] + 0.3f * gauss(rng);
              if (r == o.rounds - 1) {
                for (int f : t.focus_rounds) x += topic[f][c];
              }
              dir[c] = x;
              norm += static_cast<double>(x) * x;
            }
            const float s = beta[qh] * sqrt_d / static_cast<float>(std::sqrt(norm));
            for (int c = 0; c < d; ++c)
              qd[tok * d + c] = outlier[c] != 0 ? 0.05f * gauss(rng) : dir[c] * s;
          }
        }
      }
      for (int j = 0; j < rep; ++j) {
        const int qh = h * rep + j;
        float* qd = t.q.data() + ((static_cast<int64_t>(l) * o.q_heads + qh) * o.queries) * d;
        for (int i = 0; i < o.queries; ++i) {
          std::vector<float> dir(d, 0.0f);
          double norm = 0;
          for (int c = 0; c < d; ++c) {
            float x = 0.5f * sink[c] + topic[o.rounds - 1][c] + 0.3f * gauss(rng);
            for (int f : t.focus_rounds) x += topic[f][c];
            dir[c] = x;
            norm += static_cast<double>(x) * x;
          }
          const float s = beta[qh] * sqrt_d / static_cast<float>(std::sqrt(norm));
          for (int c = 0; c < d; ++c)
            qd[i * d + c] = outlier[c] != 0 ? 0.05f * gauss(rng) : dir[c] * s;
        }
      }
    }
  }
  return t;
}

}  // namespace kvtier::traces
