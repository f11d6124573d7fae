// The eviction harness behind `kvtier eval eviction` and the EvolKV search:
// L1 eviction loss and relative attention-output error on traces, and the
// teacher-forced KL / top-1 agreement of a model whose cache was evicted once
// after the prompt's prefill (ALGORITHMS.md §1).
#ifndef KVTIER_EVAL_EVICTION_EVAL_H_
#define KVTIER_EVAL_EVICTION_EVAL_H_

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/eviction.h"
#include "kernels/flat_cache.h"
#include "model/forward.h"
#include "traces/trace.h"

namespace kvtier::eval {

// Full attention up to the prompt, storing every position's queries; at the
// first position past the prompt, each global layer's cache is evicted by the
// policy into a FlatKvCache, which later positions append to and attend over.
// A sliding layer (ModelConfig::layer_window > 0) is never evicted: it keeps
// attending over its window, as the worker spares it (docs/eviction.md).
class EvictingAttention : public model::AttentionBackend {
 public:
  EvictingAttention(const model::ModelConfig& c, evict::Policy p, int prompt_len);
  absl::Status Attend(int layer, int pos, const float* q, const float* k, const float* v,
                      float* out) override;
  // Tokens kept per layer at eviction time (sum over KV heads); a sliding
  // layer counts the prompt tokens inside its window.
  const std::vector<int64_t>& kept() const { return kept_; }
  // A copy of the state so far under another policy, to evict one prompt
  // many ways. FAILED_PRECONDITION once this backend has evicted.
  absl::StatusOr<EvictingAttention> WithPolicy(evict::Policy p) const;

 private:
  model::ModelConfig c_;
  evict::Policy p_;
  int prompt_;
  model::FullCacheAttention full_;
  std::vector<std::vector<float>> q_;  // Per layer, token-major [pos, n_heads * hd].
  std::vector<std::unique_ptr<FlatKvCache>> flat_;
  std::vector<int64_t> kept_;
  bool evicted_ = false;
};

struct ModelFidelity {
  double kl = 0;
  double top1 = 0;
  double kept_fraction = 0;  // Mean kept tokens per head over the prompt length.
};

// The teacher-forced KL and top-1 agreement against the full cache of a
// model whose cache was evicted once after the prompt, over positions
// [prompt_len, len - 1) of each sequence, for many policies: Create runs the
// full cache over each sequence and its prompt through an EvictingAttention
// once, keeping the full cache's next-token distributions (8 * vocab bytes
// per scored position); Evaluate(p) then runs only the scored positions.
// Not thread-safe; `m` must outlive it.
class ModelEvictionEval {
 public:
  static absl::StatusOr<ModelEvictionEval> Create(const model::Model& m,
                                                  const std::vector<std::vector<int>>& seqs,
                                                  int prompt_len);
  absl::StatusOr<ModelFidelity> Evaluate(const evict::Policy& p) const;

 private:
  struct Sequence {
    std::vector<int> tokens;
    EvictingAttention prompted;               // State after the prompt, not yet evicted.
    std::vector<std::vector<double>> full_p;  // Per scored position.
    std::vector<int> full_top;
  };
  ModelEvictionEval(const model::Model& m, int prompt_len) : m_(&m), prompt_(prompt_len) {}
  const model::Model* m_;
  int prompt_;
  std::vector<Sequence> seqs_;
};

// ModelEvictionEval for one policy.
absl::StatusOr<ModelFidelity> EvalEvictionOnModel(const model::Model& m,
                                                  const std::vector<std::vector<int>>& seqs,
                                                  int prompt_len, const evict::Policy& p);

struct TraceFidelity {
  double l1 = 0;   // Mean over decode queries and layers of the summed per-head L1 loss.
  double rel = 0;  // Root mean square over decode queries and layers of ||O - O^||_F / ||O||_F.
};

// Needs the trace's q_tokens (scoring) and q (decode queries).
// oracle: SnapKV-family scores from the trace's decode queries themselves
// (LayerQK::future_q) instead of the observation window.
absl::StatusOr<TraceFidelity> EvalEvictionOnTrace(const traces::KvTrace& t, const evict::Policy& p,
                                                  bool oracle = false);

}  // namespace kvtier::eval

#endif  // KVTIER_EVAL_EVICTION_EVAL_H_
