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

absl::StatusOr<EvictingAttention> EvictingAttention::WithPolicy(evict::Policy p) const {
  if (evicted_) {
    return absl::FailedPreconditionError("WithPolicy: this backend has already evicted");
  }
  EvictingAttention e(c_, std::move(p), prompt_);
  e.full_ = full_;
  e.q_ = q_;
  return e;
}

absl::Status EvictingAttention::Attend(int layer, int pos, const float* q, const float* k,
                                       const float* v, float* out) {
  const int window = c_.layer_window(layer);
  if (pos < prompt_ || window > 0) {
    if (pos < prompt_ && window == 0) q_[layer].insert(q_[layer].end(), q, q + c_.q_dim());
    if (pos == prompt_ && window > 0) {
      kept_[layer] = static_cast<int64_t>(c_.n_kv_heads) * std::min(window, prompt_);
    }
    return full_.Attend(layer, pos, q, k, v, out);
  }
  evicted_ = true;
  const int hd = c_.head_dim(), kvh = c_.n_kv_heads, qh = c_.n_heads, kv = c_.kv_dim();
  if (flat_[layer] == nullptr) {
    // Evict once: head-major copies of the prompt's queries and keys.
    const int64_t n = prompt_;
    std::vector<float> qm(static_cast<size_t>(qh) * n * hd), km(static_cast<size_t>(kvh) * n * hd),
        vm(km.size());
    for (int64_t t = 0; t < n; ++t) {
      for (int h = 0; h < qh; ++h)
        std::copy_n(q_[layer].begin() + t * c_.q_dim() + h * hd, hd, qm.begin() + (h * n + t) * hd);
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

absl::StatusOr<ModelEvictionEval> ModelEvictionEval::Create(
    const model::Model& m, const std::vector<std::vector<int>>& seqs, int prompt_len) {
  const model::ModelConfig& c = m.config();
  ModelEvictionEval r(m, prompt_len);
  std::vector<float> logits(c.vocab_size);
  for (const std::vector<int>& seq : seqs) {
    if (static_cast<int>(seq.size()) <= prompt_len + 1) {
      return absl::InvalidArgumentError("sequences must be longer than the prompt");
    }
    Sequence s{seq, EvictingAttention(c, evict::Policy{}, prompt_len), {}, {}};
    model::FullCacheAttention full(c);
    model::Forward f(m);
    for (size_t pos = 0; pos + 1 < seq.size(); ++pos) {
      const bool scored = static_cast<int>(pos) >= prompt_len;
      KVT_RETURN_IF_ERROR(
          f.Step(seq[pos], static_cast<int>(pos), &full, scored ? logits.data() : nullptr));
      if (!scored) continue;
      s.full_p.push_back(model::Softmax(logits.data(), c.vocab_size));
      s.full_top.push_back(model::Argmax(logits.data(), c.vocab_size));
    }
    model::Forward fp(m);
    for (int pos = 0; pos < prompt_len; ++pos) {
      KVT_RETURN_IF_ERROR(fp.Step(seq[pos], pos, &s.prompted, nullptr));
    }
    r.seqs_.push_back(std::move(s));
  }
  return r;
}

absl::StatusOr<ModelFidelity> ModelEvictionEval::Evaluate(const evict::Policy& p) const {
  const model::ModelConfig& c = m_->config();
  ModelFidelity r;
  int64_t n = 0, agree = 0;
  double kept = 0;
  std::vector<float> le(c.vocab_size);
  for (const Sequence& s : seqs_) {
    KVT_ASSIGN_OR_RETURN(EvictingAttention ev, s.prompted.WithPolicy(p));
    model::Forward fe(*m_);
    for (size_t pos = prompt_; pos + 1 < s.tokens.size(); ++pos) {
      KVT_RETURN_IF_ERROR(fe.Step(s.tokens[pos], static_cast<int>(pos), &ev, le.data()));
      const size_t i = pos - prompt_;
      r.kl += model::KlDivergence(s.full_p[i], model::Softmax(le.data(), c.vocab_size));
      agree += s.full_top[i] == model::Argmax(le.data(), c.vocab_size);
      ++n;
    }
    for (int64_t k : ev.kept())
      kept += static_cast<double>(k) / (static_cast<double>(c.n_kv_heads) * c.n_layers * prompt_);
  }
  if (n == 0) return absl::InvalidArgumentError("no sequences to evaluate");
  r.kl /= n;
  r.top1 = static_cast<double>(agree) / n;
  r.kept_fraction = kept / seqs_.size();
  return r;
}

absl::StatusOr<ModelFidelity> EvalEvictionOnModel(const model::Model& m,
                                                  const std::vector<std::vector<int>>& seqs,
                                                  int prompt_len, const evict::Policy& p) {
  KVT_ASSIGN_OR_RETURN(ModelEvictionEval e, ModelEvictionEval::Create(m, seqs, prompt_len));
  return e.Evaluate(p);
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
