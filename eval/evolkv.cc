#include "eval/evolkv.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "eval/cmaes.h"
#include "eval/eviction_eval.h"

namespace kvtier::eval {

double CacheScore(const std::vector<int64_t>& budgets, int64_t c, double gamma) {
  const double mean =
      static_cast<double>(std::accumulate(budgets.begin(), budgets.end(), int64_t{0})) /
      budgets.size();
  if (mean <= c) return 1.0;
  return std::exp(-(mean - c) / (gamma * c));
}

std::vector<int64_t> CompleteBudgets(const std::vector<int64_t>& budgets, int64_t total,
                                     int64_t min_budget) {
  const double a = static_cast<double>(std::accumulate(budgets.begin(), budgets.end(), int64_t{0}));
  const double delta = static_cast<double>(total) - a;
  std::vector<double> exact(budgets.size());
  std::vector<int64_t> out(budgets.size());
  int64_t sum = 0;
  for (size_t i = 0; i < budgets.size(); ++i) {
    exact[i] = std::max<double>(min_budget, budgets[i] + delta * budgets[i] / a);
    out[i] = static_cast<int64_t>(std::floor(exact[i]));
    sum += out[i];
  }
  // Largest remainders first (or smallest when over), keeping the sum exact.
  std::vector<size_t> idx(budgets.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](size_t x, size_t y) {
    return exact[x] - std::floor(exact[x]) > exact[y] - std::floor(exact[y]);
  });
  for (size_t k = 0; sum < total; k = (k + 1) % idx.size()) {
    ++out[idx[k]];
    ++sum;
  }
  for (size_t k = idx.size(); sum > total;) {
    k = (k + idx.size() - 1) % idx.size();
    if (out[idx[k]] > min_budget) {
      --out[idx[k]];
      --sum;
    }
  }
  return out;
}

absl::StatusOr<EvolKvResult> SearchLayerBudgets(
    const model::Model& m, const std::vector<std::vector<int>>& seqs, const EvolKvOptions& o,
    const std::function<void(const std::string&)>& progress) {
  const model::ModelConfig& c = m.config();
  const int layers = c.n_layers;
  const int w =
      o.window > 0 ? o.window : static_cast<int>(std::min<int64_t>(32, o.mean_budget / 4));
  if (o.mean_budget <= w || o.group_layers < 1 || o.lambda <= 0 || !(o.gamma > 0 && o.gamma <= 1)) {
    return absl::InvalidArgumentError(
        "EvolKV needs budget > window, n_g >= 1, lambda > 0, gamma in (0, 1]");
  }
  EvolKvResult r;
  for (int l = 0; l < layers; ++l) {
    if (c.layer_window(l) == 0) r.searched_layers.push_back(l);
  }
  if (r.searched_layers.empty()) {
    return absl::InvalidArgumentError("every layer slides: there is no layer to evict");
  }
  const int searched = static_cast<int>(r.searched_layers.size());
  progress(absl::StrCat("full cache over ", seqs.size(), " sequences; searching layers ",
                        absl::StrJoin(r.searched_layers, " ")));
  KVT_ASSIGN_OR_RETURN(ModelEvictionEval eval, ModelEvictionEval::Create(m, seqs, o.prompt));
  const int64_t lo = w + 1, hi = o.prompt;
  auto kl_of = [&](const std::vector<int64_t>& b) -> absl::StatusOr<double> {
    evict::Policy p;
    p.method = evict::Method::kProfile;
    p.layer_budgets = b;
    p.budget = *std::max_element(b.begin(), b.end());
    p.score.window = w;
    p.profile_name = "search";
    KVT_ASSIGN_OR_RETURN(ModelFidelity f, eval.Evaluate(p));
    ++r.evals;
    return f.kl;
  };
  // The searched layers' budgets; every other layer keeps the mean (a sliding
  // layer is never evicted, so its entry is unused).
  auto searched_of = [&](const std::vector<int64_t>& b) {
    std::vector<int64_t> s;
    for (int l : r.searched_layers) s.push_back(b[l]);
    return s;
  };
  std::vector<int64_t> budgets(layers, o.mean_budget);
  absl::Status failure;
  for (int g0 = 0; g0 < searched; g0 += o.group_layers) {
    const int g1 = std::min(searched, g0 + o.group_layers);
    const int l0 = r.searched_layers[g0], l1 = r.searched_layers[g1 - 1];
    CmaesOptions co;
    co.sigma0 = std::max<double>(2.0, o.mean_budget / 4.0);
    co.max_evals = o.evals_per_group;
    co.seed = o.seed + static_cast<uint64_t>(l0);
    co.lower.assign(g1 - g0, static_cast<double>(lo));
    co.upper.assign(g1 - g0, static_cast<double>(hi));
    auto objective = [&](const std::vector<double>& x) {
      std::vector<int64_t> b = budgets;
      for (int i = g0; i < g1; ++i) b[r.searched_layers[i]] = std::llround(x[i - g0]);
      auto kl = kl_of(b);
      if (!kl.ok()) {
        failure = kl.status();
        return 1e9;
      }
      return *kl + o.lambda * (1.0 - CacheScore(searched_of(b), o.mean_budget, o.gamma));
    };
    std::vector<double> x0;
    for (int i = g0; i < g1; ++i) x0.push_back(static_cast<double>(budgets[r.searched_layers[i]]));
    const CmaesResult res = CmaesMinimize(objective, x0, co, [&](int gen, double best) {
      progress(absl::StrFormat("layers %d-%d generation %d: best objective %.5f (%d evaluations)",
                               l0, l1, gen, best, r.evals));
    });
    KVT_RETURN_IF_ERROR(failure);
    for (int i = g0; i < g1; ++i) budgets[r.searched_layers[i]] = std::llround(res.best_x[i - g0]);
    progress(absl::StrCat("layers ", l0, "-", l1, " fixed: budgets ",
                          absl::StrJoin(searched_of(budgets), " ")));
  }
  const std::vector<int64_t> done =
      CompleteBudgets(searched_of(budgets), o.mean_budget * searched, lo);
  r.budgets = budgets;
  for (int i = 0; i < searched; ++i) r.budgets[r.searched_layers[i]] = done[i];
  KVT_ASSIGN_OR_RETURN(r.kl, kl_of(r.budgets));
  KVT_ASSIGN_OR_RETURN(r.uniform_kl, kl_of(std::vector<int64_t>(layers, o.mean_budget)));
  return r;
}

}  // namespace kvtier::eval
