#include "kernels/flat_cache.h"

#include <cmath>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/kv_stream.h"
#include "tests/util/status_matchers.h"

namespace kvtier {
namespace {

using ::kvtier::testing::IsOk;
using ::kvtier::testing::StatusIs;

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> x(n);
  for (float& v : x) v = nd(rng);
  return x;
}

TEST(FlatKvCacheTest, GatherAppendAttendMatchPerHeadDenseAttention) {
  for (int slack : {0, 3, 64})
    for (int d : {8, 64, 128, 256}) {
      SCOPED_TRACE(::testing::Message() << "slack " << slack << " d " << d);
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
      KVT_ASSERT_OK_AND_ASSIGN(FlatKvCache c, FlatKvCache::Gather(kvh, d, t, k.data(), v.data(),
                                                                  keep, {.slack_tokens = slack}));
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
        KVT_ASSERT_OK(c.Append(nk.data(), nv.data()));
        for (int h = 0; h < kvh; ++h) {
          hk[h].insert(hk[h].end(), nk.begin() + h * d, nk.begin() + (h + 1) * d);
          hv[h].insert(hv[h].end(), nv.begin() + h * d, nv.begin() + (h + 1) * d);
        }
      }
      int64_t total = 0;
      std::vector<float> packed_k, packed_v;
      c.Packed(&packed_k, &packed_v);
      for (int h = 0; h < kvh; ++h) {
        ASSERT_EQ(c.head_lens()[h] * d, static_cast<int64_t>(hk[h].size()));
        ASSERT_EQ(c.cu_len()[h], total);
        for (size_t i = 0; i < hk[h].size(); ++i) {
          ASSERT_EQ(c.keys()[c.head_offsets()[h] * d + i], hk[h][i]);
          ASSERT_EQ(c.values()[c.head_offsets()[h] * d + i], hv[h][i]);
          ASSERT_EQ(packed_k[c.cu_len()[h] * d + i], hk[h][i]);
          ASSERT_EQ(packed_v[c.cu_len()[h] * d + i], hv[h][i]);
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
        const KvBlock b{EncodedView::Raw(DType::kFp32, hk[h].data(), 1, n, d, n * d, d),
                        EncodedView::Raw(DType::kFp32, hv[h].data(), 1, n, d, n * d, d)};
        KVT_ASSERT_OK(DecodeAttention({2, 1, d}, q.data() + h * 2 * d, {&b, 1},
                                      dense.data() + h * 2 * d, KernelLevel::kReference));
      }
      for (size_t i = 0; i < ref.size(); ++i) {
        ASSERT_NEAR(vec[i], ref[i], 2e-5 + 2e-4 * std::fabs(ref[i]));
        ASSERT_EQ(ref[i], dense[i]);
      }
    }
}

// With a codec, each head is a KvStream: attention over its encoded blocks
// must equal DecodeAttention over a stream fed the same tokens, at both CPU
// levels, and stay close to the raw cache.
TEST(FlatKvCacheTest, EncodedHeadsMatchPerHeadStreams) {
  const int kvh = 4, qh = 16, d = 64;
  const int64_t t = 300;
  const std::vector<float> k = Random(kvh * t * d, 5), v = Random(kvh * t * d, 6);
  std::vector<std::vector<int64_t>> keep(kvh);
  for (int h = 0; h < kvh; ++h) {
    for (int64_t i = 0; i < t; i += h + 1) keep[h].push_back(i);
  }
  for (const char* setting : {"kivi8", "kivi4:R=16", "kcvt4", "fp16", "gear2:r=2:s=0.02"}) {
    SCOPED_TRACE(setting);
    KVT_ASSERT_OK_AND_ASSIGN(CodecConfig codec, ParseCodecSetting(setting));
    for (KernelLevel level : {KernelLevel::kReference, KernelLevel::kVectorized}) {
      KVT_ASSERT_OK_AND_ASSIGN(FlatKvCache c,
                               FlatKvCache::Gather(kvh, d, t, k.data(), v.data(), keep,
                                                   {.codec = codec, .level = level}));
      KVT_ASSERT_OK_AND_ASSIGN(FlatKvCache raw,
                               FlatKvCache::Gather(kvh, d, t, k.data(), v.data(), keep));
      ASSERT_TRUE(c.encoded());
      std::vector<KvStream> ref;
      for (int h = 0; h < kvh; ++h) {
        KVT_ASSERT_OK_AND_ASSIGN(KvStream s, KvStream::Create(codec, 1, d, level));
        for (int64_t i : keep[h])
          KVT_ASSERT_OK(s.Append(&k[(h * t + i) * d], &v[(h * t + i) * d], 1));
        ref.push_back(std::move(s));
      }
      for (int step = 0; step < 70; ++step) {  // Crosses a 64-token block boundary.
        const std::vector<float> nk = Random(kvh * d, 100 + step), nv = Random(kvh * d, 200 + step);
        KVT_ASSERT_OK(c.Append(nk.data(), nv.data()));
        KVT_ASSERT_OK(raw.Append(nk.data(), nv.data()));
        for (int h = 0; h < kvh; ++h) KVT_ASSERT_OK(ref[h].Append(&nk[h * d], &nv[h * d], 1));
      }
      EXPECT_EQ(c.head_lens(), raw.head_lens());
      EXPECT_EQ(c.cu_len(), raw.cu_len());
      const std::vector<float> q = Random(qh * d, 7);
      std::vector<float> got(qh * d), want(qh * d), exact(qh * d);
      KVT_ASSERT_OK(c.Attend(qh, q.data(), got.data()));
      KVT_ASSERT_OK(raw.Attend(qh, q.data(), exact.data(), KernelLevel::kReference));
      const int rep = qh / kvh;
      int64_t bytes = 0;
      for (int h = 0; h < kvh; ++h) {
        KVT_ASSERT_OK(DecodeAttention({rep, 1, d}, q.data() + h * rep * d, ref[h].Blocks(),
                                      want.data() + h * rep * d, level));
        bytes += ref[h].bytes();
      }
      EXPECT_EQ(c.bytes(), bytes);
      EXPECT_LT(c.bytes(), raw.bytes());
      double err = 0, norm = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i], want[i]);
        err += (got[i] - exact[i]) * (got[i] - exact[i]);
        norm += exact[i] * exact[i];
      }
      EXPECT_LT(std::sqrt(err / norm), 0.5) << "far from the raw cache";
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
