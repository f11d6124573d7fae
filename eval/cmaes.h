// CMA-ES (Hansen's covariance matrix adaptation evolution strategy, the
// standard (mu/mu_w, lambda) form with rank-one and rank-mu updates and
// cumulative step-size adaptation), small and self-contained. Used by the
// EvolKV layer-budget search (ALGORITHMS.md §2). Minimizes.
#ifndef KVTIER_EVAL_CMAES_H_
#define KVTIER_EVAL_CMAES_H_

#include <cstdint>
#include <functional>
#include <vector>

namespace kvtier::eval {

struct CmaesOptions {
  double sigma0 = 0.3;   // Initial step size, in the units of x.
  int lambda = 0;        // Population; 0 means 4 + floor(3 ln n).
  int max_evals = 2000;  // Budget of objective evaluations.
  double ftol = 1e-14;   // Stop when the generation's f range falls below this.
  uint64_t seed = 1;     // Same seed, same objective: same result.
  // Optional box bounds: samples are clamped into [lower, upper] before
  // evaluation (and recorded clamped).
  std::vector<double> lower, upper;
};

struct CmaesResult {
  std::vector<double> best_x;
  double best_f = 0;
  int evals = 0;
  int generations = 0;
};

// `progress(generation, best_f)` runs after every generation when set.
CmaesResult CmaesMinimize(const std::function<double(const std::vector<double>&)>& f,
                          std::vector<double> x0, const CmaesOptions& o,
                          const std::function<void(int, double)>& progress = {});

}  // namespace kvtier::eval

#endif  // KVTIER_EVAL_CMAES_H_
