// EvolKV layer-budget search (ALGORITHMS.md §2): CMA-ES over groups of n_g
// consecutive layers, bottom group first; objective f(S) - lambda * (1 -
// CacheScore(S, c)) with f the negative mean teacher-forced KL against the
// full cache; then budget completion to a total of c * L. On a model with
// sliding-window layers only the global layers are searched (a sliding layer
// is never evicted): groups, CacheScore and completion run over those.
#ifndef KVTIER_EVAL_EVOLKV_H_
#define KVTIER_EVAL_EVOLKV_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/forward.h"

namespace kvtier::eval {

struct EvolKvOptions {
  int64_t mean_budget = 64;  // c: target mean per-head budget (window included).
  int window = 0;            // Observation window; 0 means min(32, c / 4).
  int group_layers = 1;      // n_g.
  double lambda = 1.0;       // Weight of the cache-size penalty.
  double gamma = 0.5;        // Softness of CacheScore above c.
  int evals_per_group = 60;  // CMA-ES objective evaluations per group.
  int prompt = 384;          // Eviction happens after this many tokens.
  uint64_t seed = 1;
};

// CacheScore(S, c): 1 when the mean budget is <= c, exp(-(mean - c) / (gamma * c)) above.
double CacheScore(const std::vector<int64_t>& budgets, int64_t c, double gamma);

// Scales budgets to sum exactly to total (b_i + delta * b_i / A, rounded by
// largest remainder), keeping each >= min_budget.
std::vector<int64_t> CompleteBudgets(const std::vector<int64_t>& budgets, int64_t total,
                                     int64_t min_budget);

struct EvolKvResult {
  std::vector<int64_t> budgets;      // After completion; c at a layer not searched.
  std::vector<int> searched_layers;  // Every layer, or a sliding model's global ones.
  double kl = 0;                     // Mean KL of the final profile on the search sequences.
  double uniform_kl = 0;             // Mean KL of uniform SnapKV at c on the same sequences.
  int evals = 0;
};

// `progress(message)` reports each generation.
absl::StatusOr<EvolKvResult> SearchLayerBudgets(
    const model::Model& m, const std::vector<std::vector<int>>& seqs, const EvolKvOptions& o,
    const std::function<void(const std::string&)>& progress);

}  // namespace kvtier::eval

#endif  // KVTIER_EVAL_EVOLKV_H_
