#include "kernels/flat_cache.h"

#include <cmath>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/status_matchers.h"

namespace kvtier {
namespace {

using ::kvtier::testing::IsOk;
using ::kvtier::testing::StatusIs;
#define KVT_ASSERT_OK(expr) ASSERT_THAT((expr), IsOk())

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> x(n);
  for (float& v : x) v = nd(rng);
  return x;
}

TEST(FlatKvCacheTest, GatherAppendAttendMatchPerHeadDenseAttention) {
  for (int d : {8, 64, 128}) {
    const int kvh = 4, qh = 8;
    const int64_t t = 77;
    const std::vector<float> k = Random(kvh * t * d, 1), v = Random(kvh * t * d, 2);
    std::mt19937 rng(d);
    std::vector<std::vector<int64_t>> keep(kvh);
    for (int h = 0; h < kvh; ++h) {
      for (int64_t i = 0; i < t; ++i) {
        if (rng() % (h + 2) == 0) keep[h].push_back(i);
      }
    }
    keep[3].clear();  // A head that kept nothing still takes appends.
    KVT_ASSERT_OK_AND_ASSIGN(FlatKvCache c,
                             FlatKvCache::Gather(kvh, d, t, k.data(), v.data(), keep));
    // Per-head token lists the cache must equal.
    std::vector<std::vector<float>> hk(kvh), hv(kvh);
    for (int h = 0; h < kvh; ++h) {
      for (int64_t i : keep[h]) {
        hk[h].insert(hk[h].end(), k.begin() + (h * t + i) * d, k.begin() + (h * t + i + 1) * d);
        hv[h].insert(hv[h].end(), v.begin() + (h * t + i) * d, v.begin() + (h * t + i + 1) * d);
      }
    }
    for (int step = 0; step < 5; ++step) {
      const std::vector<float> nk = Random(kvh * d, 10 + step), nv = Random(kvh * d, 20 + step);
      c.Append(nk.data(), nv.data());
      for (int h = 0; h < kvh; ++h) {
        hk[h].insert(hk[h].end(), nk.begin() + h * d, nk.begin() + (h + 1) * d);
        hv[h].insert(hv[h].end(), nv.begin() + h * d, nv.begin() + (h + 1) * d);
      }
    }
    int64_t total = 0;
    for (int h = 0; h < kvh; ++h) {
      ASSERT_EQ(c.head_lens()[h] * d, static_cast<int64_t>(hk[h].size()));
      ASSERT_EQ(c.cu_len()[h], total);
      for (size_t i = 0; i < hk[h].size(); ++i) {
        ASSERT_EQ(c.keys()[c.cu_len()[h] * d + i], hk[h][i]);
        ASSERT_EQ(c.values()[c.cu_len()[h] * d + i], hv[h][i]);
      }
      total += c.head_lens()[h];
    }
    EXPECT_EQ(c.cu_len()[kvh], total);
    const std::vector<float> q = Random(qh * d, 3);
    std::vector<float> vec(qh * d), ref(qh * d), dense(qh * d);
    KVT_ASSERT_OK(c.Attend(qh, q.data(), vec.data(), KernelLevel::kVectorized));
    KVT_ASSERT_OK(c.Attend(qh, q.data(), ref.data(), KernelLevel::kReference));
    for (int h = 0; h < kvh; ++h) {
      const int64_t n = static_cast<int64_t>(hk[h].size()) / d;
      const KvBlock b{EncodedView::Raw(v1::DTYPE_FP32, hk[h].data(), 1, n, d, n * d, d),
                      EncodedView::Raw(v1::DTYPE_FP32, hv[h].data(), 1, n, d, n * d, d)};
      KVT_ASSERT_OK(DecodeAttention({2, 1, d}, q.data() + h * 2 * d, {&b, 1},
                                    dense.data() + h * 2 * d, KernelLevel::kReference));
    }
    for (size_t i = 0; i < ref.size(); ++i) {
      ASSERT_NEAR(vec[i], ref[i], 2e-5 + 2e-4 * std::fabs(ref[i]));
      ASSERT_EQ(ref[i], dense[i]);
    }
  }
}

TEST(FlatKvCacheTest, RejectsBadIndices) {
  const std::vector<float> k(2 * 4 * 8, 1.0f);
  EXPECT_THAT(FlatKvCache::Gather(2, 8, 4, k.data(), k.data(), {{0, 1}, {2, 1}}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(FlatKvCache::Gather(2, 8, 4, k.data(), k.data(), {{0, 4}, {}}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(FlatKvCache::Gather(2, 8, 4, k.data(), k.data(), {{0}}),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace kvtier
