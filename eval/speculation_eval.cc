#include "eval/speculation_eval.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace kvtier::eval {
namespace {

// Records every layer's post-RoPE q, k and v on the way to the full cache.
class Capture : public model::LayerAttention {
 public:
  explicit Capture(const model::ModelConfig& c)
      : c_(c), full_(c), inner_(c, &full_), q_(c.n_layers), k_(c.n_layers), v_(c.n_layers) {}
  absl::Status AttendLayer(int layer, int pos0, int n, const float* q, const float* k,
                           const float* v, float* out) override {
    const size_t qn = static_cast<size_t>(n) * c_.q_dim(),
                 kvn = static_cast<size_t>(n) * c_.kv_dim();
    q_[layer].insert(q_[layer].end(), q, q + qn);
    k_[layer].insert(k_[layer].end(), k, k + kvn);
    v_[layer].insert(v_[layer].end(), v, v + kvn);
    return inner_.AttendLayer(layer, pos0, n, q, k, v, out);
  }
  std::vector<std::vector<float>>& q() { return q_; }
  std::vector<std::vector<float>>& k() { return k_; }
  std::vector<std::vector<float>>& v() { return v_; }

 private:
  model::ModelConfig c_;
  model::FullCacheAttention full_;
  model::PerTokenLayerAttention inner_;
  std::vector<std::vector<float>> q_, k_, v_;
};

// Causal attention of T tokens, float64: out [T, hq, d].
std::vector<double> Causal(const float* q, const float* k, const float* v, int64_t T, int hq,
                           int hkv, int d) {
  std::vector<double> out(static_cast<size_t>(T) * hq * d, 0.0), p(T);
  const int group = hq / hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t t = 0; t < T; ++t) {
    for (int h = 0; h < hq; ++h) {
      const float* qh = q + (t * hq + h) * d;
      double best = -INFINITY;
      for (int64_t s = 0; s <= t; ++s) {
        const float* ks = k + (s * hkv + h / group) * d;
        double acc = 0;
        for (int i = 0; i < d; ++i) acc += static_cast<double>(qh[i]) * ks[i];
        p[s] = acc * scale;
        best = std::max(best, p[s]);
      }
      double z = 0;
      for (int64_t s = 0; s <= t; ++s) z += (p[s] = std::exp(p[s] - best));
      double* o = &out[(t * hq + h) * d];
      for (int64_t s = 0; s <= t; ++s) {
        const float* vs = v + (s * hkv + h / group) * d;
        for (int i = 0; i < d; ++i) o[i] += p[s] / z * vs[i];
      }
    }
  }
  return out;
}

// Attention with speculation at decode steps of layers >= 1; everything
// goes through the full cache too (its output is the dense reference, and
// its cache holds every token for later steps).
class Speculating : public model::LayerAttention {
 public:
  Speculating(const model::ModelConfig& c, const spec::SkewModel& skew,
              const spec::SpeculationParams& p, bool oracle, SpecResult* r)
      : c_(c),
        oracle_(oracle),
        skew_(skew),
        p_(p),
        r_(r),
        full_(c),
        inner_(c, &full_),
        partial_(c.n_layers, std::vector<std::vector<float>>(c.n_kv_heads)),
        q_next_(c.n_layers) {}

  bool WantsNextLayerQuery() const override { return true; }
  absl::Status NextLayerQuery(int layer, int pos0, int n, const float* q_next) override {
    (void)pos0;
    if (n == 1) q_next_[layer + 1].assign(q_next, q_next + c_.q_dim());
    return absl::OkStatus();
  }

  absl::Status AttendLayer(int layer, int pos0, int n, const float* q, const float* k,
                           const float* v, float* out) override {
    const int d = c_.head_dim(), hq = c_.n_heads, hkv = c_.n_kv_heads, group = hq / hkv;
    const int r = skew_.partial_columns();
    const int64_t before = static_cast<int64_t>(full_.keys(layer).size()) / (hkv * d);
    KVT_RETURN_IF_ERROR(inner_.AttendLayer(layer, pos0, n, q, k, v, out));
    // The partial skewed keys of the new tokens.
    for (int i = 0; i < n; ++i) {
      for (int h = 0; h < hkv; ++h) {
        std::vector<float>& pk = partial_[layer][h];
        pk.resize(pk.size() + r);
        spec::SkewPartial(skew_.heads[layer][h], d, k + (static_cast<size_t>(i) * hkv + h) * d,
                          pk.data() + pk.size() - r);
      }
    }
    const double row = static_cast<double>(hkv) * d * 2 * sizeof(float);  // K and V of a token.
    if (n != 1) return absl::OkStatus();                                  // Prefill: dense.
    r_->bytes_dense += static_cast<double>(before + 1) * row;
    if (layer == 0 || q_next_[layer].empty() || before == 0) {
      r_->bytes_speculative += static_cast<double>(before + 1) * row;
      return absl::OkStatus();
    }
    std::vector<const float*> pks(hkv), keys(hkv);
    for (int h = 0; h < hkv; ++h) pks[h] = partial_[layer][h].data();
    const spec::Speculated s = spec::Speculate(
        skew_.heads[layer], oracle_ ? q : q_next_[layer].data(), pks, before, hq, hkv, d, p_);
    q_next_[layer].clear();
    // The true attention over the cached tokens, per KV head contiguous.
    const std::vector<float>& kc = full_.keys(layer);
    const std::vector<float>& vc = full_.values(layer);
    std::vector<std::vector<float>> kh(hkv, std::vector<float>(static_cast<size_t>(before) * d));
    for (int64_t t = 0; t < before; ++t) {
      for (int h = 0; h < hkv; ++h) {
        std::copy_n(&kc[(t * hkv + h) * d], d, &kh[h][t * d]);
      }
    }
    for (int h = 0; h < hkv; ++h) keys[h] = kh[h].data();
    const spec::HitRate hr = spec::Score(s, q, keys, before, hq, hkv, d);
    SpecLayerStats& st = r_->layers[layer];
    st.hit += hr.hit;
    st.mass += hr.mass;
    st.n += s.n;
    ++st.steps;
    // Bytes: partial keys of every cached token, K and V of the union of
    // the group's tokens per KV head, and the token itself.
    double bytes = static_cast<double>(before) * hkv * r * sizeof(float) + row;
    for (int h = 0; h < hkv; ++h) {
      std::vector<int32_t> u;
      for (int g = 0; g < group; ++g) {
        const auto& t = s.tokens[h * group + g];
        u.insert(u.end(), t.begin(), t.end());
      }
      std::sort(u.begin(), u.end());
      bytes +=
          static_cast<double>(std::unique(u.begin(), u.end()) - u.begin()) * d * 2 * sizeof(float);
    }
    r_->bytes_speculative += bytes;
    // Attention over the speculated tokens and the token itself.
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    std::vector<float> spec_out(static_cast<size_t>(hq) * d);
    for (int h = 0; h < hq; ++h) {
      const float* qh = q + static_cast<size_t>(h) * d;
      std::vector<int64_t> toks(s.tokens[h].begin(), s.tokens[h].end());
      toks.push_back(before);  // The new token.
      std::vector<double> w(toks.size());
      double best = -INFINITY;
      for (size_t j = 0; j < toks.size(); ++j) {
        const float* kt = &kc[(toks[j] * hkv + h / group) * d];
        double acc = 0;
        for (int i = 0; i < d; ++i) acc += static_cast<double>(qh[i]) * kt[i];
        w[j] = acc * scale;
        best = std::max(best, w[j]);
      }
      double z = 0;
      for (double& x : w) z += (x = std::exp(x - best));
      for (int i = 0; i < d; ++i) {
        double acc = 0;
        for (size_t j = 0; j < toks.size(); ++j) {
          acc += w[j] / z * vc[(toks[j] * hkv + h / group) * d + i];
        }
        spec_out[h * d + i] = static_cast<float>(acc);
      }
    }
    for (size_t i = 0; i < spec_out.size(); ++i) {
      const double e = static_cast<double>(spec_out[i]) - out[i];
      err2_ += e * e;
      ref2_ += static_cast<double>(out[i]) * out[i];
      out[i] = spec_out[i];
    }
    return absl::OkStatus();
  }

  double err2() const { return err2_; }
  double ref2() const { return ref2_; }

 private:
  model::ModelConfig c_;
  const bool oracle_;
  const spec::SkewModel& skew_;
  spec::SpeculationParams p_;
  SpecResult* r_;
  model::FullCacheAttention full_;
  model::PerTokenLayerAttention inner_;
  std::vector<std::vector<std::vector<float>>> partial_;  // [layer][kv head] [T, r].
  std::vector<std::vector<float>> q_next_;                // [layer], empty when none.
  double err2_ = 0, ref2_ = 0;
};

// Teacher-forced logits at every decode step of a conversation.
absl::StatusOr<std::vector<std::vector<float>>> Run(const model::Model& m,
                                                    const std::vector<SpecRound>& conv,
                                                    model::LayerAttention* attn) {
  model::Forward f(m);
  std::vector<float> logits(m.config().vocab_size);
  std::vector<std::vector<float>> out;
  int pos = 0;
  for (const SpecRound& r : conv) {
    KVT_RETURN_IF_ERROR(f.Run(r.prefill, pos, attn, logits.data()));
    pos += static_cast<int>(r.prefill.size());
    for (int t : r.decode) {
      out.push_back(logits);
      KVT_RETURN_IF_ERROR(f.Run({t}, pos++, attn, logits.data()));
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<spec::SkewModel> CalibrateSkew(const model::Model& m,
                                              const std::vector<std::vector<int>>& sequences,
                                              double ratio, const std::string& name,
                                              CalibrationReport* report) {
  const model::ModelConfig& c = m.config();
  if (sequences.empty()) return absl::InvalidArgumentError("no calibration sequence");
  const int d = c.head_dim(), hq = c.n_heads, hkv = c.n_kv_heads;
  std::vector<std::vector<float>> q(c.n_layers), k(c.n_layers);
  std::vector<std::vector<float>> q0, k0, v0;  // The first sequence, for the invariance check.
  int64_t tokens = 0;
  for (size_t i = 0; i < sequences.size(); ++i) {
    Capture cap(c);
    model::Forward f(m);
    KVT_RETURN_IF_ERROR(f.Run(sequences[i], 0, &cap, nullptr));
    tokens += static_cast<int64_t>(sequences[i].size());
    for (int l = 0; l < c.n_layers; ++l) {
      q[l].insert(q[l].end(), cap.q()[l].begin(), cap.q()[l].end());
      k[l].insert(k[l].end(), cap.k()[l].begin(), cap.k()[l].end());
    }
    if (i == 0) {
      q0 = std::move(cap.q());
      k0 = std::move(cap.k());
      v0 = std::move(cap.v());
    }
  }
  spec::SkewModel s;
  s.model = name;
  s.layers = c.n_layers;
  s.q_heads = hq;
  s.kv_heads = hkv;
  s.head_dim = d;
  s.partial_ratio = ratio;
  s.calibration_tokens = tokens;
  CalibrationReport rep;
  rep.tokens = tokens;
  const int r = spec::PartialColumns(ratio, d);
  for (int l = 0; l < c.n_layers; ++l) {
    KVT_ASSIGN_OR_RETURN(std::vector<spec::SkewHead> heads,
                         spec::CalibrateLayer(q[l].data(), k[l].data(), tokens, hq, hkv, d, ratio));
    // Invariance: attention with skewed q and k against unskewed.
    const int64_t t0 = static_cast<int64_t>(sequences[0].size());
    std::vector<float> qs(q0[l].size()), ks(k0[l].size());
    for (int64_t t = 0; t < t0; ++t) {
      for (int h = 0; h < hq; ++h) {
        spec::Skew(heads[h / (hq / hkv)], d, &q0[l][(t * hq + h) * d], &qs[(t * hq + h) * d]);
      }
      for (int h = 0; h < hkv; ++h) {
        spec::Skew(heads[h], d, &k0[l][(t * hkv + h) * d], &ks[(t * hkv + h) * d]);
      }
    }
    const std::vector<double> a = Causal(q0[l].data(), k0[l].data(), v0[l].data(), t0, hq, hkv, d);
    const std::vector<double> b = Causal(qs.data(), ks.data(), v0[l].data(), t0, hq, hkv, d);
    double e2 = 0, r2 = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      e2 += (a[i] - b[i]) * (a[i] - b[i]);
      r2 += a[i] * a[i];
    }
    rep.invariance_err.push_back(r2 > 0 ? std::sqrt(e2 / r2) : 0);
    // Energy of the partial columns, skewed and raw.
    std::vector<double> raw(d, 0.0);
    double total = 0, part = 0;
    std::vector<float> sk(d);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int h = 0; h < hq; ++h) {
        const float* x = &q[l][(t * hq + h) * d];
        const spec::SkewHead& sh = heads[h / (hq / hkv)];
        spec::Skew(sh, d, x, sk.data());
        for (int j = 0; j < d; ++j) {
          raw[j] += static_cast<double>(x[j]) * x[j];
          total += static_cast<double>(x[j]) * x[j];
        }
        for (int32_t j : sh.partial) part += static_cast<double>(sk[j]) * sk[j];
      }
    }
    std::sort(raw.begin(), raw.end(), std::greater<double>());
    double raw_part = 0;
    for (int j = 0; j < r; ++j) raw_part += raw[j];
    rep.energy_skewed.push_back(total > 0 ? part / total : 0);
    rep.energy_raw.push_back(total > 0 ? raw_part / total : 0);
    s.heads.push_back(std::move(heads));
  }
  if (report != nullptr) *report = std::move(rep);
  return s;
}

absl::StatusOr<SpecResult> EvaluateSpeculation(const model::Model& m, const spec::SkewModel& skew,
                                               const std::vector<std::vector<SpecRound>>& convs,
                                               const spec::SpeculationParams& p,
                                               bool oracle_query) {
  const model::ModelConfig& c = m.config();
  if (skew.layers != c.n_layers || skew.q_heads != c.n_heads || skew.kv_heads != c.n_kv_heads ||
      skew.head_dim != c.head_dim()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the skew file is for ", skew.layers, " layers x ", skew.q_heads, "/", skew.kv_heads,
        " heads x ", skew.head_dim, " (", skew.model, "), the model has ", c.n_layers, " layers x ",
        c.n_heads, "/", c.n_kv_heads, " heads x ", c.head_dim()));
  }
  if (!(p.alpha > 0) || p.budget < 0) {
    return absl::InvalidArgumentError("alpha must be > 0 and the budget >= 0");
  }
  SpecResult r;
  r.params = p;
  r.partial_ratio = skew.partial_ratio;
  r.layers.resize(c.n_layers);
  double err2 = 0, ref2 = 0;
  int64_t agree = 0;
  for (const std::vector<SpecRound>& conv : convs) {
    model::FullCacheAttention full(c);
    model::PerTokenLayerAttention dense(c, &full);
    KVT_ASSIGN_OR_RETURN(auto ref, Run(m, conv, &dense));
    Speculating s(c, skew, p, oracle_query, &r);
    KVT_ASSIGN_OR_RETURN(auto got, Run(m, conv, &s));
    for (size_t i = 0; i < ref.size(); ++i) {
      agree +=
          model::Argmax(ref[i].data(), c.vocab_size) == model::Argmax(got[i].data(), c.vocab_size);
      r.kl += model::KlDivergence(model::Softmax(ref[i].data(), c.vocab_size),
                                  model::Softmax(got[i].data(), c.vocab_size));
      ++r.positions;
    }
    err2 += s.err2();
    ref2 += s.ref2();
  }
  for (SpecLayerStats& l : r.layers) {
    if (l.steps == 0) continue;
    l.hit /= static_cast<double>(l.steps);
    l.mass /= static_cast<double>(l.steps);
    l.n /= static_cast<double>(l.steps);
  }
  if (r.positions > 0) {
    r.top1 = static_cast<double>(agree) / r.positions;
    r.kl /= static_cast<double>(r.positions);
    r.bytes_dense /= static_cast<double>(r.positions);
    r.bytes_speculative /= static_cast<double>(r.positions);
  }
  r.attn_rel_err = ref2 > 0 ? std::sqrt(err2 / ref2) : 0;
  return r;
}

}  // namespace kvtier::eval
