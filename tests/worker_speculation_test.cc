// Speculation (InfiniGen) in the worker engine against a real kvtier-store
// process: skew upload and policy checks, an alpha that keeps every token
// reproduces dense attention, and a small alpha attends exactly the tokens
// a longhand speculation picks (partial skewed scores, counts within alpha,
// the mean n, each head's top n, the union per KV head).
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "client/store_segments.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/half.h"
#include "kernels/speculation.h"
#include "tests/util/status_matchers.h"
#include "tests/util/worker_stack.h"
#include "worker/device/attention.h"
#include "worker/engine.h"

namespace kvtier {
namespace {

using ::kvtier::testing::IsOk;
using ::kvtier::testing::StatusIs;
using worker::Engine;
using worker::ModelShape;
using worker::SessionPolicy;

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
// `cand` (per KV head, history indices in order), for approximate query qn
// [q_heads, d].
std::vector<std::vector<int64_t>> LonghandOver(const spec::SkewModel& skew, int layer,
                                               const History& h,
                                               const std::vector<std::vector<int64_t>>& cand,
                                               const float* qn, float alpha, int budget) {
  const int d = kShape.head_dim, hq = kShape.q_heads, hkv = kShape.kv_heads, g = hq / hkv;
  std::vector<std::vector<double>> scores(hq);
  std::vector<int> counts(hq, 0);
  int64_t most = 0;
  for (int qh = 0; qh < hq; ++qh) {
    const spec::SkewHead& sh = skew.heads[layer][qh / g];
    const std::vector<int64_t>& c = cand[qh / g];
    most = std::max<int64_t>(most, static_cast<int64_t>(c.size()));
    std::vector<float> qa(d), ka(d);
    spec::Skew(sh, d, qn + qh * d, qa.data());
    double best = -INFINITY;
    for (int64_t t : c) {
      spec::Skew(sh, d, &h.k[layer][(t * hkv + qh / g) * d], ka.data());
      double acc = 0;
      // The worker holds partial keys in fp16.
      for (int32_t col : sh.partial)
        acc += static_cast<double>(qa[col]) * HalfToFloat(FloatToHalf(ka[col]));
      scores[qh].push_back(acc / std::sqrt(static_cast<double>(d)));
      best = std::max(best, scores[qh].back());
    }
    for (double x : scores[qh]) counts[qh] += x >= best - alpha;
  }
  int64_t n = std::llround(std::accumulate(counts.begin(), counts.end(), 0.0) / hq);
  if (budget > 0) n = std::min<int64_t>(n, budget);
  n = std::clamp<int64_t>(n, 1, std::max<int64_t>(1, most));
  std::vector<std::vector<int64_t>> out(hkv);
  for (int qh = 0; qh < hq; ++qh) {
    const std::vector<int64_t>& c = cand[qh / g];
    std::vector<int64_t> idx(c.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(),
                     [&](int64_t a, int64_t b) { return scores[qh][a] > scores[qh][b]; });
    const int64_t take = std::min<int64_t>(n, static_cast<int64_t>(c.size()));
    for (int64_t i = 0; i < take; ++i) out[qh / g].push_back(c[idx[i]]);
  }
  for (auto& u : out) {
    std::sort(u.begin(), u.end());
    u.erase(std::unique(u.begin(), u.end()), u.end());
  }
  return out;
}

// The same over the first `past` tokens, at every KV head.
std::vector<std::vector<int64_t>> Longhand(const spec::SkewModel& skew, int layer, const History& h,
                                           int64_t past, const float* qn, float alpha, int budget) {
  std::vector<int64_t> all(past);
  std::iota(all.begin(), all.end(), 0);
  return LonghandOver(skew, layer, h, std::vector<std::vector<int64_t>>(kShape.kv_heads, all), qn,
                      alpha, budget);
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

// Layer l of a decode step: draws q, k, v and the next layer's approximate
// query, appends k and v to the history and runs DecodeLayer (with q_next on
// every layer but the last).
struct DecodedLayer {
  std::vector<float> q, out, next;
  absl::Status status;
};
DecodedLayer DecodeOne(Engine* engine, const worker::SessionKey& id, int l, History* h,
                       std::mt19937* rng) {
  const int d = kShape.head_dim, hq = kShape.q_heads, hkv = kShape.kv_heads;
  DecodedLayer r;
  r.q = Random(hq * d, rng);
  const auto k = Random(hkv * d, rng), v = Random(hkv * d, rng);
  r.next = Random(hq * d, rng);
  r.out.resize(r.q.size());
  h->k[l].insert(h->k[l].end(), k.begin(), k.end());
  h->v[l].insert(h->v[l].end(), v.begin(), v.end());
  r.status = engine->DecodeLayer(id, l, r.q.data(), k.data(), v.data(), r.out.data(),
                                 l + 1 < kShape.layers ? r.next.data() : nullptr);
  return r;
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

// A tenant's uploads hold at most kMaxSkewsPerTenant slots: past it, its
// least recently used skew that no session holds makes room; when every one
// is in use, RESOURCE_EXHAUSTED names the share. Other tenants and the
// operator's skews (tenant "") are untouched.
TEST_F(WorkerSpeculationTest, SkewSlotsAreSharedFairlyAndUnusedOnesMakeRoom) {
  constexpr int kShare = worker::SkewRegistry::kMaxPerTenant;
  auto skew = [](uint32_t seed) {
    return spec::SerializeSkew(MakeSkew(0.25, kShape.layers, seed));
  };
  KVT_ASSERT_OK_AND_ASSIGN(const std::string kept, engine_->skews().Put(skew(100)));
  KVT_ASSERT_OK_AND_ASSIGN(const std::string bobs, engine_->skews().Put(skew(200), "bob"));
  std::vector<std::string> ids;
  for (int i = 0; i < kShare; ++i) {
    KVT_ASSERT_OK_AND_ASSIGN(std::string id, engine_->skews().Put(skew(10 + i), "evil"));
    ids.push_back(id);
  }
  // Every one of evil's skews in use by a session.
  for (int i = 0; i < kShare; ++i) {
    KVT_ASSERT_OK(engine_->OpenSession({"evil", std::to_string(i)}, kShape, Policy(ids[i], 4)));
  }
  EXPECT_THAT(engine_->skews().Put(skew(50), "evil").status(),
              StatusIs(absl::StatusCode::kResourceExhausted, ::testing::HasSubstr("its share")));
  // One session closes: its skew is the one to go.
  KVT_ASSERT_OK(engine_->CloseSession({"evil", "1"}, /*delete_from_store=*/true));
  KVT_ASSERT_OK_AND_ASSIGN(std::string fresh, engine_->skews().Put(skew(50), "evil"));
  EXPECT_EQ(engine_->skews().Find(ids[1]), nullptr);
  EXPECT_NE(engine_->skews().Find(fresh), nullptr);
  EXPECT_NE(engine_->skews().Find(ids[0]), nullptr);
  EXPECT_NE(engine_->skews().Find(kept), nullptr);
  EXPECT_NE(engine_->skews().Find(bobs), nullptr);
  // The same bytes from another tenant are the same skew, held once.
  KVT_ASSERT_OK_AND_ASSIGN(std::string same, engine_->skews().Put(skew(50), "bob"));
  EXPECT_EQ(same, fresh);
}

TEST_F(WorkerSpeculationTest, UploadAndPolicyChecks) {
  const std::string bytes = spec::SerializeSkew(MakeSkew(0.25));
  auto id = engine_->skews().Put(bytes);
  ASSERT_TRUE(id.ok()) << id.status();
  auto again = engine_->skews().Put(bytes);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*id, *again);  // Held once.
  // Another skew of the same size gets another id.
  const std::string other_bytes = spec::SerializeSkew(MakeSkew(0.25, kShape.layers, 8));
  ASSERT_EQ(other_bytes.size(), bytes.size());
  auto third = engine_->skews().Put(other_bytes);
  ASSERT_TRUE(third.ok());
  EXPECT_NE(*third, *id);

  std::string bad = bytes;
  bad[bad.size() / 2] ^= 1;
  EXPECT_THAT(engine_->skews().Put(bad).status(), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(engine_->skews().Put("not a skew").status(),
              StatusIs(absl::StatusCode::kInvalidArgument));

  EXPECT_THAT(engine_->OpenSession(worker::SessionKey("a"), kShape, Policy("00000000-1", 4)),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::HasSubstr("PutSkew")));
  EXPECT_THAT(engine_->OpenSession(worker::SessionKey("a"), kShape, Policy(*id, 0)),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("alpha")));
  EXPECT_THAT(engine_->OpenSession(worker::SessionKey("a"), kShape, Policy(*id, 4, -1)),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("budget")));
  auto other = engine_->skews().Put(spec::SerializeSkew(MakeSkew(0.25, 3)));
  ASSERT_TRUE(other.ok());
  EXPECT_THAT(engine_->OpenSession(worker::SessionKey("a"), kShape, Policy(*other, 4)),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("3 layers")));
  SessionPolicy pooled = Policy(*id, 4);
  pooled.speculation.pool_bytes = -1;
  EXPECT_THAT(engine_->OpenSession(worker::SessionKey("a"), kShape, pooled),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("pool cap")));
  pooled = Policy(*id, 4);
  pooled.speculation.pool_bytes = 1 << 20;
  pooled.speculation.pool_low_bytes = (1 << 20) + 1;
  EXPECT_THAT(engine_->OpenSession(worker::SessionKey("a"), kShape, pooled),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("low mark")));
  pooled.speculation.pool_bytes = 0;
  pooled.speculation.pool_low_bytes = 1 << 10;
  EXPECT_THAT(engine_->OpenSession(worker::SessionKey("a"), kShape, pooled),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("low mark")));
  pooled = Policy("", 4);
  pooled.speculation.pool_bytes = 1 << 20;
  EXPECT_THAT(
      engine_->OpenSession(worker::SessionKey("a"), kShape, pooled),
      StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("needs speculation")));
  KVT_ASSERT_OK(engine_->OpenSession(worker::SessionKey("a"), kShape, Policy(*id, 4)));
  EXPECT_THAT(engine_->UpdatePolicy(worker::SessionKey("a"), Policy(*other, 4)),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// Runs `rounds` rounds of a prefill and `decode` steps on a speculating
// session and checks every decode output at layers >= 1 against the
// longhand speculation. Returns the EndRound reports.
std::vector<worker::EndRoundReport> RunAndCheck(Engine* engine, const spec::SkewModel& skew,
                                                const SessionPolicy& policy, int rounds,
                                                int64_t prefill, int decode, double* worst,
                                                const std::string& session = "s") {
  const worker::SessionKey id(session);
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
        const DecodedLayer dl = DecodeOne(engine, id, l, &h, &rng);
        EXPECT_THAT(dl.status, IsOk());
        const std::vector<float>&q = dl.q, &out = dl.out, &qn = dl.next;
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
  auto id = engine_->skews().Put(spec::SerializeSkew(skew));
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
  // Where the speculated steps' time went: every layer step of rounds 2 and 3
  // at layers 1+, each part timed, nothing uploaded on the CPU.
  KVT_ASSERT_OK_AND_ASSIGN(worker::SessionStats stats, engine_->Stats(worker::SessionKey("s")));
  const worker::SessionStats::SpeculationTime& t = stats.speculation_time;
  EXPECT_EQ(t.steps, 2u * 20u * (kShape.layers - 1));
  EXPECT_GT(t.select, absl::ZeroDuration());
  EXPECT_GT(t.gather, absl::ZeroDuration());
  EXPECT_GT(t.attend, absl::ZeroDuration());
  EXPECT_GT(t.sample, absl::ZeroDuration());
  EXPECT_EQ(t.upload, absl::ZeroDuration());
}

TEST_F(WorkerSpeculationTest, BudgetCapsTheTokens) {
  const spec::SkewModel skew = MakeSkew(0.25);
  auto id = engine_->skews().Put(spec::SerializeSkew(skew));
  ASSERT_TRUE(id.ok());
  double worst = 0;
  const auto reps = RunAndCheck(engine_.get(), skew, Policy(*id, 8.0f, 3), 2, 8, 6, &worst);
  EXPECT_LT(worst, 1e-4);
  ASSERT_EQ(reps.size(), 2u);
  for (int l = 1; l < kShape.layers; ++l) EXPECT_EQ(reps[1].speculation[l].kept, 6u * 3u);
}

TEST_F(WorkerSpeculationTest, AlphaThatKeepsEverythingIsDense) {
  const spec::SkewModel skew = MakeSkew(0.25);
  auto id = engine_->skews().Put(spec::SerializeSkew(skew));
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

// On a model with sliding-window layers speculation runs at the global
// layers only: a sliding layer attends over its window, dense, exactly as a
// session that does not speculate, and records no speculation step; a global
// layer attends over the speculated tokens (all of them when alpha keeps
// everything: the dense output). A speculation pool is refused there.
TEST_F(WorkerSpeculationTest, OnASlidingModelOnlyGlobalLayersSpeculate) {
  ModelShape shape = kShape;
  shape.window = {20, 0, 20, 0};  // Cuts the previous round at every decode step.
  const spec::SkewModel skew = MakeSkew(0.25);
  auto skew_id = engine_->skews().Put(spec::SerializeSkew(skew));
  ASSERT_TRUE(skew_id.ok());
  const int d = kShape.head_dim, hq = kShape.q_heads, hkv = kShape.kv_heads;
  for (float alpha : {1e6f, 0.5f}) {
    SCOPED_TRACE(alpha);
    const int tag = alpha > 1e5f ? 0 : 1;
    const worker::SessionKey dense(absl::StrCat("dense-", tag)), spec(absl::StrCat("spec-", tag));
    KVT_ASSERT_OK(engine_->OpenSession(dense, shape, Policy("", 0)));
    KVT_ASSERT_OK(engine_->OpenSession(spec, shape, Policy(*skew_id, alpha)));
    std::mt19937 rng(13);
    std::vector<double> worst(kShape.layers, 0.0);
    worker::EndRoundReport last;
    for (int r = 0; r < 3; ++r) {
      for (int l = 0; l < kShape.layers; ++l) {
        const auto q = Random(10 * hq * d, &rng), k = Random(10 * hkv * d, &rng),
                   v = Random(10 * hkv * d, &rng);
        std::vector<float> out(q.size());
        for (const auto* id : {&dense, &spec}) {
          ASSERT_THAT(engine_->PrefillLayer(*id, l, 10, 0, q.data(), k.data(), v.data(), out.data())
                          .status(),
                      IsOk());
        }
      }
      for (int step = 0; step < 4; ++step) {
        for (int l = 0; l < kShape.layers; ++l) {
          const auto q = Random(hq * d, &rng), k = Random(hkv * d, &rng), v = Random(hkv * d, &rng),
                     next = Random(hq * d, &rng);
          const float* qn = l + 1 < kShape.layers ? next.data() : nullptr;
          std::vector<float> a(q.size()), b(q.size());
          KVT_ASSERT_OK(engine_->DecodeLayer(dense, l, q.data(), k.data(), v.data(), a.data(), qn));
          KVT_ASSERT_OK(engine_->DecodeLayer(spec, l, q.data(), k.data(), v.data(), b.data(), qn));
          for (size_t i = 0; i < a.size(); ++i) {
            worst[l] = std::max(worst[l], std::fabs(double(a[i]) - b[i]));
          }
        }
      }
      KVT_ASSERT_OK(engine_->EndRound(dense).status());
      auto rep = engine_->EndRound(spec);
      ASSERT_TRUE(rep.ok()) << rep.status();
      last = *rep;
    }
    EXPECT_LT(worst[0], 1e-5);  // Sliding: dense on both sessions.
    EXPECT_LT(worst[2], 1e-5);
    if (alpha > 1e5f) {
      EXPECT_LT(worst[1], 1e-4);  // Everything kept: the dense output.
      EXPECT_LT(worst[3], 1e-4);
    } else {
      EXPECT_GT(worst[1] + worst[3], 1e-3);  // Speculation dropped tokens.
    }
    ASSERT_EQ(last.speculation.size(), static_cast<size_t>(kShape.layers));
    EXPECT_EQ(last.speculation[0].steps, 0u);
    EXPECT_EQ(last.speculation[2].steps, 0u);
    EXPECT_GT(last.speculation[1].steps, 0u);
    EXPECT_GT(last.speculation[3].steps, 0u);
    KVT_ASSERT_OK(engine_->CloseSession(dense, /*delete_from_store=*/true));
    KVT_ASSERT_OK(engine_->CloseSession(spec, /*delete_from_store=*/true));
  }
  SessionPolicy pooled = Policy(*skew_id, 4);
  pooled.speculation.pool_bytes = 1 << 20;
  EXPECT_THAT(engine_->OpenSession(worker::SessionKey("pooled"), shape, pooled),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("sliding")));
}

TEST_F(WorkerSpeculationTest, BadNextQueryIsRefused) {
  auto id = engine_->skews().Put(spec::SerializeSkew(MakeSkew(0.25)));
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
    for (v1::TensorRole role : {v1::TENSOR_ROLE_KEY, v1::TENSOR_ROLE_VALUE}) {
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

// Where a speculating session speculates: on the GPU when the worker may use
// one and one is there, with its past rounds in the host pool either way.
TEST_F(WorkerSpeculationTest, SpeculatingSessionsUseTheGpuWhenThereIsOne) {
  const std::string bytes = spec::SerializeSkew(MakeSkew(0.25));
  using Placement = worker::EngineOptions::Placement;
  for (Placement placement : {Placement::kAuto, Placement::kDevice, Placement::kHost}) {
    worker::EngineOptions o;
    o.level = KernelLevel::kReference;
    o.placement = placement;
    Engine engine(stack_.segments(), o);
    auto id = engine.skews().Put(bytes);
    ASSERT_TRUE(id.ok()) << id.status();
    const worker::SessionKey sid(absl::StrCat("place-", static_cast<int>(placement)));
    const absl::Status st = engine.OpenSession(sid, kShape, Policy(*id, 4));
    if (placement == Placement::kDevice && !worker::DeviceUsable()) {
      EXPECT_THAT(st, StatusIs(absl::StatusCode::kFailedPrecondition,
                               ::testing::HasSubstr("cannot speculate on a device")));
      continue;
    }
    KVT_ASSERT_OK(st);
    auto stats = engine.Stats(sid);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_FALSE(stats->on_device);  // Past rounds stay in the host pool.
    EXPECT_EQ(stats->speculation_on_device,
              placement != Placement::kHost && worker::DeviceUsable());
    // Speculation off: the speculator goes; on again: it comes back.
    KVT_ASSERT_OK(engine.UpdatePolicy(sid, Policy("", 4)));
    EXPECT_FALSE(engine.Stats(sid)->speculation_on_device);
    KVT_ASSERT_OK(engine.UpdatePolicy(sid, Policy(*id, 4)));
    EXPECT_EQ(engine.Stats(sid)->speculation_on_device, stats->speculation_on_device);
  }
}

// ---- On the GPU (a second ctest entry, label gpu, runs these) ----

#define SKIP_WITHOUT_GPU()                                         \
  if (!worker::DeviceUsable()) {                                   \
    GTEST_SKIP() << "speculation on the GPU needs a CUDA device: " \
                 << worker::DeviceStatus().message();              \
  }

// The GPU's selection, gather and attention against the longhand, as
// AttendsTheLonghandSelection checks the CPU's; and the same figures.
TEST_F(WorkerSpeculationTest, AttendsTheLonghandSelectionOnTheGpu) {
  SKIP_WITHOUT_GPU();
  const spec::SkewModel skew = MakeSkew(0.25);
  worker::EngineOptions o;
  o.level = KernelLevel::kReference;
  o.placement = worker::EngineOptions::Placement::kDevice;
  Engine gpu(stack_.segments(), o);
  auto id = gpu.skews().Put(spec::SerializeSkew(skew));
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_EQ(*engine_->skews().Put(spec::SerializeSkew(skew)), *id);
  for (float alpha : {0.5f, 4.0f}) {
    double worst_gpu = 0, worst_cpu = 0;
    const std::string tag = absl::StrCat(alpha);
    const auto on_gpu =
        RunAndCheck(&gpu, skew, Policy(*id, alpha), 3, 12, 20, &worst_gpu, "gpu-" + tag);
    const auto on_cpu =
        RunAndCheck(engine_.get(), skew, Policy(*id, alpha), 3, 12, 20, &worst_cpu, "cpu-" + tag);
    EXPECT_LT(worst_gpu, 1e-4) << "alpha " << alpha;
    EXPECT_LT(worst_cpu, 1e-4) << "alpha " << alpha;
    ASSERT_EQ(on_gpu.size(), on_cpu.size());
    for (size_t r = 0; r < on_gpu.size(); ++r) {
      ASSERT_EQ(on_gpu[r].speculation.size(), on_cpu[r].speculation.size());
      for (size_t l = 0; l < on_gpu[r].speculation.size(); ++l) {
        const worker::SpeculationLayerStats &g = on_gpu[r].speculation[l],
                                            &c = on_cpu[r].speculation[l];
        EXPECT_EQ(g.steps, c.steps) << "round " << r << " layer " << l;
        EXPECT_EQ(g.kept, c.kept) << "round " << r << " layer " << l;
        EXPECT_EQ(g.gathered, c.gathered) << "round " << r << " layer " << l;
        EXPECT_EQ(g.bytes_speculative, c.bytes_speculative) << "round " << r << " layer " << l;
        EXPECT_EQ(g.sampled, c.sampled) << "round " << r << " layer " << l;
      }
    }
  }
}

// KIVI-4 past rounds, a budget and a pool cap that trims: the GPU and the
// CPU attend the same tokens step by step.
TEST_F(WorkerSpeculationTest, MatchesTheCpuWithKiviBudgetAndPoolOnTheGpu) {
  SKIP_WITHOUT_GPU();
  worker::EngineOptions o;
  o.level = KernelLevel::kReference;
  o.placement = worker::EngineOptions::Placement::kAuto;
  Engine gpu(stack_.segments(), o);
  const std::string bytes = spec::SerializeSkew(MakeSkew(0.25));
  auto id = gpu.skews().Put(bytes);
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(engine_->skews().Put(bytes).ok());
  SessionPolicy policy = Policy(*id, 4.0f, /*budget=*/6);
  auto kivi = ParseCodecSetting("kivi4:g=8");
  ASSERT_TRUE(kivi.ok());
  policy.codec = *kivi;
  policy.speculation.pool_bytes = 9000;
  const worker::SessionKey g_id("gk"), c_id("ck");
  KVT_ASSERT_OK(gpu.OpenSession(g_id, kShape, policy));
  KVT_ASSERT_OK(engine_->OpenSession(c_id, kShape, policy));
  ASSERT_TRUE(gpu.Stats(g_id)->speculation_on_device);
  std::mt19937 rng(23);
  const int d = kShape.head_dim, hq = kShape.q_heads, hkv = kShape.kv_heads;
  double worst = 0;
  for (int r = 0; r < 4; ++r) {
    for (int l = 0; l < kShape.layers; ++l) {
      const auto q = Random(24 * hq * d, &rng), k = Random(24 * hkv * d, &rng),
                 v = Random(24 * hkv * d, &rng);
      std::vector<float> a(q.size()), b(q.size());
      KVT_ASSERT_OK(gpu.PrefillLayer(g_id, l, 24, 0, q.data(), k.data(), v.data(), a.data()));
      KVT_ASSERT_OK(engine_->PrefillLayer(c_id, l, 24, 0, q.data(), k.data(), v.data(), b.data()));
    }
    for (int step = 0; step < 6; ++step) {
      for (int l = 0; l < kShape.layers; ++l) {
        const auto q = Random(hq * d, &rng), k = Random(hkv * d, &rng), v = Random(hkv * d, &rng),
                   qn = Random(hq * d, &rng);
        const float* next = l + 1 < kShape.layers ? qn.data() : nullptr;
        std::vector<float> a(q.size()), b(q.size());
        KVT_ASSERT_OK(gpu.DecodeLayer(g_id, l, q.data(), k.data(), v.data(), a.data(), next));
        KVT_ASSERT_OK(engine_->DecodeLayer(c_id, l, q.data(), k.data(), v.data(), b.data(), next));
        for (size_t i = 0; i < a.size(); ++i)
          worst = std::max(worst, double(std::fabs(a[i] - b[i])));
      }
    }
    auto ga = gpu.EndRound(g_id);
    auto cb = engine_->EndRound(c_id);
    ASSERT_TRUE(ga.ok() && cb.ok());
    EXPECT_EQ(ga->pool.evicted_tokens, cb->pool.evicted_tokens);
    for (size_t l = 0; l < ga->speculation.size(); ++l) {
      EXPECT_EQ(ga->speculation[l].gathered, cb->speculation[l].gathered) << "layer " << l;
    }
  }
  EXPECT_LT(worst, 1e-4);
  auto st = gpu.Stats(g_id);
  ASSERT_TRUE(st.ok());
  EXPECT_GT(st->device_bytes, 0u);
}

}  // namespace
}  // namespace kvtier
