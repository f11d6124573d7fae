// A session moving between workers (the prefill -> decode hand-off) against
// a real kvtier-store process: the engine's export and import, layer by
// layer during a prefill, give outputs bit-identical to one worker doing
// everything, round after round; and each refusal has its status.
#include <cstring>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/half.h"
#include "kernels/recall.h"
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

// One step's inputs for every layer.
struct Step {
  int64_t n = 0;
  std::vector<std::vector<float>> q, k, v;
};

Step MakeStep(int64_t n, std::mt19937* rng) {
  std::normal_distribution<float> nd;
  auto draw = [&](int64_t count) {
    std::vector<float> x(static_cast<size_t>(count));
    for (float& e : x) e = HalfToFloat(FloatToHalf(nd(*rng)));
    return x;
  };
  Step s;
  s.n = n;
  for (int l = 0; l < kShape.layers; ++l) {
    s.q.push_back(draw(n * kShape.q_heads * kShape.head_dim));
    s.k.push_back(draw(n * kShape.kv_heads * kShape.head_dim));
    s.v.push_back(draw(n * kShape.kv_heads * kShape.head_dim));
  }
  return s;
}

// Runs `step` on `e`; `after_layer(l)` runs after each layer. Returns the
// outputs of every layer, concatenated.
std::vector<float> RunStep(Engine& e, const std::string& id, const Step& step, bool prefill,
                           const std::function<void(int)>& after_layer = nullptr) {
  std::vector<float> all;
  for (int l = 0; l < kShape.layers; ++l) {
    std::vector<float> out(step.q[l].size());
    if (prefill) {
      auto r = e.PrefillLayer(id, l, step.n, 0, step.q[l].data(), step.k[l].data(),
                              step.v[l].data(), out.data());
      EXPECT_TRUE(r.ok()) << r.status();
    } else {
      absl::Status st =
          e.DecodeLayer(id, l, step.q[l].data(), step.k[l].data(), step.v[l].data(), out.data());
      EXPECT_TRUE(st.ok()) << st;
    }
    all.insert(all.end(), out.begin(), out.end());
    if (after_layer) after_layer(l);
  }
  return all;
}

bool Same(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// Moves `id` from `from` to `to` between steps.
absl::Status Move(Engine& from, Engine& to, const std::string& id) {
  auto image = from.ExportSession(id);
  if (!image.ok()) return image.status();
  std::vector<worker::LayerImage> layers;
  for (int l = 0; l < kShape.layers; ++l) {
    auto li = from.ExportLayer(id, l);
    if (!li.ok()) return li.status();
    layers.push_back(std::move(*li));
  }
  if (absl::Status st = from.ExportTail(id, &*image); !st.ok()) return st;
  if (absl::Status st = to.ImportSession(id, *image, std::move(layers)); !st.ok()) return st;
  return from.ForgetSession(id);
}

class WorkerTransferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVT_ASSERT_OK(stack_.Start());
    for (auto* e : {&prefill_, &decode_, &single_}) {
      worker::EngineOptions o;
      o.placement = worker::EngineOptions::Placement::kHost;
      *e = std::make_unique<Engine>(stack_.segments(), o);
    }
  }

  static SessionPolicy Policy(const std::string& codec) {
    SessionPolicy p;
    p.codec = *ParseCodecSetting(codec);
    p.eviction = *evict::ParsePolicy("snapkv:24:w=8");
    p.recall = *ParseRecall("topk:1");
    p.keep_recent_round = false;
    return p;
  }

  testing::StoreStack stack_;
  std::unique_ptr<Engine> prefill_, decode_, single_;
};

// Four rounds: each prefilled on one worker, streamed to the other layer by
// layer while the prefill runs, decoded and ended there, and handed back
// between rounds. Every output equals the single worker's, bit for bit,
// under a lossless and a quantizing codec (eviction and a fetched recall
// included: the same state gives the same bits).
TEST_F(WorkerTransferTest, HandOffEveryRoundMatchesOneWorker) {
  for (const std::string codec : {"fp16", "kivi4"}) {
    SCOPED_TRACE(codec);
    const std::string moved = "moved-" + codec, alone = "alone-" + codec;
    KVT_ASSERT_OK(prefill_->OpenSession(moved, kShape, Policy(codec)));
    KVT_ASSERT_OK(single_->OpenSession(alone, kShape, Policy(codec)));
    std::mt19937 rng(7);
    for (int round = 0; round < 4; ++round) {
      SCOPED_TRACE(round);
      const Step prompt = MakeStep(40 + round * 9, &rng);
      // The prefill, each layer exported as soon as it is done.
      KVT_ASSERT_OK_AND_ASSIGN(auto image, prefill_->ExportSession(moved));
      std::vector<worker::LayerImage> layers;
      const std::vector<float> got = RunStep(*prefill_, moved, prompt, true, [&](int l) {
        auto li = prefill_->ExportLayer(moved, l);
        ASSERT_TRUE(li.ok()) << li.status();
        if (l + 1 < kShape.layers) {
          // The next layer is not done yet.
          EXPECT_THAT(prefill_->ExportLayer(moved, l + 1).status(),
                      StatusIs(absl::StatusCode::kFailedPrecondition));
        }
        layers.push_back(std::move(*li));
      });
      const std::vector<float> want = RunStep(*single_, alone, prompt, true);
      EXPECT_TRUE(Same(got, want));
      KVT_ASSERT_OK(prefill_->ExportTail(moved, &image));
      KVT_ASSERT_OK(decode_->ImportSession(moved, image, std::move(layers)));
      KVT_ASSERT_OK(prefill_->ForgetSession(moved));
      EXPECT_THAT(prefill_->Stats(moved).status(), StatusIs(absl::StatusCode::kNotFound));
      EXPECT_EQ(prefill_->TotalWorkingSetBytes(), 0u);
      // Decode on the other worker.
      for (int t = 0; t < 5; ++t) {
        const Step tok = MakeStep(1, &rng);
        EXPECT_TRUE(
            Same(RunStep(*decode_, moved, tok, false), RunStep(*single_, alone, tok, false)))
            << "decode step " << t;
      }
      KVT_ASSERT_OK_AND_ASSIGN(auto a, decode_->EndRound(moved));
      KVT_ASSERT_OK_AND_ASSIGN(auto b, single_->EndRound(alone));
      EXPECT_EQ(a.round, b.round);
      EXPECT_EQ(a.stored_bytes, b.stored_bytes);
      EXPECT_EQ(a.working_set_bytes, b.working_set_bytes);
      EXPECT_EQ(a.full_cache_bytes, b.full_cache_bytes);
      if (round > 0) {
        KVT_ASSERT_OK_AND_ASSIGN(auto sa, decode_->Stats(moved));
        KVT_ASSERT_OK_AND_ASSIGN(auto sb, single_->Stats(alone));
        EXPECT_EQ(sa.rounds, sb.rounds);
        EXPECT_EQ(sa.tokens, sb.tokens);
      }
      // Back to the prefill worker, idle, for the next round.
      KVT_ASSERT_OK(Move(*decode_, *prefill_, moved));
      EXPECT_EQ(decode_->TotalWorkingSetBytes(), 0u);
    }
    KVT_ASSERT_OK(prefill_->CloseSession(moved, true));
    KVT_ASSERT_OK(single_->CloseSession(alone, true));
  }
}

// A prefill whose transfer failed is undone, and sending it again gives the
// same outputs as sending it once.
TEST_F(WorkerTransferTest, RevertPrefillUndoesTheStep) {
  const SessionPolicy p = Policy("fp16");
  KVT_ASSERT_OK(prefill_->OpenSession("s", kShape, p));
  KVT_ASSERT_OK(single_->OpenSession("s", kShape, p));
  std::mt19937 rng(3);
  for (int round = 0; round < 2; ++round) {
    const Step prompt = MakeStep(30, &rng), more = MakeStep(6, &rng);
    RunStep(*prefill_, "s", prompt, true);
    KVT_ASSERT_OK(prefill_->RevertPrefill("s", prompt.n));
    EXPECT_THAT(prefill_->RevertPrefill("s", prompt.n),
                StatusIs(absl::StatusCode::kFailedPrecondition));
    EXPECT_TRUE(Same(RunStep(*prefill_, "s", prompt, true), RunStep(*single_, "s", prompt, true)));
    // A second prefill of the round, undone alone.
    RunStep(*prefill_, "s", more, true);
    KVT_ASSERT_OK(prefill_->RevertPrefill("s", more.n));
    EXPECT_TRUE(Same(RunStep(*prefill_, "s", more, true), RunStep(*single_, "s", more, true)));
    KVT_ASSERT_OK(prefill_->EndRound("s").status());
    KVT_ASSERT_OK(single_->EndRound("s").status());
  }
}

TEST_F(WorkerTransferTest, ImportRefusals) {
  const SessionPolicy p = Policy("kivi4");
  KVT_ASSERT_OK(prefill_->OpenSession("s", kShape, p));
  std::mt19937 rng(5);
  RunStep(*prefill_, "s", MakeStep(20, &rng), true);
  KVT_ASSERT_OK(prefill_->EndRound("s").status());
  RunStep(*prefill_, "s", MakeStep(20, &rng), true);
  auto export_all = [&]() {
    std::vector<worker::LayerImage> layers;
    for (int l = 0; l < kShape.layers; ++l) layers.push_back(*prefill_->ExportLayer("s", l));
    return layers;
  };
  KVT_ASSERT_OK_AND_ASSIGN(auto image, prefill_->ExportSession("s"));
  KVT_ASSERT_OK(prefill_->ExportTail("s", &image));

  // Already held.
  KVT_ASSERT_OK(decode_->OpenSession("s", kShape, p));
  EXPECT_THAT(decode_->ImportSession("s", image, export_all()),
              StatusIs(absl::StatusCode::kAlreadyExists));
  KVT_ASSERT_OK(decode_->CloseSession("s", false));

  // Corrupt tensors.
  auto layers = export_all();
  std::string bad = *layers[0].past;
  bad[bad.size() / 2] ^= 0x5a;
  bad.resize(bad.size() - 3);
  layers[0].past = std::make_shared<const std::string>(bad);
  EXPECT_THAT(decode_->ImportSession("s", image, std::move(layers)),
              StatusIs(absl::StatusCode::kDataLoss));

  // An open round of the wrong size, a missing layer, an unknown selection.
  layers = export_all();
  layers[2].open.pop_back();
  EXPECT_THAT(decode_->ImportSession("s", image, std::move(layers)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  layers = export_all();
  layers.pop_back();
  EXPECT_THAT(decode_->ImportSession("s", image, std::move(layers)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  auto wrong = image;
  wrong.selected = {9};
  EXPECT_THAT(decode_->ImportSession("s", wrong, export_all()),
              StatusIs(absl::StatusCode::kInvalidArgument));

  // Out of budget.
  {
    worker::EngineOptions o;
    o.placement = worker::EngineOptions::Placement::kHost;
    o.max_working_set_bytes = 1000;
    Engine small(stack_.segments(), o);
    EXPECT_THAT(small.CheckImport("s", 5000), StatusIs(absl::StatusCode::kResourceExhausted));
    EXPECT_THAT(small.ImportSession("s", image, export_all()),
                StatusIs(absl::StatusCode::kResourceExhausted));
    EXPECT_EQ(small.SessionCount(), 0);
    EXPECT_EQ(small.TotalWorkingSetBytes(), 0u);
  }
  // None of it touched the receiver, which still takes the session.
  EXPECT_EQ(decode_->SessionCount(), 0);
  EXPECT_EQ(decode_->TotalWorkingSetBytes(), 0u);
  KVT_ASSERT_OK(decode_->ImportSession("s", image, export_all()));
  KVT_ASSERT_OK_AND_ASSIGN(auto a, decode_->Stats("s"));
  KVT_ASSERT_OK_AND_ASSIGN(auto b, prefill_->Stats("s"));
  EXPECT_EQ(a.working_set_bytes, b.working_set_bytes);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.full_cache_bytes, b.full_cache_bytes);

  // The tail in the middle of a step.
  const Step s = MakeStep(4, &rng);
  std::vector<float> out(s.q[0].size());
  KVT_ASSERT_OK(
      prefill_->PrefillLayer("s", 0, 4, 0, s.q[0].data(), s.k[0].data(), s.v[0].data(), out.data())
          .status());
  EXPECT_THAT(prefill_->ExportTail("s", &image), StatusIs(absl::StatusCode::kFailedPrecondition));
  KVT_ASSERT_OK(prefill_->AbortStep("s"));
}

}  // namespace
}  // namespace kvtier
