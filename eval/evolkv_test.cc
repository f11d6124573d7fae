#include "eval/evolkv.h"

#include <cmath>
#include <memory>
#include <numeric>
#include <random>

#include "eval/eviction_eval.h"
#include "gtest/gtest.h"
#include "model/export.h"
#include "model/model.h"
#include "testing/test_util.h"
#include "tests/util/status_matchers.h"

namespace kvtier::eval {
namespace {

TEST(EvolKvTest, CacheScore) {
  EXPECT_EQ(CacheScore({32, 64, 96}, 64, 0.5), 1.0);
  const double over = CacheScore({64, 96, 128}, 64, 0.5);
  EXPECT_GT(over, 0.0);
  EXPECT_LT(over, 1.0);
  EXPECT_LT(CacheScore({128, 128, 128}, 64, 0.5), over);
}

TEST(EvolKvTest, CompletionHitsTheTotalExactly) {
  for (int64_t total : {100, 160, 200, 333}) {
    const std::vector<int64_t> b = CompleteBudgets({10, 30, 20, 7, 13}, total, 5);
    EXPECT_EQ(std::accumulate(b.begin(), b.end(), int64_t{0}), total);
    for (int64_t x : b) EXPECT_GE(x, 5);
  }
  // Proportional: a layer with 3x the budget keeps about 3x after scaling.
  const std::vector<int64_t> c = CompleteBudgets({10, 30}, 80, 1);
  EXPECT_EQ(c[0], 20);
  EXPECT_EQ(c[1], 60);
}

// stories260K's weights shaped as Gemma 3 (model/forward_test.cc): windows
// of 16 at layers 0, 2 and 4, layers 1 and 3 global.
std::unique_ptr<model::Model> SlidingModel(const std::string& path, const testing::TempDir& dir) {
  auto bin = model::Model::Load(path);
  if (!bin.ok()) return nullptr;
  model::ExportOptions o;
  o.arch = "gemma3";
  o.gemma3_window = 16;
  o.gemma3_global_every = 2;
  if (!model::ExportGguf(**bin, o, dir.path() + "/w16.gguf").ok()) return nullptr;
  auto m = model::Model::Load(dir.path() + "/w16.gguf");
  return m.ok() ? std::move(*m) : nullptr;
}

std::vector<std::vector<int>> Sequences(const model::Model& m, int n, int len) {
  std::vector<std::vector<int>> out;
  for (int i = 0; i < n; ++i) out.push_back(*model::SampleTokens(m, len, 11 + i));
  return out;
}

evict::Policy Profile(std::vector<int64_t> budgets) {
  evict::Policy p;
  p.method = evict::Method::kProfile;
  p.layer_budgets = std::move(budgets);
  p.budget = *std::max_element(p.layer_budgets.begin(), p.layer_budgets.end());
  p.score.window = 2;
  p.profile_name = "test";
  return p;
}

// A sliding layer is never evicted, as the worker spares it: budgets of 3
// there change nothing while the global layers keep the whole prompt; the
// same budgets at a global layer do. Evaluate leaves the prompt's state as it
// was, and EvalEvictionOnModel is the same computation.
TEST(ModelEvictionEvalTest, SparesSlidingLayersAndReusesThePrompt) {
  KVT_REQUIRE_SHARED_MODEL(path);
  testing::TempDir dir;
  std::unique_ptr<model::Model> m = SlidingModel(path, dir);
  ASSERT_NE(m, nullptr);
  ASSERT_EQ(m->config().window, (std::vector<int>{16, 0, 16, 0, 16}));
  const auto seqs = Sequences(*m, 2, 48);
  KVT_ASSERT_OK_AND_ASSIGN(ModelEvictionEval e, ModelEvictionEval::Create(*m, seqs, 32));
  KVT_ASSERT_OK_AND_ASSIGN(ModelFidelity sliding_small, e.Evaluate(Profile({3, 32, 3, 32, 3})));
  EXPECT_LT(sliding_small.kl, 1e-9) << sliding_small.kl;
  EXPECT_EQ(sliding_small.top1, 1.0);
  KVT_ASSERT_OK_AND_ASSIGN(ModelFidelity global_small, e.Evaluate(Profile({32, 3, 32, 3, 32})));
  EXPECT_GT(global_small.kl, 1e-5);
  // Kept: 16 of 32 at each sliding layer (its window), 3 at each global one.
  EXPECT_NEAR(global_small.kept_fraction, (3 * 16.0 + 2 * 3.0) / (5 * 32.0), 1e-9);
  KVT_ASSERT_OK_AND_ASSIGN(ModelFidelity again, e.Evaluate(Profile({32, 3, 32, 3, 32})));
  EXPECT_EQ(again.kl, global_small.kl);
  KVT_ASSERT_OK_AND_ASSIGN(ModelFidelity once,
                           EvalEvictionOnModel(*m, seqs, 32, Profile({32, 3, 32, 3, 32})));
  EXPECT_EQ(once.kl, global_small.kl);
  EXPECT_EQ(once.top1, global_small.top1);
}

// Gemma 3's heads are wider than its residual stream (4 x 256 > 640): the
// harness keeps each position's q_dim query values, and evicts with the
// same tokens SelectTokens picks from the head-major queries and keys.
TEST(ModelEvictionEvalTest, QueriesWiderThanTheResidualStream) {
  model::ModelConfig c;
  c.dim = 8;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.key_length = 16;  // q_dim 32, four times dim.
  c.n_layers = 1;
  const int n = 24, qd = c.q_dim(), hd = c.head_dim();
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<size_t>(n + 1) * qd), k(static_cast<size_t>(n + 1) * hd),
      v(k.size());
  for (float& x : q) x = nd(rng);
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  KVT_ASSERT_OK_AND_ASSIGN(evict::Policy p, evict::ParsePolicy("snapkv:6:w=2:k=1"));
  EvictingAttention ev(c, p, n);
  std::vector<float> out(qd);
  for (int t = 0; t <= n; ++t) {
    ASSERT_TRUE(ev.Attend(0, t, &q[t * qd], &k[t * hd], &v[t * hd], out.data()).ok());
  }
  std::vector<float> qm(static_cast<size_t>(c.n_heads) * n * hd);
  for (int t = 0; t < n; ++t) {
    for (int h = 0; h < c.n_heads; ++h) {
      std::copy_n(&q[t * qd + h * hd], hd, &qm[(h * n + t) * hd]);
    }
  }
  KVT_ASSERT_OK_AND_ASSIGN(
      auto keep, evict::SelectTokens(p, 0, 1, {c.n_heads, 1, hd, n, qm.data(), k.data()}));
  EXPECT_EQ(ev.kept()[0], static_cast<int64_t>(keep[0].size()));
  // The output over the kept tokens plus the new one, in float64.
  std::vector<int64_t> toks = keep[0];
  toks.push_back(n);
  for (int h = 0; h < c.n_heads; ++h) {
    std::vector<double> w;
    double best = -INFINITY, z = 0;
    for (int64_t t : toks) {
      double acc = 0;
      for (int i = 0; i < hd; ++i) acc += double(q[n * qd + h * hd + i]) * k[t * hd + i];
      w.push_back(acc / std::sqrt(double(hd)));
      best = std::max(best, w.back());
    }
    for (double& x : w) z += (x = std::exp(x - best));
    for (int i = 0; i < hd; ++i) {
      double o = 0;
      for (size_t j = 0; j < toks.size(); ++j) o += w[j] / z * v[toks[j] * hd + i];
      EXPECT_NEAR(out[h * hd + i], o, 1e-4) << "head " << h << " column " << i;
    }
  }
}

// On a sliding model EvolKV searches the global layers only: the profile
// keeps the mean at the sliding layers and the global layers sum to c times
// their count.
TEST(EvolKvTest, SearchesOnlyTheGlobalLayersOfASlidingModel) {
  KVT_REQUIRE_SHARED_MODEL(path);
  testing::TempDir dir;
  std::unique_ptr<model::Model> m = SlidingModel(path, dir);
  ASSERT_NE(m, nullptr);
  EvolKvOptions o;
  o.mean_budget = 8;
  o.evals_per_group = 6;
  o.prompt = 32;
  std::vector<std::string> log;
  KVT_ASSERT_OK_AND_ASSIGN(EvolKvResult r,
                           SearchLayerBudgets(*m, Sequences(*m, 2, 48), o,
                                              [&](const std::string& s) { log.push_back(s); }));
  EXPECT_EQ(r.searched_layers, (std::vector<int>{1, 3}));
  ASSERT_EQ(r.budgets.size(), 5u);
  EXPECT_EQ(r.budgets[0], 8);
  EXPECT_EQ(r.budgets[2], 8);
  EXPECT_EQ(r.budgets[4], 8);
  EXPECT_EQ(r.budgets[1] + r.budgets[3], 16);
  EXPECT_GT(r.evals, 2);
  EXPECT_LE(r.evals, 2 * 6 + 2);
  EXPECT_GT(r.uniform_kl, 0.0);
  ASSERT_FALSE(log.empty());
  EXPECT_NE(log.front().find("searching layers 1 3"), std::string::npos) << log.front();
}

}  // namespace
}  // namespace kvtier::eval
