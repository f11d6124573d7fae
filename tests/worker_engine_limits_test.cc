// The worker engine's refusals and limits over an in-memory store: bad
// shapes, policies, order and values refused where they arrive; sixteen
// sessions at once; the session cap, the working-set budget, per-tenant and
// default tenant limits, and incoming hand-offs counted against them.
#include <cmath>
#include <limits>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/codec.h"
#include "kernels/half.h"
#include "tests/util/engine_fixture.h"
#include "tests/util/status_matchers.h"
#include "worker/engine.h"
#include "worker/memory_store.h"
#include "worker/transfer.h"

namespace kvtier {
namespace {

using ::kvtier::testing::IsOk;
using ::kvtier::testing::StatusIs;
using Op = worker::MemorySegmentStore::Op;
using ::kvtier::engine_test::Handoff;
using ::kvtier::engine_test::kShape;
using ::kvtier::engine_test::LocalCache;
using ::kvtier::engine_test::Random;
using ::kvtier::engine_test::ReferenceKernels;
using ::kvtier::engine_test::WorkerEngineTest;
using worker::Engine;
using worker::ModelShape;
using worker::SessionPolicy;

TEST_F(WorkerEngineTest, RejectsBadShapesPoliciesAndOrder) {
  EXPECT_THAT(engine_->OpenSession("x",
                                   ModelShape{.layers = 4,
                                              .q_heads = 6,
                                              .kv_heads = 4,
                                              .head_dim = 16,
                                              .dtype = DType::kFp16,
                                              .window = {}},
                                   {}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  SessionPolicy p;
  p.watershed_layer = 3;
  EXPECT_THAT(engine_->OpenSession("x", kShape, p), StatusIs(absl::StatusCode::kInvalidArgument));
  KVT_ASSERT_OK(engine_->OpenSession("x", kShape, {}));
  EXPECT_THAT(engine_->OpenSession("x", kShape, {}), StatusIs(absl::StatusCode::kAlreadyExists));
  const int d = kShape.head_dim;
  const std::vector<float> q(2 * kShape.q_heads * d, 0.1f), kv(2 * kShape.kv_heads * d, 0.1f);
  std::vector<float> out(q.size());
  EXPECT_THAT(
      engine_->PrefillLayer("x", 1, 2, 0, q.data(), kv.data(), kv.data(), out.data()).status(),
      StatusIs(absl::StatusCode::kFailedPrecondition));
  KVT_ASSERT_OK(
      engine_->PrefillLayer("x", 0, 2, 0, q.data(), kv.data(), kv.data(), out.data()).status());
  // A new step while this one is in flight (a retry whose first call the
  // worker has not rolled back yet): UNAVAILABLE, worth retrying.
  EXPECT_THAT(
      engine_->PrefillLayer("x", 0, 2, 0, q.data(), kv.data(), kv.data(), out.data()).status(),
      StatusIs(absl::StatusCode::kUnavailable, ::testing::HasSubstr("retry")));
  EXPECT_THAT(
      engine_->PrefillLayer("x", 1, 1, 0, q.data(), kv.data(), kv.data(), out.data()).status(),
      StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(
      engine_->PrefillLayer("x", 9, 2, 0, q.data(), kv.data(), kv.data(), out.data()).status(),
      StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(engine_->EndRound("x").status(), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(WorkerEngineTest, SixteenSessionsAtOnce) {
  std::vector<std::thread> threads;
  std::vector<double> worst(16, 0);
  for (int i = 0; i < 16; ++i) {
    threads.emplace_back([&, i] {
      const std::string id = "c" + std::to_string(i);
      SessionPolicy p;
      p.recall = {RecallMode::kAll, 0};
      p.watershed_layer = 1;
      ASSERT_TRUE(engine_->OpenSession(id, kShape, p).ok());
      LocalCache local(kShape);
      std::mt19937 rng(100 + i);
      for (int r = 0; r < 3; ++r) {
        worst[i] = std::max(worst[i], Round(id, 8, 3, 2, &rng, &local));
        ASSERT_TRUE(engine_->EndRound(id).ok());
      }
      ASSERT_TRUE(engine_->CloseSession(id, /*delete_from_store=*/true).ok());
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 16; ++i) EXPECT_LT(worst[i], 1e-5) << "session " << i;
  EXPECT_TRUE(engine_->Sessions().empty());
}

// Non-finite q/k/v, and K/V outside fp16 range for a codec that stores fp16,
// are refused where they arrive (INVALID_ARGUMENT naming layer and element),
// nothing is appended, and the round carries on; before, they were accepted
// and EndRound failed on every retry.
TEST_F(WorkerEngineTest, BadValuesAreRefusedWhereTheyArrive) {
  SessionPolicy p;
  KVT_ASSERT_OK_AND_ASSIGN(p.codec, ParseCodecSetting("kivi4"));
  KVT_ASSERT_OK(engine_->OpenSession("s", kShape, p));
  std::mt19937 rng(6);
  const int d = kShape.head_dim;
  const int64_t n = 3;
  auto q = Random(n * kShape.q_heads * d, &rng), k = Random(n * kShape.kv_heads * d, &rng),
       v = Random(n * kShape.kv_heads * d, &rng);
  std::vector<float> out(q.size());
  KVT_ASSERT_OK(engine_->PrefillLayer("s", 0, n, 0, q.data(), k.data(), v.data(), out.data()));
  auto bad = k;
  bad[kShape.kv_heads * d + 5] = std::numeric_limits<float>::quiet_NaN();  // Token 1, head 0.
  auto r = engine_->PrefillLayer("s", 1, n, 0, q.data(), bad.data(), v.data(), out.data());
  EXPECT_THAT(r.status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("layer 1: k[1, 0, 5]"));
  bad = v;
  bad[0] = 1e6f;  // Finite, but past what KIVI's fp16 scales hold.
  EXPECT_THAT(
      engine_->PrefillLayer("s", 1, n, 0, q.data(), k.data(), bad.data(), out.data()).status(),
      StatusIs(absl::StatusCode::kInvalidArgument));
  auto inf_q = q;
  inf_q[3] = std::numeric_limits<float>::infinity();
  EXPECT_THAT(
      engine_->PrefillLayer("s", 1, n, 0, inf_q.data(), k.data(), v.data(), out.data()).status(),
      StatusIs(absl::StatusCode::kInvalidArgument));
  // Nothing was appended: the step goes on at layer 1 and the round ends.
  for (int l = 1; l < kShape.layers; ++l) {
    KVT_ASSERT_OK(engine_->PrefillLayer("s", l, n, 0, q.data(), k.data(), v.data(), out.data()));
  }
  KVT_ASSERT_OK_AND_ASSIGN(auto end, engine_->EndRound("s"));
  EXPECT_EQ(end.full_bytes, static_cast<uint64_t>(n) * kShape.layers * kShape.kv_heads * d * 2 * 2);

  // A raw fp32 session of an fp32 model stores 1e6 as it is; of an fp16
  // model it cannot (the open round holds fp16).
  ModelShape fp32 = kShape;
  fp32.dtype = DType::kFp32;
  KVT_ASSERT_OK(engine_->OpenSession("raw", fp32, SessionPolicy{}));
  bad = v;
  bad[0] = 1e6f;
  KVT_ASSERT_OK(engine_->PrefillLayer("raw", 0, n, 0, q.data(), k.data(), bad.data(), out.data()));
  KVT_ASSERT_OK(engine_->OpenSession("raw16", kShape, SessionPolicy{}));
  EXPECT_THAT(
      engine_->PrefillLayer("raw16", 0, n, 0, q.data(), k.data(), bad.data(), out.data()).status(),
      StatusIs(absl::StatusCode::kInvalidArgument));
}

// The session cap and the working-set budget: RESOURCE_EXHAUSTED at the
// edge, with every session left as it was.
// One whole prefill step of n random tokens for `id`.
absl::Status PrefillAll(Engine& engine, const worker::SessionKey& id, int64_t n,
                        std::mt19937* rng) {
  const int d = kShape.head_dim;
  for (int l = 0; l < kShape.layers; ++l) {
    const auto q = Random(n * kShape.q_heads * d, rng), k = Random(n * kShape.kv_heads * d, rng),
               v = Random(n * kShape.kv_heads * d, rng);
    std::vector<float> out(q.size());
    auto r = engine.PrefillLayer(id, l, n, 0, q.data(), k.data(), v.data(), out.data());
    if (!r.ok()) return r.status();
  }
  return absl::OkStatus();
}

TEST_F(WorkerEngineTest, SessionCapAndWorkingSetBudget) {
  worker::EngineOptions o = ReferenceKernels();
  o.max_sessions = 2;
  // Room for 10 tokens of kShape (10 * 4 layers * 2 heads * 16 * 2 * 2 bytes).
  o.max_working_set_bytes = 10 * 4 * 2 * 16 * 2 * 2;
  Engine engine(&store_, o);
  KVT_ASSERT_OK(engine.OpenSession("a", kShape, {}));
  KVT_ASSERT_OK(engine.OpenSession("b", kShape, {}));
  EXPECT_THAT(engine.OpenSession("c", kShape, {}), StatusIs(absl::StatusCode::kResourceExhausted));
  std::mt19937 rng(7);
  const int d = kShape.head_dim;
  auto prefill = [&](const std::string& id, int64_t n) { return PrefillAll(engine, id, n, &rng); };
  KVT_ASSERT_OK(prefill("a", 6));
  EXPECT_EQ(engine.totals().working_set_bytes, 6u * 4 * 2 * 16 * 2 * 2);
  EXPECT_THAT(prefill("b", 6), StatusIs(absl::StatusCode::kResourceExhausted));
  KVT_ASSERT_OK_AND_ASSIGN(auto stats, engine.Stats("b"));
  EXPECT_EQ(stats.tokens, 0u);
  KVT_ASSERT_OK(prefill("b", 4));  // Exactly the room left.
  std::vector<float> q(kShape.q_heads * d, 0.1f), kv(kShape.kv_heads * d, 0.1f), out(q.size());
  EXPECT_THAT(engine.DecodeLayer("a", 0, q.data(), kv.data(), kv.data(), out.data()),
              StatusIs(absl::StatusCode::kResourceExhausted));
  KVT_ASSERT_OK(engine.CloseSession("b", /*delete_from_store=*/true));
  EXPECT_EQ(engine.totals().working_set_bytes, 6u * 4 * 2 * 16 * 2 * 2);
  KVT_ASSERT_OK(engine.OpenSession("c", kShape, {}));
  for (int l = 0; l < kShape.layers; ++l) {
    KVT_ASSERT_OK(engine.DecodeLayer("a", l, q.data(), kv.data(), kv.data(), out.data()));
  }
  KVT_ASSERT_OK_AND_ASSIGN(stats, engine.Stats("a"));
  EXPECT_EQ(stats.tokens, 7u);
  KVT_ASSERT_OK(engine.CloseSession("a", true));
  KVT_ASSERT_OK(engine.CloseSession("c", true));
  EXPECT_EQ(engine.totals().working_set_bytes, 0u);
}

// Issue 14 #2, per tenant: the tenants file's max_sessions and
// max_working_set_mb bound one tenant without touching another.
TEST_F(WorkerEngineTest, PerTenantLimits) {
  worker::EngineOptions o = ReferenceKernels();
  // acme: 2 sessions, room for 10 tokens of kShape.
  o.tenant_limits["acme"] = {2, 10 * 4 * 2 * 16 * 2 * 2};
  Engine engine(&store_, o);
  const worker::SessionKey a1("acme", "1"), a2("acme", "2"), a3("acme", "3"), b1("bob", "1");
  KVT_ASSERT_OK(engine.OpenSession(a1, kShape, {}));
  KVT_ASSERT_OK(engine.OpenSession(a2, kShape, {}));
  EXPECT_THAT(engine.OpenSession(a3, kShape, {}), StatusIs(absl::StatusCode::kResourceExhausted,
                                                           ::testing::HasSubstr("tenant 'acme'")));
  KVT_ASSERT_OK(engine.OpenSession(b1, kShape, {}));
  std::mt19937 rng(9);
  auto prefill = [&](const worker::SessionKey& id, int64_t n) {
    return PrefillAll(engine, id, n, &rng);
  };
  KVT_ASSERT_OK(prefill(a1, 8));
  EXPECT_THAT(prefill(a2, 4), StatusIs(absl::StatusCode::kResourceExhausted,
                                       ::testing::HasSubstr("max_working_set_mb")));
  KVT_ASSERT_OK(prefill(b1, 64));  // bob has no limit.
  KVT_ASSERT_OK(prefill(a2, 2));   // What acme has left.
  // Closing gives the session and its bytes back to the tenant.
  KVT_ASSERT_OK(engine.CloseSession(a1, false));
  KVT_ASSERT_OK(engine.OpenSession(a3, kShape, {}));
  KVT_ASSERT_OK(prefill(a3, 8));
}

// A tenant the tenants file does not list (any tenant a node token acts
// for) gets default_tenant_limit: a hostile one reaches its share and stops
// there, RESOURCE_EXHAUSTED naming the limit, while another is served.
TEST_F(WorkerEngineTest, DefaultTenantLimitBindsUnlistedTenants) {
  worker::EngineOptions o = ReferenceKernels();
  o.default_tenant_limit = {3, 10 * 4 * 2 * 16 * 2 * 2};
  o.tenant_limits["big"] = {5, 0};
  Engine engine(&store_, o);
  for (int i = 0; i < 3; ++i)
    KVT_ASSERT_OK(engine.OpenSession({"evil", std::to_string(i)}, kShape, {}));
  EXPECT_THAT(engine.OpenSession({"evil", "3"}, kShape, {}),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       ::testing::HasSubstr("--tenant_max_sessions")));
  for (int i = 0; i < 5; ++i)
    KVT_ASSERT_OK(engine.OpenSession({"big", std::to_string(i)}, kShape, {}));
  KVT_ASSERT_OK(engine.OpenSession({"good", "0"}, kShape, {}));
  std::mt19937 rng(4);
  KVT_ASSERT_OK(PrefillAll(engine, {"evil", "0"}, 10, &rng));
  EXPECT_THAT(PrefillAll(engine, {"evil", "1"}, 1, &rng),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       ::testing::HasSubstr("--tenant_max_working_set_mb")));
  KVT_ASSERT_OK(PrefillAll(engine, {"good", "0"}, 10, &rng));
  KVT_ASSERT_OK(PrefillAll(engine, {"big", "0"}, 64, &rng));  // Its entry sets no byte limit.
}

// Bytes of sessions arriving by hand-off count from the first byte: two
// arrivals in flight cannot together pass the worker's budget or the
// tenant's, and what a hold took comes back when it goes.
TEST_F(WorkerEngineTest, IncomingHoldsCountAgainstTheBudgets) {
  worker::EngineOptions o = ReferenceKernels();
  o.max_working_set_bytes = 1000;
  o.tenant_limits["acme"] = {0, 600};
  Engine engine(&store_, o);
  auto a = Handoff(engine).HoldIncoming("acme");
  auto b = Handoff(engine).HoldIncoming("acme");
  auto c = Handoff(engine).HoldIncoming("bob");
  KVT_ASSERT_OK(a->Grow(400));
  EXPECT_THAT(b->Grow(300), StatusIs(absl::StatusCode::kResourceExhausted,
                                     ::testing::HasSubstr("tenant 'acme'")));
  KVT_ASSERT_OK(b->Grow(200));
  EXPECT_EQ(engine.totals().working_set_bytes, 600u);
  EXPECT_THAT(c->Grow(500), StatusIs(absl::StatusCode::kResourceExhausted,
                                     ::testing::HasSubstr("--max_working_set_mb")));
  KVT_ASSERT_OK(c->Grow(400));
  EXPECT_EQ(c->bytes(), 400u);
  a.reset();
  EXPECT_EQ(engine.totals().working_set_bytes, 600u);
  KVT_ASSERT_OK(b->Grow(400));
  b.reset();
  c.reset();
  EXPECT_EQ(engine.totals().working_set_bytes, 0u);
}

}  // namespace
}  // namespace kvtier
