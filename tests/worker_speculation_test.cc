// Speculation (InfiniGen) in the worker engine against a real kvtier-store
// process: skew upload and policy checks, an alpha that keeps every token
// reproduces dense attention, and a small alpha attends exactly the tokens
// a longhand speculation picks (partial skewed scores, counts within alpha,
// the mean n, each head's top n, the union per KV head).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "client/store_segments.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/half.h"
#include "kernels/speculation.h"
#include "tests/util/status_matchers.h"
#include "tests/util/worker_stack.h"
#include "worker/engine.h"

namespace kvtier {
namespace {

using ::kvtier::testing::IsOk;
using ::kvtier::testing::StatusIs;
using worker::Engine;
using worker::ModelShape;
using worker::SessionPolicy;
#define KVT_ASSERT_OK(expr) ASSERT_THAT((expr), IsOk())

constexpr ModelShape kShape{4, 4, 2, 16, v1::DTYPE_FP16};

std::vector<float> Random(size_t n, std::mt19937* rng) {
  std::normal_distribution<float> nd;
  std::vector<float> x(n);
  // fp16-exact values: the open round holds them exactly.
  for (float& v : x) v = HalfToFloat(FloatToHalf(nd(*rng)));
  return x;
}

// A skew calibrated on random queries and keys of kShape, `ratio` of the
// columns kept.
spec::SkewModel MakeSkew(double ratio, int layers = kShape.layers, uint32_t seed = 7) {
  std::mt19937 rng(seed);
  spec::SkewModel m;
  m.model = "test";
  m.layers = layers;
  m.q_heads = kShape.q_heads;
  m.kv_heads = kShape.kv_heads;
  m.head_dim = kShape.head_dim;
  m.partial_ratio = ratio;
  m.calibration_tokens = 64;
  for (int l = 0; l < layers; ++l) {
    const auto q = Random(64 * kShape.q_heads * kShape.head_dim, &rng);
    const auto k = Random(64 * kShape.kv_heads * kShape.head_dim, &rng);
    auto heads = spec::CalibrateLayer(q.data(), k.data(), 64, kShape.q_heads, kShape.kv_heads,
                                      kShape.head_dim, ratio);
    EXPECT_TRUE(heads.ok()) << heads.status();
    m.heads.push_back(*heads);
  }
  return m;
}

// Every token's K and V per layer, token-major fp32, in the order the
// engine saw them; and which round each token belongs to.
struct History {
  std::vector<std::vector<float>> k, v;  // [layer] [T, kv_heads, d]
  int64_t tokens(int layer) const {
    return static_cast<int64_t>(k[layer].size()) / (kShape.kv_heads * kShape.head_dim);
  }
};

// Longhand: the union per KV head of the tokens speculation keeps among
// the first `past` tokens, for approximate query qn [q_heads, d].
std::vector<std::vector<int64_t>> Longhand(const spec::SkewModel& skew, int layer, const History& h,
                                           int64_t past, const float* qn, float alpha, int budget) {
  const int d = kShape.head_dim, hq = kShape.q_heads, hkv = kShape.kv_heads, g = hq / hkv;
  std::vector<std::vector<double>> scores(hq, std::vector<double>(past));
  std::vector<int> counts(hq, 0);
  for (int qh = 0; qh < hq; ++qh) {
    const spec::SkewHead& sh = skew.heads[layer][qh / g];
    std::vector<float> qa(d), ka(d);
    spec::Skew(sh, d, qn + qh * d, qa.data());
    double best = -INFINITY;
    for (int64_t t = 0; t < past; ++t) {
      spec::Skew(sh, d, &h.k[layer][(t * hkv + qh / g) * d], ka.data());
      double acc = 0;
      // The worker holds partial keys in fp16.
      for (int32_t c : sh.partial)
        acc += static_cast<double>(qa[c]) * HalfToFloat(FloatToHalf(ka[c]));
      scores[qh][t] = acc / std::sqrt(static_cast<double>(d));
      best = std::max(best, scores[qh][t]);
    }
    for (int64_t t = 0; t < past; ++t) counts[qh] += scores[qh][t] >= best - alpha;
  }
  int64_t n = std::llround(std::accumulate(counts.begin(), counts.end(), 0.0) / hq);
  if (budget > 0) n = std::min<int64_t>(n, budget);
  n = std::clamp<int64_t>(n, 1, past);
  std::vector<std::vector<int64_t>> out(hkv);
  for (int qh = 0; qh < hq; ++qh) {
    std::vector<int64_t> idx(past);
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(),
                     [&](int64_t a, int64_t b) { return scores[qh][a] > scores[qh][b]; });
    out[qh / g].insert(out[qh / g].end(), idx.begin(), idx.begin() + n);
  }
  for (auto& u : out) {
    std::sort(u.begin(), u.end());
    u.erase(std::unique(u.begin(), u.end()), u.end());
  }
  return out;
}

// Attention of q [q_heads, d] over `keep` (per KV head, indices into the
// history) plus tokens [from, to) of the history, in double.
std::vector<float> Attend(const History& h, int layer, const float* q,
                          const std::vector<std::vector<int64_t>>& keep, int64_t from, int64_t to) {
  const int d = kShape.head_dim, hq = kShape.q_heads, hkv = kShape.kv_heads, g = hq / hkv;
  std::vector<float> out(static_cast<size_t>(hq) * d);
  for (int qh = 0; qh < hq; ++qh) {
    const int kh = qh / g;
    std::vector<int64_t> toks = keep[kh];
    for (int64_t t = from; t < to; ++t) toks.push_back(t);
    std::vector<double> w(toks.size());
    double best = -INFINITY;
    for (size_t j = 0; j < toks.size(); ++j) {
      double acc = 0;
      for (int i = 0; i < d; ++i)
        acc += double(q[qh * d + i]) * h.k[layer][(toks[j] * hkv + kh) * d + i];
      w[j] = acc / std::sqrt(static_cast<double>(d));
      best = std::max(best, w[j]);
    }
    double z = 0;
    for (double& x : w) z += (x = std::exp(x - best));
    for (int i = 0; i < d; ++i) {
      double acc = 0;
      for (size_t j = 0; j < toks.size(); ++j) {
        acc += w[j] / z * h.v[layer][(toks[j] * hkv + kh) * d + i];
      }
      out[qh * d + i] = static_cast<float>(acc);
    }
  }
  return out;
}

class WorkerSpeculationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVT_ASSERT_OK(stack_.Start());
    worker::EngineOptions o;
    o.level = KernelLevel::kReference;
    o.placement = worker::EngineOptions::Placement::kHost;
    engine_ = std::make_unique<Engine>(stack_.segments(), o);
  }

  // A policy that keeps every past round visible at every layer (recall all,
  // raw fp32), so the longhand history is exactly what attention sees.
  SessionPolicy Policy(const std::string& skew, float alpha, int budget = 0) {
    SessionPolicy p;
    p.recall.mode = RecallMode::kAll;
    p.release_after_end_round = false;
    p.speculation.skew = skew;
    p.speculation.alpha = alpha;
    p.speculation.budget = budget;
    return p;
  }

  testing::StoreStack stack_;
  std::unique_ptr<Engine> engine_;
};

TEST_F(WorkerSpeculationTest, UploadAndPolicyChecks) {
  const std::string bytes = spec::SerializeSkew(MakeSkew(0.25));
  auto id = engine_->PutSkew(bytes);
  ASSERT_TRUE(id.ok()) << id.status();
  auto again = engine_->PutSkew(bytes);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*id, *again);  // Held once.
  // Another skew of the same size gets another id.
  const std::string other_bytes = spec::SerializeSkew(MakeSkew(0.25, kShape.layers, 8));
  ASSERT_EQ(other_bytes.size(), bytes.size());
  auto third = engine_->PutSkew(other_bytes);
  ASSERT_TRUE(third.ok());
  EXPECT_NE(*third, *id);

  std::string bad = bytes;
  bad[bad.size() / 2] ^= 1;
  EXPECT_THAT(engine_->PutSkew(bad).status(), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(engine_->PutSkew("not a skew").status(),
              StatusIs(absl::StatusCode::kInvalidArgument));

  EXPECT_THAT(engine_->OpenSession(worker::SessionKey("a"), kShape, Policy("00000000-1", 4)),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::HasSubstr("PutSkew")));
  EXPECT_THAT(engine_->OpenSession(worker::SessionKey("a"), kShape, Policy(*id, 0)),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("alpha")));
  EXPECT_THAT(engine_->OpenSession(worker::SessionKey("a"), kShape, Policy(*id, 4, -1)),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("budget")));
  auto other = engine_->PutSkew(spec::SerializeSkew(MakeSkew(0.25, 3)));
  ASSERT_TRUE(other.ok());
  EXPECT_THAT(engine_->OpenSession(worker::SessionKey("a"), kShape, Policy(*other, 4)),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("3 layers")));
  KVT_ASSERT_OK(engine_->OpenSession(worker::SessionKey("a"), kShape, Policy(*id, 4)));
  EXPECT_THAT(engine_->UpdatePolicy(worker::SessionKey("a"), Policy(*other, 4)),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// Runs `rounds` rounds of a prefill and `decode` steps on a speculating
// session and checks every decode output at layers >= 1 against the
// longhand speculation. Returns the EndRound reports.
std::vector<worker::EndRoundReport> RunAndCheck(Engine* engine, const spec::SkewModel& skew,
                                                const SessionPolicy& policy, int rounds,
                                                int64_t prefill, int decode, double* worst) {
  const worker::SessionKey id("s");
  EXPECT_THAT(engine->OpenSession(id, kShape, policy), IsOk());
  std::mt19937 rng(11);
  const int d = kShape.head_dim, hq = kShape.q_heads, hkv = kShape.kv_heads;
  History h;
  h.k.resize(kShape.layers);
  h.v.resize(kShape.layers);
  std::vector<worker::EndRoundReport> reps;
  *worst = 0;
  for (int r = 0; r < rounds; ++r) {
    const int64_t round_start = h.tokens(0);
    for (int l = 0; l < kShape.layers; ++l) {
      const auto q = Random(prefill * hq * d, &rng), k = Random(prefill * hkv * d, &rng),
                 v = Random(prefill * hkv * d, &rng);
      std::vector<float> out(q.size());
      auto rep = engine->PrefillLayer(id, l, prefill, 0, q.data(), k.data(), v.data(), out.data());
      EXPECT_TRUE(rep.ok()) << rep.status();
      h.k[l].insert(h.k[l].end(), k.begin(), k.end());
      h.v[l].insert(h.v[l].end(), v.begin(), v.end());
    }
    for (int s = 0; s < decode; ++s) {
      std::vector<float> q_next;
      for (int l = 0; l < kShape.layers; ++l) {
        const auto q = Random(hq * d, &rng), k = Random(hkv * d, &rng), v = Random(hkv * d, &rng);
        const std::vector<float> qn = Random(hq * d, &rng);
        std::vector<float> out(q.size());
        h.k[l].insert(h.k[l].end(), k.begin(), k.end());
        h.v[l].insert(h.v[l].end(), v.begin(), v.end());
        EXPECT_THAT(engine->DecodeLayer(id, l, q.data(), k.data(), v.data(), out.data(),
                                        l + 1 < kShape.layers ? qn.data() : nullptr),
                    IsOk());
        std::vector<float> ref;
        const int64_t now = h.tokens(l);
        if (l >= 1 && round_start > 0) {
          const auto keep = Longhand(skew, l, h, round_start, q_next.data(),
                                     policy.speculation.alpha, policy.speculation.budget);
          ref = Attend(h, l, q.data(), keep, round_start, now);
        } else {
          std::vector<std::vector<int64_t>> none(hkv);
          ref = Attend(h, l, q.data(), none, 0, now);
        }
        for (size_t i = 0; i < out.size(); ++i) {
          *worst = std::max(*worst, std::fabs(double(out[i]) - ref[i]));
        }
        q_next = qn;
      }
    }
    auto rep = engine->EndRound(id);
    EXPECT_TRUE(rep.ok()) << rep.status();
    if (rep.ok()) reps.push_back(*rep);
  }
  return reps;
}

TEST_F(WorkerSpeculationTest, AttendsTheLonghandSelection) {
  const spec::SkewModel skew = MakeSkew(0.25);
  auto id = engine_->PutSkew(spec::SerializeSkew(skew));
  ASSERT_TRUE(id.ok()) << id.status();
  double worst = 0;
  const auto reps = RunAndCheck(engine_.get(), skew, Policy(*id, 0.5f), 3, 12, 20, &worst);
  EXPECT_LT(worst, 1e-4);
  ASSERT_EQ(reps.size(), 3u);
  EXPECT_TRUE(reps[0].speculation.empty());  // No past round to speculate over.
  for (int r = 1; r < 3; ++r) {
    ASSERT_EQ(reps[r].speculation.size(), static_cast<size_t>(kShape.layers));
    EXPECT_EQ(reps[r].speculation[0].steps, 0u);  // Layer 0 runs dense.
    for (int l = 1; l < kShape.layers; ++l) {
      const worker::SpeculationLayerStats& st = reps[r].speculation[l];
      EXPECT_EQ(st.steps, 20u);
      EXPECT_EQ(st.past_tokens, 20u * 32u * r);  // 32 tokens per round.
      EXPECT_EQ(st.sampled, 2u);                 // Steps 1 and 17 of the round.
      EXPECT_GT(st.hit_sum, 0.0);
      EXPECT_LT(st.kept, st.past_tokens);  // alpha 0.5 keeps a few.
      EXPECT_LT(st.bytes_speculative, st.bytes_dense);
    }
  }
}

TEST_F(WorkerSpeculationTest, BudgetCapsTheTokens) {
  const spec::SkewModel skew = MakeSkew(0.25);
  auto id = engine_->PutSkew(spec::SerializeSkew(skew));
  ASSERT_TRUE(id.ok());
  double worst = 0;
  const auto reps = RunAndCheck(engine_.get(), skew, Policy(*id, 8.0f, 3), 2, 8, 6, &worst);
  EXPECT_LT(worst, 1e-4);
  ASSERT_EQ(reps.size(), 2u);
  for (int l = 1; l < kShape.layers; ++l) EXPECT_EQ(reps[1].speculation[l].kept, 6u * 3u);
}

TEST_F(WorkerSpeculationTest, AlphaThatKeepsEverythingIsDense) {
  const spec::SkewModel skew = MakeSkew(0.25);
  auto id = engine_->PutSkew(spec::SerializeSkew(skew));
  ASSERT_TRUE(id.ok());
  double worst = 0;
  const auto reps = RunAndCheck(engine_.get(), skew, Policy(*id, 1e6f), 3, 10, 8, &worst);
  EXPECT_LT(worst, 1e-4);
  ASSERT_EQ(reps.size(), 3u);
  for (int l = 1; l < kShape.layers; ++l) {
    const worker::SpeculationLayerStats& st = reps[2].speculation[l];
    EXPECT_EQ(st.kept, st.past_tokens);
    EXPECT_DOUBLE_EQ(st.hit_sum / st.sampled, 1.0);
    EXPECT_NEAR(st.mass_sum / st.sampled, 1.0, 1e-9);
  }
}

TEST_F(WorkerSpeculationTest, BadNextQueryIsRefused) {
  auto id = engine_->PutSkew(spec::SerializeSkew(MakeSkew(0.25)));
  ASSERT_TRUE(id.ok());
  const worker::SessionKey s("s");
  KVT_ASSERT_OK(engine_->OpenSession(s, kShape, Policy(*id, 4)));
  std::mt19937 rng(3);
  const int d = kShape.head_dim;
  for (int l = 0; l < kShape.layers; ++l) {
    const auto q = Random(kShape.q_heads * d, &rng), k = Random(kShape.kv_heads * d, &rng),
               v = Random(kShape.kv_heads * d, &rng);
    std::vector<float> out(q.size());
    ASSERT_TRUE(engine_->PrefillLayer(s, l, 1, 0, q.data(), k.data(), v.data(), out.data()).ok());
  }
  const auto q = Random(kShape.q_heads * d, &rng), k = Random(kShape.kv_heads * d, &rng),
             v = Random(kShape.kv_heads * d, &rng);
  std::vector<float> qn(q.size(), 0.0f), out(q.size());
  qn[5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(
      engine_->DecodeLayer(s, 0, q.data(), k.data(), v.data(), out.data(), qn.data()),
      StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("q_next[0, 0, 5]")));
}

}  // namespace
}  // namespace kvtier
