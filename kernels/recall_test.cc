#include "kernels/recall.h"

#include <cmath>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/status_matchers.h"

namespace kvtier {
namespace {

using ::kvtier::testing::StatusIs;
using ::testing::ElementsAre;

TEST(RecallTest, ParsesStrategiesAndRejectsBadOnes) {
  KVT_ASSERT_OK_AND_ASSIGN(RecallStrategy all, ParseRecall("all"));
  EXPECT_EQ(all.mode, RecallMode::kAll);
  KVT_ASSERT_OK_AND_ASSIGN(RecallStrategy top, ParseRecall("topk:4"));
  EXPECT_EQ(top.mode, RecallMode::kTopK);
  EXPECT_EQ(RecallName(top), "topk:4");
  KVT_ASSERT_OK_AND_ASSIGN(RecallStrategy ad, ParseRecall("adaptive:0.5"));
  EXPECT_EQ(RecallName(ad), "adaptive:0.5");
  KVT_ASSERT_OK_AND_ASSIGN(RecallStrategy th, ParseRecall("threshold:0.1"));
  EXPECT_EQ(th.mode, RecallMode::kThreshold);
  KVT_ASSERT_OK_AND_ASSIGN(RecallStrategy mass, ParseRecall("mass:0.95"));
  EXPECT_EQ(mass.mode, RecallMode::kMass);
  EXPECT_EQ(RecallName(mass), "mass:0.95");
  for (const char* bad : {"", "topk", "topk:0", "topk:1.5", "threshold:2", "adaptive:x", "best:3",
                          "adaptive:nan", "mass:0", "mass:1.5"}) {
    EXPECT_THAT(ParseRecall(bad), StatusIs(absl::StatusCode::kInvalidArgument)) << bad;
  }
}

TEST(RecallTest, SelectionStrategies) {
  const std::vector<double> s = {0.05, 0.40, 0.05, 0.30, 0.10, 0.10};
  EXPECT_THAT(SelectRounds(s, {RecallMode::kAll, 0}, false), ElementsAre(0, 1, 2, 3, 4, 5));
  EXPECT_THAT(SelectRounds(s, {RecallMode::kTopK, 2}, false), ElementsAre(1, 3));
  // The most recent round (5) joins when keep_recent is set.
  EXPECT_THAT(SelectRounds(s, {RecallMode::kTopK, 2}, true), ElementsAre(1, 3, 5));
  EXPECT_THAT(SelectRounds(s, {RecallMode::kTopK, 10}, false), ElementsAre(0, 1, 2, 3, 4, 5));
  EXPECT_THAT(SelectRounds(s, {RecallMode::kThreshold, 0.1}, false), ElementsAre(1, 3, 4, 5));
  // mean 1/6, population std 0.1344: mean + 1 std = 0.301 leaves only 0.40;
  // mean + 0.9 std = 0.288 keeps 0.30 too.
  EXPECT_THAT(SelectRounds(s, {RecallMode::kAdaptive, 1.0}, false), ElementsAre(1));
  EXPECT_THAT(SelectRounds(s, {RecallMode::kAdaptive, 0.9}, false), ElementsAre(1, 3));
  EXPECT_THAT(SelectRounds(s, {RecallMode::kAdaptive, 2.0}, false), ElementsAre());
  // Ties in top-k go to the more recent round.
  EXPECT_THAT(SelectRounds({0.25, 0.25, 0.25, 0.25}, {RecallMode::kTopK, 1}, false),
              ElementsAre(3));
  EXPECT_THAT(SelectRounds({}, {RecallMode::kTopK, 3}, true), ElementsAre());
  EXPECT_EQ(RoundsForMass(s, 0.95), 5);
  EXPECT_EQ(RoundsForMass(s, 0.70), 2);
  // mass:P is top-k with k = RoundsForMass(scores, P).
  EXPECT_THAT(SelectRounds(s, {RecallMode::kMass, 0.70}, false), ElementsAre(1, 3));
  EXPECT_THAT(SelectRounds(s, {RecallMode::kMass, 0.80}, false), ElementsAre(1, 3, 5));
  EXPECT_THAT(SelectRounds(s, {RecallMode::kMass, 1.0}, false), ElementsAre(0, 1, 2, 3, 4, 5));
}

// QAttention against a longhand computation on a small case: 2 past rounds,
// 1 KV head with 2 query heads, d = 2.
TEST(RecallTest, QAttentionMatchesLonghand) {
  const int d = 2;
  const std::vector<float> r0 = {1, 0, 0, 1}, r1 = {2, 0};  // Round 0: 2 keys; round 1: 1 key.
  const std::vector<float> cur_k = {0, -1, 1, 1};           // Current round: 2 tokens.
  const std::vector<float> q = {1, 0, 0, 1, /*token 1*/ 1, 1, -1, 0};
  std::vector<RoundKeys> rounds(2);
  rounds[0].keys = {r0.data()};
  rounds[0].lens = {2};
  rounds[1].keys = {r1.data()};
  rounds[1].lens = {1};
  const std::vector<double> got = QAttention(2, 1, d, q.data(), 2 * d, 2, rounds, cur_k.data());
  // Longhand.
  const double sc = 1.0 / std::sqrt(2.0);
  double m0 = 0, m1 = 0;
  const float* keys[5] = {&r0[0], &r0[2], &r1[0], &cur_k[0], &cur_k[2]};
  for (int i = 0; i < 2; ++i) {
    for (int h = 0; h < 2; ++h) {
      const float* qi = &q[(i * 2 + h) * d];
      double e[5], z = 0;
      const int n = 3 + i + 1;
      for (int j = 0; j < n; ++j)
        z += (e[j] = std::exp(sc * (qi[0] * keys[j][0] + qi[1] * keys[j][1])));
      m0 += (e[0] + e[1]) / z;
      m1 += e[2] / z;
    }
  }
  ASSERT_EQ(got.size(), 2u);
  EXPECT_NEAR(got[0], m0 / (m0 + m1), 1e-12);
  EXPECT_NEAR(got[1], m1 / (m0 + m1), 1e-12);
}

TEST(RecallTest, QAttentionFindsTheRoundTheQuestionPointsAt) {
  const int qh = 4, kvh = 2, d = 16;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<std::vector<float>> keys(5 * kvh);
  std::vector<RoundKeys> rounds(5);
  for (int r = 0; r < 5; ++r) {
    for (int h = 0; h < kvh; ++h) {
      auto& k = keys[r * kvh + h];
      for (int i = 0; i < 20 * d; ++i) k.push_back(0.3f * nd(rng) + (i % d == r ? 3.0f : 0.0f));
      rounds[r].keys.push_back(k.data());
      rounds[r].lens.push_back(20);
    }
  }
  std::vector<float> q(3 * qh * d, 0.0f), cur(3 * kvh * d, 0.0f);
  for (int i = 0; i < 3; ++i) {
    for (int h = 0; h < qh; ++h) q[(i * qh + h) * d + 3] = 2.0f;  // Round 3's direction.
  }
  const std::vector<double> s = QAttention(qh, kvh, d, q.data(), qh * d, 3, rounds, cur.data());
  EXPECT_EQ(std::max_element(s.begin(), s.end()) - s.begin(), 3);
  EXPECT_NEAR(std::accumulate(s.begin(), s.end(), 0.0), 1.0, 1e-12);
}

}  // namespace
}  // namespace kvtier
