#include "eval/evolkv.h"

#include <numeric>

#include "gtest/gtest.h"

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

}  // namespace
}  // namespace kvtier::eval
