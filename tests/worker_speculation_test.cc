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
using ::kvtier::speculation_test::Longhand;
using ::kvtier::speculation_test::MakeSkew;
using ::kvtier::speculation_test::Random;
using ::kvtier::speculation_test::WorkerSpeculationTest;
using ::kvtier::testing::IsOk;
using ::kvtier::testing::StatusIs;
using worker::Engine;
using worker::ModelShape;
using worker::SessionPolicy;

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
