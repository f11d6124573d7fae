#include "eval/eviction_eval.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace kvtier::eval {

EvictingAttention::EvictingAttention(const model::ModelConfig& c, evict::Policy p, int prompt_len)
    : c_(c),
      p_(std::move(p)),
      prompt_(prompt_len),
      full_(c),
      q_(c.n_layers),
      flat_(c.n_layers),
      kept_(c.n_layers, 0) {}

absl::Status EvictingAttention::Attend(int layer, int pos, const float* q, const float* k,
                                       const float* v, float* out) {
  if (pos < prompt_) {
    q_[layer].insert(q_[layer].end(), q, q + c_.dim);
    return full_.Attend(layer, pos, q, k, v, out);
  }
  const int hd = c_.head_dim(), kvh = c_.n_kv_heads, qh = c_.n_heads, kv = c_.kv_dim();
  if (flat_[layer] == nullptr) {
    // Evict once: head-major copies of the prompt's queries and keys.
    const int64_t n = prompt_;
    std::vector<float> qm(static_cast<size_t>(qh) * n * hd), km(static_cast<size_t>(kvh) * n * hd),
        vm(km.size());
    for (int64_t t = 0; t < n; ++t) {
      for (int h = 0; h < qh; ++h)
        std::copy_n(q_[layer].begin() + t * c_.dim + h * hd, hd, qm.begin() + (h * n + t) * hd);
      for (int h = 0; h < kvh; ++h) {
        std::copy_n(full_.keys(layer).begin() + t * kv + h * hd, hd, km.begin() + (h * n + t) * hd);
        std::copy_n(full_.values(layer).begin() + t * kv + h * hd, hd,
                    vm.begin() + (h * n + t) * hd);
      }
    }
    const evict::LayerQK x{qh, kvh, hd, n, qm.data(), km.data()};
    KVT_ASSIGN_OR_RETURN(auto keep, evict::SelectTokens(p_, layer, c_.n_layers, x));
    for (const auto& h : keep) kept_[layer] += static_cast<int64_t>(h.size());
    KVT_ASSIGN_OR_RETURN(FlatKvCache fc,
                         FlatKvCache::Gather(kvh, hd, n, km.data(), vm.data(), keep));
    flat_[layer] = std::make_unique<FlatKvCache>(std::move(fc));
  }
  // The new token's k/v arrive token-major [kv_heads * hd], as Append wants.
  KVT_RETURN_IF_ERROR(flat_[layer]->Append(k, v));
  return flat_[layer]->Attend(qh, q, out);
}

absl::StatusOr<ModelFidelity> EvalEvictionOnModel(const model::Model& m,
                                                  const std::vector<std::vector<int>>& seqs,
                                                  int prompt_len, const evict::Policy& p) {
  const model::ModelConfig& c = m.config();
  ModelFidelity r;
  int64_t n = 0, agree = 0;
  double kept = 0;
  std::vector<float> lf(c.vocab_size), le(c.vocab_size);
  for (const std::vector<int>& seq : seqs) {
    if (static_cast<int>(seq.size()) <= prompt_len + 1) {
      return absl::InvalidArgumentError("sequences must be longer than the prompt");
    }
    model::FullCacheAttention full(c);
    EvictingAttention ev(c, p, prompt_len);
    model::Forward ff(m), fe(m);
    for (size_t pos = 0; pos + 1 < seq.size(); ++pos) {
      const bool scored = static_cast<int>(pos) >= prompt_len;
      KVT_RETURN_IF_ERROR(
          ff.Step(seq[pos], static_cast<int>(pos), &full, scored ? lf.data() : nullptr));
      KVT_RETURN_IF_ERROR(
          fe.Step(seq[pos], static_cast<int>(pos), &ev, scored ? le.data() : nullptr));
      if (!scored) continue;
      r.kl += model::KlDivergence(model::Softmax(lf.data(), c.vocab_size),
                                  model::Softmax(le.data(), c.vocab_size));
      agree += model::Argmax(lf.data(), c.vocab_size) == model::Argmax(le.data(), c.vocab_size);
      ++n;
    }
    for (int64_t k : ev.kept())
      kept += static_cast<double>(k) / (c.n_kv_heads * c.n_layers * prompt_len);
  }
  r.kl /= n;
  r.top1 = static_cast<double>(agree) / n;
  r.kept_fraction = kept / seqs.size();
  return r;
}

absl::StatusOr<TraceFidelity> EvalEvictionOnTrace(const traces::KvTrace& t, const evict::Policy& p,
                                                  bool oracle) {
  if (t.q_tokens.empty() || t.q.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("trace ", t.name, " has no per-token or decode queries"));
  }
  TraceFidelity r;
  const int d = t.head_dim;
  double num = 0, den = 0;
  int64_t count = 0;
  for (int l = 0; l < t.layers; ++l) {
    evict::LayerQK x{t.q_heads, t.kv_heads, d, t.tokens, t.QT(l, 0), t.K(l, 0)};
    if (oracle) {
      x.future_q = t.Q(l, 0);
      x.future_queries = t.queries;
    }
    KVT_ASSIGN_OR_RETURN(auto keep, evict::SelectTokens(p, l, t.layers, x));
    std::vector<float> q(static_cast<size_t>(t.q_heads) * d);
    for (int64_t i = 0; i < t.queries; ++i) {
      for (int h = 0; h < t.q_heads; ++h) std::copy_n(t.Q(l, h) + i * d, d, q.begin() + h * d);
      KVT_ASSIGN_OR_RETURN(evict::EvictionError e,
                           evict::EvictionLoss(t.q_heads, t.kv_heads, d, t.tokens, q.data(),
                                               t.K(l, 0), t.V(l, 0), keep));
      r.l1 += e.l1;
      // Each query weighs the same: the root mean square of the per-query errors.
      num += e.rel * e.rel;
      den += 1.0;
      ++count;
    }
  }
  r.l1 /= count;
  r.rel = std::sqrt(num / den);
  return r;
}

}  // namespace kvtier::eval
