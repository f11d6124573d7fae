// The eviction harness behind `kvtier eval eviction` and the EvolKV search:
// L1 eviction loss and relative attention-output error on traces, and the
// teacher-forced KL / top-1 agreement of a model whose cache was evicted once
// after the prompt's prefill (ALGORITHMS.md §1).
#ifndef KVTIER_EVAL_EVICTION_EVAL_H_
#define KVTIER_EVAL_EVICTION_EVAL_H_

#include <cmath>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/eviction.h"
#include "kernels/flat_cache.h"
#include "model/forward.h"
#include "traces/trace.h"

namespace kvtier::eval {

// Full attention up to the prompt, storing every position's queries; at the
// first position past the prompt, each layer's cache is evicted by the policy
// into a FlatKvCache, which later positions append to and attend over.
class EvictingAttention : public model::AttentionBackend {
 public:
  EvictingAttention(const model::ModelConfig& c, evict::Policy p, int prompt_len);
  absl::Status Attend(int layer, int pos, const float* q, const float* k, const float* v,
                      float* out) override;
  // Tokens kept per layer at eviction time (sum over KV heads).
  const std::vector<int64_t>& kept() const { return kept_; }

 private:
  model::ModelConfig c_;
  evict::Policy p_;
  int prompt_;
  model::FullCacheAttention full_;
  std::vector<std::vector<float>> q_;  // Per layer, token-major [pos, n_heads * hd].
  std::vector<std::unique_ptr<FlatKvCache>> flat_;
  std::vector<int64_t> kept_;
};

struct ModelFidelity {
  double kl = 0;
  double top1 = 0;
  double kept_fraction = 0;  // Mean kept tokens per head over the prompt length.
};

// Teacher-forced over positions [prompt_len, len - 1) of each sequence.
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
