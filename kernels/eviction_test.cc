#include "kernels/eviction.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/status_matchers.h"

namespace kvtier::evict {
namespace {

using ::kvtier::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(BudgetTest, Validation) {
  EXPECT_THAT(ValidateBudget(0, 0), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ValidateBudget(-5, 0), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ValidateBudget(32, 32), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(ValidateBudget(64, 32).ok());
  const std::vector<float> s(8, 1.0f);
  EXPECT_THAT(AdaKvBudgets(s, 2, 4, 2, 1.5), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(AdaKvBudgets(s, 2, 4, 2, -0.1), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(BudgetTest, PyramidFollowsTheSpec) {
  // B = 64, w = 32: B' = 32, min = 32 // 20 = 1, max = 63, step = 62 // 4 = 15.
  KVT_ASSERT_OK_AND_ASSIGN(auto b, PyramidBudgets(64, 32, 20, 5, 10000));
  EXPECT_THAT(b, ElementsAre(63, 48, 33, 18, 3));
  // Short sequence: max clamps to T - w and min follows.
  KVT_ASSERT_OK_AND_ASSIGN(auto c, PyramidBudgets(64, 32, 20, 5, 80));
  EXPECT_EQ(c[0], 48);
  EXPECT_EQ(c[4], 16);
}

TEST(BudgetTest, BudgetLargerThanTheSequenceKeepsEverything) {
  const std::vector<float> s = {0.1f, 0.5f, 0.2f};
  EXPECT_THAT(SelectTopK(s.data(), 3, 10, 2), ElementsAre(0, 1, 2, 3, 4));
  EXPECT_THAT(SelectTopK(s.data(), 3, 1, 2), ElementsAre(1, 3, 4));
  KVT_ASSERT_OK_AND_ASSIGN(auto b, AdaKvBudgets({0.1f, 0.2f, 0.3f, 0.4f}, 2, 2, 5, 0.2));
  EXPECT_THAT(b, ElementsAre(2, 2));
  EXPECT_THAT(StreamingSelect(10, 4, 3), ElementsAre(0, 1, 2, 3, 7, 8, 9));
  EXPECT_EQ(StreamingSelect(5, 4, 3).size(), 5u);
}

// Ada-KV Theorem: the L1 eviction loss is bounded by eps = 2C(h - sum of kept
// attention weights). Ada-KV's split keeps at least as much attention mass
// as the uniform split at the same total budget, so eps* <= eps'. Checked on
// random heads of very different concentration.
TEST(AdaKvTest, BoundNeverWorseThanUniform) {
  std::mt19937 rng(5);
  std::normal_distribution<double> nd;
  std::uniform_real_distribution<double> temp(0.1, 8.0);
  for (int trial = 0; trial < 500; ++trial) {
    const int heads = 1 + static_cast<int>(rng() % 8);
    const int64_t n = 8 + static_cast<int64_t>(rng() % 200);
    const int64_t bp = 1 + static_cast<int64_t>(rng() % n);
    std::vector<float> a(static_cast<size_t>(heads) * n);
    for (int h = 0; h < heads; ++h) {
      const double t = temp(rng);
      double z = 0;
      for (int64_t j = 0; j < n; ++j)
        z += (a[h * n + j] = static_cast<float>(std::exp(t * nd(rng))));
      for (int64_t j = 0; j < n; ++j) a[h * n + j] = static_cast<float>(a[h * n + j] / z);
    }
    auto kept_mass = [&](const std::vector<int64_t>& budget) {
      double m = 0;
      for (int h = 0; h < heads; ++h) {
        for (int64_t j : SelectTopK(a.data() + h * n, n, budget[h], 0)) m += a[h * n + j];
      }
      return m;
    };
    const double uniform = kept_mass(std::vector<int64_t>(heads, bp));
    for (double alpha : {0.0, 0.2, 0.5}) {
      KVT_ASSERT_OK_AND_ASSIGN(auto b, AdaKvBudgets(a, heads, n, bp, alpha));
      EXPECT_EQ(std::accumulate(b.begin(), b.end(), int64_t{0}), heads * std::min(bp, n));
      const double eps_ada = 2.0 * (heads - kept_mass(b));
      const double eps_uniform = 2.0 * (heads - uniform);
      ASSERT_LE(eps_ada, eps_uniform + 1e-5) << "trial " << trial << " alpha " << alpha;
    }
  }
}

TEST(ScoresTest, ObservationScoresFindTheAttendedTokens) {
  // 2 KV heads, 4 query heads, d = 4, T = 40, w = 8: every query points at
  // token 5 (head 0) or token 20 (head 1).
  const int qh = 4, kvh = 2, d = 4;
  const int64_t t = 40;
  std::vector<float> q(qh * t * d, 0.0f), k(kvh * t * d, 0.0f);
  for (int64_t j = 0; j < t; ++j) {
    k[(0 * t + j) * d + 0] = j == 5 ? 4.0f : 0.1f;
    k[(1 * t + j) * d + 1] = j == 20 ? 4.0f : 0.1f;
  }
  for (int h = 0; h < qh; ++h) {
    for (int64_t i = 0; i < t; ++i) q[(h * t + i) * d + (h < 2 ? 0 : 1)] = 3.0f;
  }
  LayerQK x{qh, kvh, d, t, q.data(), k.data()};
  ScoreOptions o;
  o.window = 8;
  o.pooling = Pooling::kNone;
  KVT_ASSERT_OK_AND_ASSIGN(std::vector<float> s, ObservationScores(o, x));
  ASSERT_EQ(s.size(), 2u * 32);
  EXPECT_EQ(std::max_element(s.begin(), s.begin() + 32) - s.begin(), 5);
  EXPECT_EQ(std::max_element(s.begin() + 32, s.end()) - s.begin() - 32, 20);
  o.pooling = Pooling::kMax;
  KVT_ASSERT_OK_AND_ASSIGN(std::vector<float> p, ObservationScores(o, x));
  EXPECT_EQ(p[2], p[5]);  // Max pooling with kernel 7 spreads the peak to +-3.
  EXPECT_LT(p[1], p[5]);
  KVT_ASSERT_OK_AND_ASSIGN(std::vector<float> h2o, H2oScores(x, GqaReduce::kMean));
  EXPECT_EQ(std::max_element(h2o.begin(), h2o.begin() + t) - h2o.begin(), 5);
  // Oracle window: future queries of head 0's group that point at token 30
  // (channel 2) move its top score there; head 1's stay on token 20.
  for (int64_t j = 0; j < t; ++j) k[(0 * t + j) * d + 2] = j == 30 ? 4.0f : 0.1f;
  const int64_t nf = 3;
  std::vector<float> fq(qh * nf * d, 0.0f);
  for (int h = 0; h < qh; ++h) {
    for (int64_t i = 0; i < nf; ++i) fq[(h * nf + i) * d + (h < 2 ? 2 : 1)] = 3.0f;
  }
  LayerQK oracle = x;
  oracle.future_q = fq.data();
  oracle.future_queries = nf;
  o.pooling = Pooling::kNone;
  KVT_ASSERT_OK_AND_ASSIGN(std::vector<float> os, ObservationScores(o, oracle));
  ASSERT_EQ(os.size(), 2u * 32);
  EXPECT_EQ(std::max_element(os.begin(), os.begin() + 32) - os.begin(), 30);
  EXPECT_EQ(std::max_element(os.begin() + 32, os.end()) - os.begin() - 32, 20);
  // A future query's softmax runs over all T keys, so the window keys take a
  // share and the scored keys' mass stays below 1.
  double mass = 0;
  for (int j = 0; j < 32; ++j) mass += os[j];
  EXPECT_GT(mass, 0.5);
  EXPECT_LT(mass, 1.0);
  o.kernel = 4;
  EXPECT_THAT(ObservationScores(o, x), StatusIs(absl::StatusCode::kInvalidArgument));
  LayerQK bad = x;
  bad.q_heads = 3;
  EXPECT_THAT(H2oScores(bad, GqaReduce::kMean), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(EvictionLossTest, ZeroWhenEverythingIsKeptAndGrowsAsBudgetsShrink) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  const int qh = 8, kvh = 2, d = 16;
  const int64_t t = 100;
  std::vector<float> q(qh * d), k(kvh * t * d), v(k.size());
  for (float& x : q) x = 2.0f * nd(rng);
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  std::vector<std::vector<int64_t>> all(kvh);
  for (auto& h : all) {
    for (int64_t i = 0; i < t; ++i) h.push_back(i);
  }
  KVT_ASSERT_OK_AND_ASSIGN(EvictionError none,
                           EvictionLoss(qh, kvh, d, t, q.data(), k.data(), v.data(), all));
  EXPECT_LT(none.l1, 1e-4);
  double prev = 0;
  for (int64_t keep : {60, 30, 10}) {
    std::vector<std::vector<int64_t>> some(kvh);
    for (auto& h : some) {
      for (int64_t i = t - keep; i < t; ++i) h.push_back(i);
    }
    KVT_ASSERT_OK_AND_ASSIGN(EvictionError e,
                             EvictionLoss(qh, kvh, d, t, q.data(), k.data(), v.data(), some));
    EXPECT_GT(e.l1, prev);
    EXPECT_GT(e.rel, 0.0);
    prev = e.l1;
  }
}

TEST(PolicyTest, ParsesSelectsAndRejects) {
  using ::testing::HasSubstr;
  KVT_ASSERT_OK_AND_ASSIGN(Policy p, ParsePolicy("ada-snapkv:64:w=8:alpha=0.5:pool=avg"));
  EXPECT_EQ(p.method, Method::kAdaSnapKv);
  EXPECT_EQ(p.budget, 64);
  EXPECT_EQ(p.score.window, 8);
  EXPECT_EQ(p.score.pooling, Pooling::kAvg);
  EXPECT_EQ(PolicyName(p), "ada-snapkv:64");
  EXPECT_THAT(ParsePolicy("snapkv:0"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParsePolicy("snapkv:-3"), StatusIs(absl::StatusCode::kInvalidArgument));
  // Without :w= the window is min(32, B/4); a window given that does not
  // fit is refused with a suggestion.
  for (const auto& [text, window] :
       std::vector<std::pair<std::string, int>>{{"snapkv:16", 4},
                                                {"snapkv:256", 32},
                                                {"ada-snapkv:32", 8},
                                                {"pyramidkv:2", 1},
                                                {"ada-pyramidkv:64", 16}}) {
    KVT_ASSERT_OK_AND_ASSIGN(Policy dp, ParsePolicy(text));
    EXPECT_EQ(dp.score.window, window) << text;
  }
  EXPECT_THAT(ParsePolicy("snapkv:16:w=32"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'snapkv:16:w=4'")));
  EXPECT_THAT(ParsePolicy("snapkv:1"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParsePolicy("ada-snapkv:64:alpha=2"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParsePolicy("lru:64"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParsePolicy("snapkv"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParsePolicy("profile:/nonexistent"), StatusIs(absl::StatusCode::kNotFound));

  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  const int qh = 4, kvh = 2, d = 8, layers = 3;
  const int64_t t = 60;
  std::vector<float> q(qh * t * d), k(kvh * t * d);
  for (float& x : q) x = nd(rng);
  for (float& x : k) x = nd(rng);
  const LayerQK x{qh, kvh, d, t, q.data(), k.data()};
  for (const char* text : {"streaming:20", "h2o:20", "snapkv:20:w=4", "pyramidkv:20:w=4",
                           "ada-snapkv:20:w=4", "ada-pyramid:20:w=4"}) {
    KVT_ASSERT_OK_AND_ASSIGN(Policy pol, ParsePolicy(text));
    int64_t total = 0;
    for (int l = 0; l < layers; ++l) {
      KVT_ASSERT_OK_AND_ASSIGN(auto keep, SelectTokens(pol, l, layers, x));
      ASSERT_EQ(keep.size(), 2u);
      for (const auto& h : keep) {
        ASSERT_TRUE(std::is_sorted(h.begin(), h.end()));
        EXPECT_EQ(h.back(), t - 1) << text;  // The newest token always stays.
        total += static_cast<int64_t>(h.size());
      }
    }
    // Same mean budget for every method: 20 per head per layer.
    EXPECT_EQ(total, 20 * 2 * layers) << text;
  }
  KVT_ASSERT_OK_AND_ASSIGN(Policy big, ParsePolicy("snapkv:100:w=4"));
  KVT_ASSERT_OK_AND_ASSIGN(auto all, SelectTokens(big, 0, layers, x));
  EXPECT_EQ(all[0].size(), static_cast<size_t>(t));
  // Streaming and none select by position: a holder that kept no queries
  // or keys (QueriesRead is 0) passes none. A scoring method needs them.
  const LayerQK bare{qh, kvh, d, t, nullptr, nullptr};
  KVT_ASSERT_OK_AND_ASSIGN(Policy streaming, ParsePolicy("streaming:20"));
  KVT_ASSERT_OK_AND_ASSIGN(auto by_position, SelectTokens(streaming, 0, layers, bare));
  KVT_ASSERT_OK_AND_ASSIGN(auto with_data, SelectTokens(streaming, 0, layers, x));
  EXPECT_EQ(by_position, with_data);
  KVT_ASSERT_OK_AND_ASSIGN(Policy snap, ParsePolicy("snapkv:20:w=4"));
  EXPECT_THAT(SelectTokens(snap, 0, layers, bare).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no queries, no keys")));
}

TEST(PolicyTest, LayerProfileFiles) {
  const std::string path = ::testing::TempDir() + "/profile.txt";
  ASSERT_TRUE(SaveLayerProfile(path, "evolkv-test", {40, 24, 16}).ok());
  KVT_ASSERT_OK_AND_ASSIGN(Policy p, ParsePolicy("profile:" + path + ":w=8"));
  EXPECT_EQ(p.method, Method::kProfile);
  EXPECT_THAT(p.layer_budgets, ElementsAre(40, 24, 16));
  EXPECT_EQ(PolicyName(p), "profile:evolkv-test");
  {
    std::ofstream f(path);
    f << "budgets 1 2\n";
  }
  EXPECT_THAT(LoadLayerProfile(path), StatusIs(absl::StatusCode::kInvalidArgument));
  std::remove(path.c_str());
}

}  // namespace
}  // namespace kvtier::evict
