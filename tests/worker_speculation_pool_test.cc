// Speculation's host pool (InfiniGen) in the worker engine against a real
// kvtier-store process: under a cap, the least fetched of the older half
// leave, trimming down to the low mark, exactly as a longhand pool does; a
// quantizing codec re-encodes the pool and decoding goes on.
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "client/store_segments.h"
#include "encoded/encode.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/half.h"
#include "kernels/speculation.h"
#include "tests/util/speculation_fixture.h"
#include "tests/util/status_matchers.h"
#include "tests/util/worker_stack.h"
#include "worker/device/attention.h"
#include "worker/engine.h"

namespace kvtier {
namespace {

using ::kvtier::speculation_test::Attend;
using ::kvtier::speculation_test::DecodedLayer;
using ::kvtier::speculation_test::DecodeOne;
using ::kvtier::speculation_test::History;
using ::kvtier::speculation_test::kShape;
using ::kvtier::speculation_test::LonghandOver;
using ::kvtier::speculation_test::MakeSkew;
using ::kvtier::speculation_test::Random;
using ::kvtier::speculation_test::WorkerSpeculationTest;
using ::kvtier::testing::IsOk;
using ::kvtier::testing::StatusIs;
using worker::Engine;
using worker::ModelShape;
using worker::SessionPolicy;

// The host pool, longhand: per layer >= 1 and KV head, the past tokens it
// holds (history indices, in order) and how often speculation gathered each.
struct LonghandPool {
  std::vector<std::vector<std::vector<int64_t>>> alive;  // [layer][head]
  std::vector<std::map<int64_t, uint32_t>> fetches;      // [layer * kv_heads + head]
  std::vector<int64_t> round_end;                        // History index past each round.
  CodecConfig codec;

  int RoundOf(int64_t t) const {
    return static_cast<int>(std::upper_bound(round_end.begin(), round_end.end(), t) -
                            round_end.begin());
  }
  // The serialized K plus V of `n` tokens of one head at `layer`.
  size_t HeadBytes(int layer, int64_t n) const {
    size_t b = 0;
    for (TensorRole role : {TensorRole::kKey, TensorRole::kValue}) {
      const int64_t shape[3] = {1, n, kShape.head_dim};
      auto e = TensorEncoder::Make(codec, role, shape, static_cast<uint32_t>(layer));
      EXPECT_TRUE(e.ok()) << e.status();
      b += e->SerializedSize();
    }
    return b;
  }
  // Tokens of round r at (layer, head).
  int64_t Count(int l, int h, int r) const {
    int64_t n = 0;
    for (int64_t t : alive[l][h]) n += RoundOf(t) == r;
    return n;
  }
  uint64_t Bytes() const {
    uint64_t b = 0;
    for (size_t r = 0; r < round_end.size(); ++r) {
      for (int l = 1; l < kShape.layers; ++l) {
        for (int h = 0; h < kShape.kv_heads; ++h) b += HeadBytes(l, Count(l, h, r));
      }
    }
    return b;
  }
  // EndRound's trim: returns the tokens evicted.
  uint64_t Trim(uint64_t cap) {
    uint64_t evicted = 0;
    uint64_t bytes = Bytes();
    for (int attempt = 0; attempt < 4 && bytes > cap; ++attempt) {
      // Row costs of this attempt: what each round layer head's rows add to
      // one row's bytes, per row; and each token's row at the attempt's start.
      std::map<std::tuple<int, int, int>, double> row_bytes;
      std::map<std::tuple<int, int, int64_t>, int64_t> row_of;
      for (size_t r = 0; r < round_end.size(); ++r) {
        for (int l = 1; l < kShape.layers; ++l) {
          for (int h = 0; h < kShape.kv_heads; ++h) {
            const int64_t n = Count(l, h, static_cast<int>(r));
            if (n > 1) {
              row_bytes[{static_cast<int>(r), l, h}] =
                  double(HeadBytes(l, n) - HeadBytes(l, 1)) / double(n - 1);
            }
          }
        }
      }
      for (int l = 1; l < kShape.layers; ++l) {
        for (int h = 0; h < kShape.kv_heads; ++h) {
          std::map<int, int64_t> rows;
          for (int64_t t : alive[l][h]) row_of[{l, h, t}] = rows[RoundOf(t)]++;
        }
      }
      double excess = static_cast<double>(bytes - cap);
      uint64_t n = 0;
      while (excess > 0) {
        // (fetches, round, row in its round layer head, layer, head, token)
        std::vector<std::tuple<uint32_t, int, int64_t, int, int, int64_t>> cand;
        for (int l = 1; l < kShape.layers; ++l) {
          for (int h = 0; h < kShape.kv_heads; ++h) {
            const auto& a = alive[l][h];
            // The older half, less each round's newest remaining token.
            std::map<int, int64_t> newest;
            for (int64_t t : a) newest[RoundOf(t)] = t;
            for (size_t i = 0; i < a.size() / 2; ++i) {
              const int r = RoundOf(a[i]);
              if (newest[r] == a[i]) continue;
              const int64_t row = row_of[{l, h, a[i]}];
              auto f = fetches[l * kShape.kv_heads + h].find(a[i]);
              cand.emplace_back(f == fetches[l * kShape.kv_heads + h].end() ? 0 : f->second, r, row,
                                l, h, a[i]);
            }
          }
        }
        if (cand.empty()) break;
        std::sort(cand.begin(), cand.end());
        std::set<std::tuple<int, int, int64_t>> gone;
        for (const auto& [f, r, row, l, h, t] : cand) {
          if (excess <= 0) break;
          gone.insert({l, h, t});
          excess -= row_bytes[{r, l, h}];
          ++n;
        }
        for (int l = 1; l < kShape.layers; ++l) {
          for (int h = 0; h < kShape.kv_heads; ++h) {
            auto& a = alive[l][h];
            a.erase(std::remove_if(a.begin(), a.end(),
                                   [&](int64_t t) {
                                     return gone.count({l, h, t}) > 0;
                                   }),
                    a.end());
          }
        }
      }
      if (n == 0) break;
      evicted += n;
      bytes = Bytes();
    }
    return evicted;
  }
};

// A speculating session with a pool cap: after every EndRound the pool's
// bytes and evictions equal the longhand trim's, and every later decode
// step attends exactly what the longhand pool holds (the speculation over
// its tokens, dense attention at layer 0 and over the open round). The
// parameter is the low mark (0: trims stop at the cap): a pool above the
// cap is trimmed down to it, one at or below the cap is left alone.
class WorkerPoolTrimTest : public WorkerSpeculationTest,
                           public ::testing::WithParamInterface<uint64_t> {};

TEST_P(WorkerPoolTrimTest, PoolCapEvictsTheLeastFetchedOfTheOlderHalf) {
  const spec::SkewModel skew = MakeSkew(0.25);
  auto id = engine_->skews().Put(spec::SerializeSkew(skew));
  ASSERT_TRUE(id.ok());
  SessionPolicy policy = Policy(*id, 1.0f);
  constexpr uint64_t kCap = 20000;
  const uint64_t low = GetParam(), target = low > 0 ? low : kCap;
  policy.speculation.pool_bytes = kCap;
  policy.speculation.pool_low_bytes = static_cast<int64_t>(low);
  const worker::SessionKey sid("s");
  KVT_ASSERT_OK(engine_->OpenSession(sid, kShape, policy));
  LonghandPool pool;
  pool.codec = policy.codec;
  pool.alive.assign(kShape.layers, std::vector<std::vector<int64_t>>(kShape.kv_heads));
  pool.fetches.resize(kShape.layers * kShape.kv_heads);
  std::mt19937 rng(13);
  const int d = kShape.head_dim, hq = kShape.q_heads, hkv = kShape.kv_heads;
  History h;
  h.k.resize(kShape.layers);
  h.v.resize(kShape.layers);
  double worst = 0;
  uint64_t evicted = 0;
  int multipass = 0, spared = 0;
  for (int r = 0; r < 6; ++r) {
    const int64_t round_start = h.tokens(0);
    const int64_t prefill = 8 + 4 * r;
    for (int l = 0; l < kShape.layers; ++l) {
      const auto q = Random(prefill * hq * d, &rng), k = Random(prefill * hkv * d, &rng),
                 v = Random(prefill * hkv * d, &rng);
      std::vector<float> out(q.size());
      KVT_ASSERT_OK(
          engine_->PrefillLayer(sid, l, prefill, 0, q.data(), k.data(), v.data(), out.data()));
      h.k[l].insert(h.k[l].end(), k.begin(), k.end());
      h.v[l].insert(h.v[l].end(), v.begin(), v.end());
    }
    std::vector<float> q_next;
    for (int step = 0; step < 10; ++step) {
      for (int l = 0; l < kShape.layers; ++l) {
        const DecodedLayer dl = DecodeOne(engine_.get(), sid, l, &h, &rng);
        KVT_ASSERT_OK(dl.status);
        const std::vector<float>&q = dl.q, &out = dl.out, &qn = dl.next;
        std::vector<float> ref;
        if (l >= 1 && round_start > 0) {
          const auto keep =
              LonghandOver(skew, l, h, pool.alive[l], q_next.data(), policy.speculation.alpha, 0);
          for (int kh = 0; kh < hkv; ++kh) {
            for (int64_t t : keep[kh]) ++pool.fetches[l * hkv + kh][t];
          }
          ref = Attend(h, l, q.data(), keep, round_start, h.tokens(l));
        } else {
          ref = Attend(h, l, q.data(), std::vector<std::vector<int64_t>>(hkv), 0, h.tokens(l));
        }
        for (size_t i = 0; i < out.size(); ++i) {
          worst = std::max(worst, std::fabs(double(out[i]) - ref[i]));
        }
        q_next = qn;
      }
    }
    auto rep = engine_->EndRound(sid);
    ASSERT_TRUE(rep.ok()) << rep.status();
    pool.round_end.push_back(h.tokens(0));
    for (int l = 1; l < kShape.layers; ++l) {
      for (int kh = 0; kh < hkv; ++kh) {
        for (int64_t t = round_start; t < h.tokens(l); ++t) pool.alive[l][kh].push_back(t);
      }
    }
    const uint64_t before = pool.Bytes();
    const uint64_t older = before / 2;
    const uint64_t n = before > kCap ? pool.Trim(target) : 0;
    EXPECT_EQ(rep->pool.cap_bytes, kCap);
    EXPECT_EQ(rep->pool.bytes_before, before) << "round " << r;
    EXPECT_EQ(rep->pool.bytes_after, pool.Bytes()) << "round " << r;
    EXPECT_EQ(rep->pool.evicted_tokens, n) << "round " << r;
    EXPECT_LE(rep->pool.bytes_after, before > kCap ? target : kCap);
    evicted += n;
    multipass += before > target + older;
    spared += before > target && before <= kCap;
  }
  EXPECT_LT(worst, 1e-4);
  EXPECT_GT(evicted, 0u);
  EXPECT_GT(multipass, 0);  // Some trim took more than one older half.
  // With a low mark, some round ended above it and under the cap: no trim.
  if (low > 0) {
    EXPECT_GT(spared, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(LowMark, WorkerPoolTrimTest, ::testing::Values(0u, 12000u),
                         [](const ::testing::TestParamInfo<uint64_t>& i) {
                           return i.param == 0 ? std::string("TrimsToTheCap")
                                               : "TrimsTo" + std::to_string(i.param);
                         });

// A quantizing codec: the pool is re-encoded under its cap, and the session
// goes on decoding over it.
TEST_F(WorkerSpeculationTest, PoolCapWithKivi) {
  auto id = engine_->skews().Put(spec::SerializeSkew(MakeSkew(0.25)));
  ASSERT_TRUE(id.ok());
  SessionPolicy policy = Policy(*id, 4.0f);
  auto kivi = ParseCodecSetting("kivi4:g=8");
  ASSERT_TRUE(kivi.ok());
  policy.codec = *kivi;
  constexpr uint64_t kCap = 9000;
  policy.speculation.pool_bytes = kCap;
  const worker::SessionKey sid("k");
  KVT_ASSERT_OK(engine_->OpenSession(sid, kShape, policy));
  std::mt19937 rng(17);
  const int d = kShape.head_dim, hq = kShape.q_heads, hkv = kShape.kv_heads;
  uint64_t evicted = 0;
  for (int r = 0; r < 5; ++r) {
    for (int l = 0; l < kShape.layers; ++l) {
      const auto q = Random(24 * hq * d, &rng), k = Random(24 * hkv * d, &rng),
                 v = Random(24 * hkv * d, &rng);
      std::vector<float> out(q.size());
      KVT_ASSERT_OK(engine_->PrefillLayer(sid, l, 24, 0, q.data(), k.data(), v.data(), out.data()));
    }
    for (int step = 0; step < 4; ++step) {
      for (int l = 0; l < kShape.layers; ++l) {
        const auto q = Random(hq * d, &rng), k = Random(hkv * d, &rng), v = Random(hkv * d, &rng),
                   qn = Random(hq * d, &rng);
        std::vector<float> out(q.size());
        KVT_ASSERT_OK(engine_->DecodeLayer(sid, l, q.data(), k.data(), v.data(), out.data(),
                                           l + 1 < kShape.layers ? qn.data() : nullptr));
        for (float x : out) ASSERT_TRUE(std::isfinite(x));
      }
    }
    auto rep = engine_->EndRound(sid);
    ASSERT_TRUE(rep.ok()) << rep.status();
    EXPECT_LE(rep->pool.bytes_after, kCap);
    EXPECT_LE(rep->pool.bytes_after, rep->pool.bytes_before);
    evicted += rep->pool.evicted_tokens;
    auto st = engine_->Stats(sid);
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(st->working_set_bytes, rep->working_set_bytes);
  }
  EXPECT_GT(evicted, 0u);
}

}  // namespace
}  // namespace kvtier
