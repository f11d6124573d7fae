// A session moving between workers (the prefill -> decode hand-off) against
// a real kvtier-store process: the engine's export and import, layer by
// layer during a prefill, give outputs bit-identical to one worker doing
// everything, round after round; and each refusal has its status.
#include <signal.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>

#include "absl/strings/str_cat.h"
#include "client/session_router.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "kernels/crc32c.h"
#include "kernels/encoded_tensor.h"
#include "kernels/half.h"
#include "kernels/recall.h"
#include "kernels/speculation.h"
#include "services/worker/transfer_proto.h"
#include "services/worker/worker_server.h"
#include "testing/store_process.h"
#include "testing/test_util.h"
#include "tests/util/status_matchers.h"
#include "tests/util/worker_stack.h"
#include "worker/engine.h"
#include "worker/transfer.h"

namespace kvtier {
namespace {

// The hand-off half of an engine's API (worker/transfer.h).
worker::SessionTransfer Handoff(worker::Engine& e) { return worker::SessionTransfer(&e); }

using ::kvtier::testing::IsOk;
using ::kvtier::testing::StatusIs;
using worker::Engine;
using worker::ModelShape;
using worker::SessionPolicy;

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

// Moves `id` from `from` to `to` between steps. With `reuse`, as a sending
// worker does: it leaves out what `to` kept of it (HeldRounds), and `from`
// keeps what it had. `left_out`: the past bytes not moved; `sent`: the past
// bytes moved.
absl::Status MoveReusing(Engine& from, Engine& to, const std::string& id, uint64_t* left_out,
                         uint64_t* sent, bool reuse = true) {
  *left_out = *sent = 0;
  auto image = Handoff(from).ExportSession(id);
  if (!image.ok()) return image.status();
  const std::vector<worker::HandoffCache::Held> held =
      reuse ? Handoff(to).HeldRounds(id, image->incarnation, absl::Now() + absl::Minutes(1))
            : std::vector<worker::HandoffCache::Held>();
  std::vector<worker::LayerImage> layers;
  for (int l = 0; l < kShape.layers; ++l) {
    auto li = Handoff(from).ExportLayer(id, l);
    if (!li.ok()) return li.status();
    *left_out += li->LeaveOut(held);
    *sent += li->past_size();
    layers.push_back(std::move(*li));
  }
  if (absl::Status st = Handoff(from).ExportTail(id, &*image); !st.ok()) return st;
  uint64_t reused = 0;
  if (absl::Status st = Handoff(to).ImportSession(id, *image, std::move(layers), &reused);
      !st.ok()) {
    return st;
  }
  if (*left_out != reused) {
    return absl::InternalError(absl::StrCat(*left_out, " bytes left out, ", reused,
                                            " bytes taken from the receiver's cache"));
  }
  return Handoff(from).ForgetSession(id, /*keep_rounds=*/reuse);
}

absl::Status Move(Engine& from, Engine& to, const std::string& id) {
  uint64_t left_out = 0, sent = 0;
  return MoveReusing(from, to, id, &left_out, &sent, /*reuse=*/false);
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
      KVT_ASSERT_OK_AND_ASSIGN(auto image, Handoff(*prefill_).ExportSession(moved));
      std::vector<worker::LayerImage> layers;
      const std::vector<float> got = RunStep(*prefill_, moved, prompt, true, [&](int l) {
        auto li = Handoff(*prefill_).ExportLayer(moved, l);
        ASSERT_TRUE(li.ok()) << li.status();
        if (l + 1 < kShape.layers) {
          // The next layer is not done yet.
          EXPECT_THAT(Handoff(*prefill_).ExportLayer(moved, l + 1).status(),
                      StatusIs(absl::StatusCode::kFailedPrecondition));
        }
        layers.push_back(std::move(*li));
      });
      const std::vector<float> want = RunStep(*single_, alone, prompt, true);
      EXPECT_TRUE(Same(got, want));
      KVT_ASSERT_OK(Handoff(*prefill_).ExportTail(moved, &image));
      KVT_ASSERT_OK(Handoff(*decode_).ImportSession(moved, image, std::move(layers)));
      KVT_ASSERT_OK(Handoff(*prefill_).ForgetSession(moved));
      EXPECT_THAT(prefill_->Stats(moved).status(), StatusIs(absl::StatusCode::kNotFound));
      EXPECT_EQ(prefill_->totals().working_set_bytes, 0u);
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
      EXPECT_EQ(decode_->totals().working_set_bytes, 0u);
    }
    KVT_ASSERT_OK(prefill_->CloseSession(moved, true));
    KVT_ASSERT_OK(single_->CloseSession(alone, true));
  }
}

// Incremental hand-off: each worker keeps the rounds of a session it hands
// off, so from the second round on only what the other worker gained
// travels: the prefill worker sends the open round (and the rounds recall
// brought), the decode worker sends back only the round it ended. Every
// output still equals one worker's, bit for bit, lossless and lossy.
TEST_F(WorkerTransferTest, HandBackReusesTheRoundsEachWorkerKept) {
  for (const std::string codec : {"fp16", "kivi4"}) {
    SCOPED_TRACE(codec);
    const std::string moved = "kept-" + codec, alone = "kept-alone-" + codec;
    KVT_ASSERT_OK(prefill_->OpenSession(moved, kShape, Policy(codec)));
    KVT_ASSERT_OK(single_->OpenSession(alone, kShape, Policy(codec)));
    std::mt19937 rng(17);
    uint64_t first_back = 0;
    for (int round = 0; round < 5; ++round) {
      SCOPED_TRACE(round);
      const Step prompt = MakeStep(40 + round * 9, &rng);
      EXPECT_TRUE(
          Same(RunStep(*prefill_, moved, prompt, true), RunStep(*single_, alone, prompt, true)));
      uint64_t left_out = 0, sent = 0;
      KVT_ASSERT_OK(MoveReusing(*prefill_, *decode_, moved, &left_out, &sent));
      // The decode worker kept every earlier round's lower layers.
      if (round > 0) {
        EXPECT_GT(left_out, 0u);
      } else {
        EXPECT_EQ(left_out, 0u);
      }
      EXPECT_EQ(prefill_->totals().working_set_bytes, 0u);
      for (int t = 0; t < 3; ++t) {
        const Step tok = MakeStep(1, &rng);
        EXPECT_TRUE(
            Same(RunStep(*decode_, moved, tok, false), RunStep(*single_, alone, tok, false)));
      }
      KVT_ASSERT_OK_AND_ASSIGN(auto a, decode_->EndRound(moved));
      KVT_ASSERT_OK_AND_ASSIGN(auto b, single_->EndRound(alone));
      EXPECT_EQ(a.stored_bytes, b.stored_bytes);
      EXPECT_EQ(a.working_set_bytes, b.working_set_bytes);
      KVT_ASSERT_OK(MoveReusing(*decode_, *prefill_, moved, &left_out, &sent));
      // Back: the round just ended, alone. Eviction keeps 24 tokens of every
      // round, so each round's lower layers are the same size (raw codec).
      if (round == 0) {
        EXPECT_EQ(left_out, 0u);
        first_back = sent;
      } else {
        EXPECT_GT(left_out, 0u);
        if (codec == "fp16") {
          EXPECT_EQ(sent, first_back);
        }
        EXPECT_LT(sent, left_out + sent);
      }
      EXPECT_GT(Handoff(*decode_).HandoffTotals().bytes, 0u);
      KVT_ASSERT_OK_AND_ASSIGN(auto sa, prefill_->Stats(moved));
      KVT_ASSERT_OK_AND_ASSIGN(auto sb, single_->Stats(alone));
      EXPECT_EQ(sa.working_set_bytes, sb.working_set_bytes);
      EXPECT_EQ(sa.rounds, sb.rounds);
    }
    // Closing drops what the worker kept; the other worker's copy goes with
    // its cache's LRU.
    KVT_ASSERT_OK(prefill_->CloseSession(moved, true));
    KVT_ASSERT_OK(single_->CloseSession(alone, true));
  }
}

// A speculating session with a host-pool cap: the decode worker's EndRound
// trims rounds the prefill worker still holds (untrimmed) in its hand-off
// cache. The hand-back must send the trimmed layers in full; with the cache
// standing in for them the prefill worker would attend tokens the pool
// evicted, and its outputs would part from one worker's.
TEST_F(WorkerTransferTest, HandBackSendsTrimmedLayersInFull) {
  spec::SkewModel skew;
  skew.model = "test";
  skew.layers = kShape.layers;
  skew.q_heads = kShape.q_heads;
  skew.kv_heads = kShape.kv_heads;
  skew.head_dim = kShape.head_dim;
  skew.partial_ratio = 0.25;
  skew.calibration_tokens = 32;
  std::mt19937 rng(29);
  for (int l = 0; l < kShape.layers; ++l) {
    const Step cal = MakeStep(32, &rng);
    auto heads = spec::CalibrateLayer(cal.q[l].data(), cal.k[l].data(), 32, kShape.q_heads,
                                      kShape.kv_heads, kShape.head_dim, 0.25);
    ASSERT_TRUE(heads.ok()) << heads.status();
    skew.heads.push_back(*heads);
  }
  const std::string bytes = spec::SerializeSkew(skew);
  std::string id;
  for (auto* e : {&prefill_, &decode_, &single_}) {
    KVT_ASSERT_OK_AND_ASSIGN(id, (*e)->skews().Put(bytes));
  }
  SessionPolicy p;
  p.codec = *ParseCodecSetting("fp16");
  p.recall = *ParseRecall("all");
  p.release_after_end_round = false;
  p.speculation.skew = id;
  p.speculation.pool_bytes = 24 << 10;
  // The low mark travels with the session too: both workers trim to it.
  p.speculation.pool_low_bytes = 16 << 10;
  KVT_ASSERT_OK(prefill_->OpenSession("t", kShape, p));
  KVT_ASSERT_OK(single_->OpenSession("t1", kShape, p));
  uint64_t trimmed = 0, left_out = 0, sent = 0;
  for (int round = 0; round < 5; ++round) {
    SCOPED_TRACE(round);
    const Step prompt = MakeStep(30, &rng);
    EXPECT_TRUE(Same(RunStep(*prefill_, "t", prompt, true), RunStep(*single_, "t1", prompt, true)));
    KVT_ASSERT_OK(MoveReusing(*prefill_, *decode_, "t", &left_out, &sent));
    for (int t = 0; t < 3; ++t) {
      const Step tok = MakeStep(1, &rng);
      EXPECT_TRUE(Same(RunStep(*decode_, "t", tok, false), RunStep(*single_, "t1", tok, false)));
    }
    KVT_ASSERT_OK_AND_ASSIGN(auto a, decode_->EndRound("t"));
    KVT_ASSERT_OK_AND_ASSIGN(auto b, single_->EndRound("t1"));
    EXPECT_EQ(a.pool.evicted_tokens, b.pool.evicted_tokens);
    EXPECT_EQ(a.pool.bytes_after, b.pool.bytes_after);
    trimmed += a.pool.evicted_tokens;
    KVT_ASSERT_OK(MoveReusing(*decode_, *prefill_, "t", &left_out, &sent));
    KVT_ASSERT_OK_AND_ASSIGN(auto sa, prefill_->Stats("t"));
    KVT_ASSERT_OK_AND_ASSIGN(auto sb, single_->Stats("t1"));
    EXPECT_EQ(sa.working_set_bytes, sb.working_set_bytes);
  }
  EXPECT_GT(trimmed, 0u);
  KVT_ASSERT_OK(prefill_->CloseSession("t", true));
  KVT_ASSERT_OK(single_->CloseSession("t1", true));
}

// A round the receiver was said to hold but dropped before the import
// (another life of the session name, or cache room) refuses the import,
// FAILED_PRECONDITION, and nothing stays; a second try without reuse moves it.
// A cache of 0 bytes keeps nothing and is never asked for anything.
TEST_F(WorkerTransferTest, ReuseOfARoundNoLongerHeldIsRefused) {
  const SessionPolicy p = Policy("fp16");
  KVT_ASSERT_OK(prefill_->OpenSession("r", kShape, p));
  std::mt19937 rng(23);
  uint64_t left_out = 0, sent = 0;
  RunStep(*prefill_, "r", MakeStep(30, &rng), true);
  KVT_ASSERT_OK(MoveReusing(*prefill_, *decode_, "r", &left_out, &sent));
  KVT_ASSERT_OK(decode_->EndRound("r").status());
  KVT_ASSERT_OK(MoveReusing(*decode_, *prefill_, "r", &left_out, &sent));
  RunStep(*prefill_, "r", MakeStep(30, &rng), true);
  // What decode_ kept, asked for; then the cache loses it (a new life of
  // the name opens and closes there) before the import.
  KVT_ASSERT_OK_AND_ASSIGN(auto image, Handoff(*prefill_).ExportSession("r"));
  const auto held =
      Handoff(*decode_).HeldRounds("r", image.incarnation, absl::Now() + absl::Minutes(1));
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(held[0].round, 0u);
  EXPECT_TRUE(Handoff(*decode_).HeldRounds("r", image.incarnation + 1, absl::Now()).empty());
  KVT_ASSERT_OK(decode_->OpenSession("r", kShape, p));
  KVT_ASSERT_OK(decode_->CloseSession("r", false));
  std::vector<worker::LayerImage> layers;
  for (int l = 0; l < kShape.layers; ++l) {
    KVT_ASSERT_OK_AND_ASSIGN(auto li, Handoff(*prefill_).ExportLayer("r", l));
    li.LeaveOut(held);
    layers.push_back(std::move(li));
  }
  EXPECT_FALSE(layers[0].reused.empty());
  KVT_ASSERT_OK(Handoff(*prefill_).ExportTail("r", &image));
  absl::Status refused = Handoff(*decode_).ImportSession("r", image, std::move(layers));
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(refused.message(), ::testing::HasSubstr("no longer holds"));
  EXPECT_EQ(decode_->totals().sessions, 0);
  EXPECT_EQ(decode_->totals().working_set_bytes, 0u);
  KVT_ASSERT_OK(MoveReusing(*prefill_, *decode_, "r", &left_out, &sent));
  EXPECT_EQ(left_out, 0u);
  EXPECT_GT(sent, 0u);

  // A worker without a cache.
  worker::EngineOptions o;
  o.placement = worker::EngineOptions::Placement::kHost;
  o.handoff_cache_bytes = 0;
  Engine none(stack_.segments(), o);
  KVT_ASSERT_OK(MoveReusing(*decode_, none, "r", &left_out, &sent));
  KVT_ASSERT_OK(MoveReusing(none, *decode_, "r", &left_out, &sent));
  EXPECT_EQ(Handoff(none).HandoffTotals().bytes, 0u);
  EXPECT_GT(left_out, 0u);  // decode_ kept its own.
  KVT_ASSERT_OK(decode_->CloseSession("r", true));
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
    KVT_ASSERT_OK(Handoff(*prefill_).RevertPrefill("s", prompt.n));
    EXPECT_THAT(Handoff(*prefill_).RevertPrefill("s", prompt.n),
                StatusIs(absl::StatusCode::kFailedPrecondition));
    EXPECT_TRUE(Same(RunStep(*prefill_, "s", prompt, true), RunStep(*single_, "s", prompt, true)));
    // A second prefill of the round, undone alone.
    RunStep(*prefill_, "s", more, true);
    KVT_ASSERT_OK(Handoff(*prefill_).RevertPrefill("s", more.n));
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
    for (int l = 0; l < kShape.layers; ++l)
      layers.push_back(*Handoff(*prefill_).ExportLayer("s", l));
    return layers;
  };
  KVT_ASSERT_OK_AND_ASSIGN(auto image, Handoff(*prefill_).ExportSession("s"));
  KVT_ASSERT_OK(Handoff(*prefill_).ExportTail("s", &image));

  // Already held.
  KVT_ASSERT_OK(decode_->OpenSession("s", kShape, p));
  EXPECT_THAT(Handoff(*decode_).ImportSession("s", image, export_all()),
              StatusIs(absl::StatusCode::kAlreadyExists));
  KVT_ASSERT_OK(decode_->CloseSession("s", false));

  // Corrupt tensors.
  auto layers = export_all();
  std::string bad = layers[0].PastBytes();  // Damaged below.
  ASSERT_GT(bad.size(), 100u);
  bad[bad.size() / 2] ^= 0x5a;
  bad.resize(bad.size() - 3);
  layers[0].past = std::make_shared<const std::string>(bad);
  layers[0].past_pieces.clear();
  EXPECT_THAT(Handoff(*decode_).ImportSession("s", image, std::move(layers)),
              StatusIs(absl::StatusCode::kDataLoss));

  // An open round of the wrong size, a missing layer, an unknown selection.
  layers = export_all();
  layers[2].open.pop_back();
  EXPECT_THAT(Handoff(*decode_).ImportSession("s", image, std::move(layers)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  layers = export_all();
  layers.pop_back();
  EXPECT_THAT(Handoff(*decode_).ImportSession("s", image, std::move(layers)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  auto wrong = image;
  wrong.selected = {9};
  EXPECT_THAT(Handoff(*decode_).ImportSession("s", wrong, export_all()),
              StatusIs(absl::StatusCode::kInvalidArgument));

  // Out of budget.
  {
    worker::EngineOptions o;
    o.placement = worker::EngineOptions::Placement::kHost;
    o.max_working_set_bytes = 1000;
    Engine small(stack_.segments(), o);
    EXPECT_THAT(Handoff(small).CheckImport("s", 5000),
                StatusIs(absl::StatusCode::kResourceExhausted));
    EXPECT_THAT(Handoff(small).ImportSession("s", image, export_all()),
                StatusIs(absl::StatusCode::kResourceExhausted));
    EXPECT_EQ(small.totals().sessions, 0);
    EXPECT_EQ(small.totals().working_set_bytes, 0u);
  }
  // None of it touched the receiver, which still takes the session.
  EXPECT_EQ(decode_->totals().sessions, 0);
  EXPECT_EQ(decode_->totals().working_set_bytes, 0u);
  KVT_ASSERT_OK(Handoff(*decode_).ImportSession("s", image, export_all()));
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
  EXPECT_THAT(Handoff(*prefill_).ExportTail("s", &image),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  KVT_ASSERT_OK(prefill_->AbortStep("s"));
}

// ---- Over gRPC: two kvtier-workers on one kvtier-store ----

v1::DenseTensor Dense(const std::vector<float>& x, int64_t tokens, int heads) {
  v1::DenseTensor t;
  t.set_dtype(v1::DTYPE_FP32);
  t.add_shape(tokens);
  t.add_shape(heads);
  t.add_shape(kShape.head_dim);
  t.set_data(reinterpret_cast<const char*>(x.data()), x.size() * 4);
  return t;
}

void AppendFloats(const v1::DenseTensor& t, std::vector<float>* out) {
  const size_t at = out->size();
  out->resize(at + t.data().size() / 4);
  std::memcpy(out->data() + at, t.data().data(), t.data().size());
}

struct PrefillResult {
  grpc::Status status;
  std::vector<float> out;
  std::optional<v1::TransferReport> transfer;
};

// One prefill step over gRPC, handed to `transfer_to` when set.
PrefillResult Prefill(v1::Worker::Stub* stub, const std::string& id, const Step& step,
                      const std::string& transfer_to = "") {
  PrefillResult r;
  grpc::ClientContext c;
  c.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  auto s = stub->Prefill(&c);
  for (int l = 0; l < kShape.layers; ++l) {
    v1::LayerRequest req;
    if (l == 0) {
      req.set_session_id(id);
      req.set_transfer_to(transfer_to);
    }
    req.set_layer(l);
    *req.mutable_q() = Dense(step.q[l], step.n, kShape.q_heads);
    *req.mutable_k() = Dense(step.k[l], step.n, kShape.kv_heads);
    *req.mutable_v() = Dense(step.v[l], step.n, kShape.kv_heads);
    if (!s->Write(req)) break;
    v1::LayerResponse resp;
    bool broke = false;
    do {
      if (!s->Read(&resp)) {
        broke = true;
        break;
      }
      AppendFloats(resp.o(), &r.out);
      if (resp.has_transfer()) r.transfer = resp.transfer();
    } while (resp.more_chunks());
    if (broke) break;
  }
  s->WritesDone();
  r.status = s->Finish();
  return r;
}

std::vector<float> Decode(v1::Worker::Stub* stub, const std::string& id, const Step& step) {
  std::vector<float> out;
  grpc::ClientContext c;
  c.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  auto s = stub->Decode(&c);
  for (int l = 0; l < kShape.layers; ++l) {
    v1::DecodeRequest req;
    v1::DecodeItem* it = req.add_items();
    it->set_session_id(id);
    it->set_layer(l);
    *it->mutable_q() = Dense(step.q[l], 1, kShape.q_heads);
    *it->mutable_k() = Dense(step.k[l], 1, kShape.kv_heads);
    *it->mutable_v() = Dense(step.v[l], 1, kShape.kv_heads);
    v1::DecodeResponse resp;
    EXPECT_TRUE(s->Write(req) && s->Read(&resp));
    if (resp.o_size() == 1) AppendFloats(resp.o(0), &out);
  }
  s->WritesDone();
  EXPECT_TRUE(s->Finish().ok());
  return out;
}

class TransferServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { KVT_ASSERT_OK(stack_.Start()); }

  // A kvtier-worker on 127.0.0.1 over the test's store.
  std::unique_ptr<WorkerServer> StartWorker(
      uint64_t max_working_set_bytes = 0,
      WorkerServiceOptions::Role role = WorkerServiceOptions::Role::kBoth,
      const std::function<void(WorkerServerOptions&)>& tweak = nullptr) {
    WorkerServerOptions o;
    o.listen = "127.0.0.1:0";
    o.metrics_listen = "";
    o.store.target = stack_.store()->target();
    o.store.deadline = absl::Seconds(10);
    o.engine.placement = worker::EngineOptions::Placement::kHost;
    o.engine.max_working_set_bytes = max_working_set_bytes;
    // Small chunks (and output slices), so that layers travel in several.
    o.service.max_response_bytes = 8192;
    o.service.role = role;
    if (tweak) tweak(o);
    auto server = WorkerServer::Start(o);
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? std::move(*server) : nullptr;
  }
  static std::string Target(const WorkerServer& w) { return absl::StrCat("127.0.0.1:", w.port()); }
  static std::unique_ptr<v1::Worker::Stub> Stub(const WorkerServer& w) {
    return v1::Worker::NewStub(grpc::CreateChannel(Target(w), grpc::InsecureChannelCredentials()));
  }
  static grpc::Status Open(v1::Worker::Stub* stub, const std::string& id,
                           v1::Codec codec = v1::CODEC_RAW) {
    v1::OpenSessionRequest r;
    r.set_session_id(id);
    v1::ModelSpec* m = r.mutable_model();
    m->set_num_layers(kShape.layers);
    m->set_num_q_heads(kShape.q_heads);
    m->set_num_kv_heads(kShape.kv_heads);
    m->set_head_dim(kShape.head_dim);
    m->set_dtype(kShape.dtype);
    m->set_rope_theta(10000);
    r.mutable_policy()->set_codec(codec);
    r.mutable_policy()->set_eviction("snapkv");
    r.mutable_policy()->set_budget_tokens(24);
    r.mutable_policy()->set_window(8);
    r.mutable_policy()->set_recall("topk:1");
    r.mutable_policy()->set_keep_recent_round(false);
    grpc::ClientContext c;
    v1::OpenSessionResponse resp;
    return stub->OpenSession(&c, r, &resp);
  }
  static grpc::Status EndRound(v1::Worker::Stub* stub, const std::string& id) {
    grpc::ClientContext c;
    v1::EndRoundRequest r;
    r.set_session_id(id);
    v1::EndRoundResponse resp;
    return stub->EndRound(&c, r, &resp);
  }
  static grpc::Status SendSession(v1::Worker::Stub* stub, const std::string& id,
                                  const std::string& target, v1::SendSessionResponse* resp) {
    grpc::ClientContext c;
    v1::SendSessionRequest r;
    r.set_session_id(id);
    r.set_target(target);
    return stub->SendSession(&c, r, resp);
  }

  // A kvtier-worker process over the test's store, logging into `dir`;
  // `port` is empty when it did not start.
  pid_t SpawnWorker(const std::string& dir, std::string* port) {
    const std::string port_file = dir + "/port";
    const pid_t pid = testing::SpawnLogged(
        {KVTIER_WORKER_BINARY_PATH, "--listen=127.0.0.1:0", "--port_file=" + port_file,
         "--metrics_listen=", "--placement=host", "--store=" + stack_.store()->target()},
        dir + "/worker.log");
    for (int i = 0; pid > 0 && i < 300 && port->empty(); ++i) {
      absl::SleepFor(absl::Milliseconds(20));
      std::ifstream in(port_file);
      std::getline(in, *port);
    }
    return pid;
  }

  testing::StoreStack stack_;
};

// The done-when case: a conversation prefilled on one worker and decoded on
// another, round after round, has every output equal to one worker doing it
// all (lossless: the model's own fp16), and the sessions end in the same
// state. Each prefill streams to the decode worker as it runs; between
// rounds SendSession hands the session back. From the second round on each
// worker still holds the rounds it handed off, and they do not travel again:
// the hand-back carries the ended round alone.
TEST_F(TransferServiceTest, PrefillOnOneWorkerDecodeOnAnotherMatchesOneWorker) {
  auto p = StartWorker(0, WorkerServiceOptions::Role::kPrefill),
       d = StartWorker(0, WorkerServiceOptions::Role::kDecode);
  auto ps = Stub(*p), ds = Stub(*d);
  ASSERT_TRUE(Open(ps.get(), "pd").ok());
  // The roles: no prefill on the decode worker, no decode on the prefill one.
  // ("one", the single-worker baseline, runs on a worker of its own.)
  auto both = StartWorker();
  auto bs = Stub(*both);
  ASSERT_TRUE(Open(bs.get(), "one").ok());
  std::mt19937 rng(11);
  {
    ASSERT_TRUE(Open(ds.get(), "x").ok());
    const Step s = MakeStep(3, &rng);
    PrefillResult refused = Prefill(ds.get(), "x", s);
    EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(refused.status.error_message(), ::testing::HasSubstr("--role=decode"));
    grpc::ClientContext c;
    auto st = ps->Decode(&c);
    v1::DecodeRequest req;
    req.add_items()->set_session_id("pd");
    st->Write(req);
    st->WritesDone();
    grpc::Status g = st->Finish();
    EXPECT_EQ(g.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(g.error_message(), ::testing::HasSubstr("--role=prefill"));
  }
  uint64_t first_back = 0, reused_back = 0, reused_forth = 0;
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE(round);
    const Step prompt = MakeStep(300 + 40 * round, &rng);  // Layers of several chunks.
    PrefillResult moved = Prefill(ps.get(), "pd", prompt, Target(*d));
    ASSERT_TRUE(moved.status.ok()) << moved.status.error_message();
    PrefillResult alone = Prefill(bs.get(), "one", prompt);
    ASSERT_TRUE(alone.status.ok());
    EXPECT_TRUE(Same(moved.out, alone.out));
    ASSERT_TRUE(moved.transfer.has_value());
    const v1::TransferReport& t = *moved.transfer;
    EXPECT_EQ(t.path(), "grpc");
    EXPECT_EQ(t.target(), Target(*d));
    EXPECT_EQ(t.wire_bytes(), t.past_bytes() + t.open_bytes());
    EXPECT_GT(t.chunks(), static_cast<uint32_t>(kShape.layers));
    EXPECT_EQ(t.reused_bytes() > 0, round > 0);
    reused_forth += t.reused_bytes();
    EXPECT_GE(t.transfer_ms(), t.exposed_ms());
    // Where the time went: the receiver's figures came back with its answer
    // (an import takes time; the parts fit inside what holds them).
    EXPECT_GT(t.receiver_import_ms(), 0.0);
    EXPECT_GE(t.receiver_busy_ms(), t.receiver_import_ms());
    EXPECT_GE(t.receiver_span_ms(), t.receiver_busy_ms());
    EXPECT_GE(t.receiver_tail_wait_ms(), 0.0);
    EXPECT_EQ(t.receiver_device_copy_ms(), 0.0);  // Host sessions: no device work.
    EXPECT_GE(t.exposed_ms(), t.drain_ms());
    EXPECT_EQ(p->engine()->Stats("pd").status().code(), absl::StatusCode::kNotFound);
    EXPECT_TRUE(d->engine()->Stats("pd").ok());
    for (int i = 0; i < 4; ++i) {
      const Step tok = MakeStep(1, &rng);
      EXPECT_TRUE(Same(Decode(ds.get(), "pd", tok), Decode(bs.get(), "one", tok))) << "token " << i;
    }
    ASSERT_TRUE(EndRound(ds.get(), "pd").ok());
    ASSERT_TRUE(EndRound(bs.get(), "one").ok());
    auto a = d->engine()->Stats("pd");
    auto b = both->engine()->Stats("one");
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->working_set_bytes, b->working_set_bytes);
    EXPECT_EQ(a->full_cache_bytes, b->full_cache_bytes);
    EXPECT_EQ(a->rounds, b->rounds);
    v1::SendSessionResponse back;
    ASSERT_TRUE(SendSession(ds.get(), "pd", Target(*p), &back).ok());
    EXPECT_EQ(back.report().open_bytes(), 0u);
    EXPECT_GT(back.report().past_bytes(), 0u);
    // Every round keeps 24 tokens (raw codec): the ended round is the same
    // size each time, and it is all that travels back.
    if (round == 0) first_back = back.report().past_bytes();
    EXPECT_EQ(back.report().past_bytes(), first_back);
    EXPECT_EQ(back.report().reused_bytes() > 0, round > 0);
    reused_back += back.report().reused_bytes();
    EXPECT_EQ(d->engine()->Stats("pd").status().code(), absl::StatusCode::kNotFound);
  }
  EXPECT_THAT(p->RenderMetrics(),
              ::testing::HasSubstr(
                  R"(kvtier_worker_transfers_total{direction="sent",outcome="ok",path="grpc"} 4)"));
  EXPECT_THAT(
      d->RenderMetrics(),
      ::testing::HasSubstr(
          R"(kvtier_worker_transfers_total{direction="received",outcome="ok",path="grpc"} 4)"));
  EXPECT_THAT(
      p->RenderMetrics(),
      ::testing::HasSubstr(absl::StrCat(
          R"(kvtier_worker_transfer_reused_bytes_total{direction="sent"} )", reused_forth)));
  EXPECT_THAT(d->RenderMetrics(),
              ::testing::HasSubstr(absl::StrCat(
                  R"(kvtier_worker_transfer_reused_bytes_total{direction="sent"} )", reused_back)));
  EXPECT_THAT(
      d->RenderMetrics(),
      ::testing::HasSubstr(absl::StrCat(
          R"(kvtier_worker_transfer_reused_bytes_total{direction="received"} )", reused_forth)));
  EXPECT_THAT(d->RenderMetrics(), ::testing::HasSubstr("kvtier_worker_handoff_cache_bytes "));
}

// Each way a hand-off fails has its status; the sender's step is undone,
// the receiver keeps nothing, and sending the step again works.
TEST_F(TransferServiceTest, FailedHandOffsUndoTheStep) {
  auto p = StartWorker(), d = StartWorker(), small = StartWorker(/*max_working_set_bytes=*/4096);
  auto ps = Stub(*p), ds = Stub(*d);
  ASSERT_TRUE(Open(ps.get(), "s").ok());
  ASSERT_TRUE(Open(ps.get(), "one").ok());
  std::mt19937 rng(13);
  const Step prompt = MakeStep(60, &rng);
  auto expect_undone = [&](const PrefillResult& r, grpc::StatusCode code) {
    EXPECT_EQ(r.status.error_code(), code) << r.status.error_message();
    EXPECT_THAT(r.status.error_message(), ::testing::HasSubstr("undone"));
    auto st = p->engine()->Stats("s");
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->tokens, 0u);
  };
  // Nobody listens there.
  expect_undone(Prefill(ps.get(), "s", prompt, "127.0.0.1:1"), grpc::StatusCode::UNAVAILABLE);
  // Out of budget at the receiver.
  expect_undone(Prefill(ps.get(), "s", prompt, Target(*small)),
                grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(small->engine()->totals().sessions, 0);
  EXPECT_EQ(small->engine()->totals().working_set_bytes, 0u);
  // The receiver holds a session of that name already.
  ASSERT_TRUE(Open(ds.get(), "s").ok());
  expect_undone(Prefill(ps.get(), "s", prompt, Target(*d)), grpc::StatusCode::ALREADY_EXISTS);
  {
    grpc::ClientContext c;
    v1::CloseSessionRequest r;
    r.set_session_id("s");
    v1::CloseSessionResponse resp;
    ASSERT_TRUE(ds->CloseSession(&c, r, &resp).ok());
  }
  // transfer_to on another layer than 0.
  {
    grpc::ClientContext c;
    auto s = ps->Prefill(&c);
    v1::LayerRequest req;
    req.set_session_id("s");
    req.set_layer(0);
    *req.mutable_q() = Dense(prompt.q[0], prompt.n, kShape.q_heads);
    *req.mutable_k() = Dense(prompt.k[0], prompt.n, kShape.kv_heads);
    *req.mutable_v() = Dense(prompt.v[0], prompt.n, kShape.kv_heads);
    v1::LayerResponse resp;
    ASSERT_TRUE(s->Write(req));
    do {
      ASSERT_TRUE(s->Read(&resp));
    } while (resp.more_chunks());
    req.set_layer(1);
    req.set_transfer_to(Target(*d));
    s->Write(req);
    s->WritesDone();
    EXPECT_EQ(s->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  // Prefill streams that stop half way: the engine cancels its call (the
  // sender's death looks the same to the receiver), or the receiver goes
  // away. Either way the receiver holds nothing and the step is rolled back.
  auto half_step = [&](const std::string& target, const std::function<void()>& midway,
                       bool cancel) {
    grpc::ClientContext c;
    auto s = ps->Prefill(&c);
    for (int l = 0; l < kShape.layers; ++l) {
      if (l == 2) {
        midway();
        if (cancel) {
          c.TryCancel();
          break;
        }
      }
      v1::LayerRequest req;
      if (l == 0) {
        req.set_session_id("s");
        req.set_transfer_to(target);
      }
      req.set_layer(l);
      *req.mutable_q() = Dense(prompt.q[l], prompt.n, kShape.q_heads);
      *req.mutable_k() = Dense(prompt.k[l], prompt.n, kShape.kv_heads);
      *req.mutable_v() = Dense(prompt.v[l], prompt.n, kShape.kv_heads);
      if (!s->Write(req)) break;
      v1::LayerResponse resp;
      bool broke = false;
      do {
        broke = !s->Read(&resp);
      } while (!broke && resp.more_chunks());
      if (broke) break;
    }
    s->WritesDone();
    return s->Finish();
  };
  grpc::Status cancelled = half_step(
      Target(*d), [] {}, /*cancel=*/true);
  EXPECT_EQ(cancelled.error_code(), grpc::StatusCode::CANCELLED);
  for (int i = 0; i < 100 && p->engine()->Stats("s")->tokens != 0; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(p->engine()->Stats("s")->tokens, 0u);
  for (int i = 0; i < 100 && d->engine()->totals().sessions != 0; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(d->engine()->totals().sessions, 0);
  {
    // A real kvtier-worker process, killed (-9) half way through the step.
    testing::TempDir dir;
    std::string port;
    const pid_t pid = SpawnWorker(dir.path(), &port);
    ASSERT_GT(pid, 0);
    ASSERT_FALSE(port.empty()) << "kvtier-worker did not start; see " << dir.path();
    grpc::Status st = half_step(
        "127.0.0.1:" + port,
        [&] {
          kill(pid, SIGKILL);
          waitpid(pid, nullptr, 0);
        },
        /*cancel=*/false);
    EXPECT_TRUE(st.error_code() == grpc::StatusCode::UNAVAILABLE ||
                st.error_code() == grpc::StatusCode::CANCELLED)
        << st.error_code() << " " << st.error_message();
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr("undone"));
    EXPECT_EQ(p->engine()->Stats("s")->tokens, 0u);
  }
  // Sent again after all that: the same outputs as one worker, and the
  // session lives on the receiver.
  PrefillResult ok = Prefill(ps.get(), "s", prompt, Target(*d));
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_TRUE(Same(ok.out, Prefill(ps.get(), "one", prompt).out));
  EXPECT_TRUE(d->engine()->Stats("s").ok());
  // SendSession: unknown session, mid-step.
  v1::SendSessionResponse resp;
  EXPECT_EQ(SendSession(ps.get(), "nope", Target(*d), &resp).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(SendSession(ds.get(), "s", "", &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

// A receiver that accepts connections and never answers (SIGSTOP). Before
// any connection, gRPC gives up on the handshake: UNAVAILABLE (or, under
// load, the deadline comes first). On a
// connection already up, the hand-off runs out of its deadline (the prefill
// worker's store deadline when the Prefill call has none): DEADLINE_EXCEEDED.
// Either way the step is undone.
// A decode worker that serves TLS is reached over TLS by a prefill worker
// that holds the CA (--peer_tls_root_certs), and not at all by one without.
TEST_F(TransferServiceTest, HandOffToAWorkerServingTls) {
  testing::TempDir dir;
  auto certs = testing::MakeSelfSignedCert(dir.path());
  if (absl::IsUnavailable(certs.status())) GTEST_SKIP() << certs.status().message();
  ASSERT_TRUE(certs.ok()) << certs.status();
  const std::string &cert = certs->cert, &key = certs->key, &pem = certs->pem;
  using Role = WorkerServiceOptions::Role;
  auto d = StartWorker(0, Role::kDecode, [&](WorkerServerOptions& o) {
    o.tls_cert = cert;
    o.tls_key = key;
  });
  auto plain = StartWorker(0, Role::kPrefill);
  auto tls = StartWorker(0, Role::kPrefill, [&](WorkerServerOptions& o) {
    o.service.peer_tls_root_certs = pem;
    o.service.peer_tls_server_name = "localhost";
  });
  ASSERT_TRUE(d != nullptr && plain != nullptr && tls != nullptr);
  auto plain_stub = Stub(*plain), tls_stub = Stub(*tls);
  ASSERT_TRUE(Open(plain_stub.get(), "s").ok());
  ASSERT_TRUE(Open(tls_stub.get(), "s").ok());
  std::mt19937 rng(5);
  const Step prompt = MakeStep(30, &rng);
  const PrefillResult refused = Prefill(plain_stub.get(), "s", prompt, Target(*d));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << refused.status.error_message();
  EXPECT_EQ(d->engine()->totals().sessions, 0);
  const PrefillResult sent = Prefill(tls_stub.get(), "s", prompt, Target(*d));
  ASSERT_TRUE(sent.status.ok()) << sent.status.error_message();
  ASSERT_TRUE(sent.transfer.has_value());
  auto st = d->engine()->Stats("s");
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->tokens, 30u);
  // The engine side: a SessionRouter reaches the TLS worker with the CA.
  ControllerClientOptions co;
  co.target = "127.0.0.1:1";  // Not called here.
  KVT_ASSERT_OK_AND_ASSIGN(auto plain_router, SessionRouter::Connect(co));
  EXPECT_FALSE(plain_router->Answers(Target(*d), absl::Seconds(2)));
  KVT_ASSERT_OK_AND_ASSIGN(
      auto tls_router,
      SessionRouter::Connect(co, {.tls_root_certs = pem, .tls_server_name = "localhost"}));
  EXPECT_TRUE(tls_router->Answers(Target(*d), absl::Seconds(5)));
}

// Whether process `pid` is stopped (state T in /proc/PID/stat), waiting up
// to 5 s for a SIGSTOP to take effect.
bool Stopped(pid_t pid) {
  for (int i = 0; i < 500; ++i) {
    std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
    std::string line;
    std::getline(in, line);
    // "PID (COMM) STATE ...": the state follows the last ')'.
    const size_t close = line.rfind(')');
    if (close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'T') {
      return true;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

TEST_F(TransferServiceTest, StalledReceiver) {
  WorkerServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_listen = "";
  o.store.target = stack_.store()->target();
  o.engine.placement = worker::EngineOptions::Placement::kHost;
  o.service.store_deadline = absl::Milliseconds(500);
  auto p = WorkerServer::Start(o);
  ASSERT_TRUE(p.ok()) << p.status();
  auto ps = Stub(**p);
  ASSERT_TRUE(Open(ps.get(), "s").ok());
  ASSERT_TRUE(Open(ps.get(), "warm").ok());
  std::mt19937 rng(19);
  const Step step = MakeStep(20, &rng);
  for (bool connected : {false, true}) {
    SCOPED_TRACE(connected ? "connected" : "not connected");
    testing::TempDir dir;
    std::string port;
    const pid_t pid = SpawnWorker(dir.path(), &port);
    ASSERT_GT(pid, 0);
    ASSERT_FALSE(port.empty()) << "kvtier-worker did not start; see " << dir.path();
    const std::string target = "127.0.0.1:" + port;
    if (connected) {
      ASSERT_TRUE(Prefill(ps.get(), "warm", step, target).status.ok());
    }
    ASSERT_EQ(kill(pid, SIGSTOP), 0) << std::strerror(errno);
    ASSERT_TRUE(Stopped(pid)) << "kvtier-worker " << pid << " did not stop";
    PrefillResult r = Prefill(ps.get(), "s", step, target);
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    if (connected) {
      EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
          << r.status.error_message();
    } else {
      // The handshake's own failure and the deadline race: on a loaded
      // machine the deadline can come first. Both tell the engine to retry.
      EXPECT_THAT(r.status.error_code(), ::testing::AnyOf(grpc::StatusCode::UNAVAILABLE,
                                                          grpc::StatusCode::DEADLINE_EXCEEDED))
          << r.status.error_message();
    }
    EXPECT_THAT(r.status.error_message(), ::testing::HasSubstr("undone"));
    auto st = (*p)->engine()->Stats("s");
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->tokens, 0u);
  }
}

// The receiving side against a hand-made stream: a corrupt layer is
// DATA_LOSS, a stream that stops before its tail keeps nothing, garbage in
// place of the header is INVALID_ARGUMENT.
TEST_F(TransferServiceTest, ReceiverRefusesCorruptAndUnfinishedStreams) {
  auto d = StartWorker();
  auto ds = Stub(*d);
  // The session to send, from an engine of the test's own.
  worker::EngineOptions eo;
  eo.placement = worker::EngineOptions::Placement::kHost;
  Engine src(stack_.segments(), eo);
  SessionPolicy pol;
  pol.codec = *ParseCodecSetting("kivi4");
  ASSERT_THAT(src.OpenSession("c", kShape, pol), IsOk());
  std::mt19937 rng(17);
  RunStep(src, "c", MakeStep(30, &rng), true);
  ASSERT_THAT(src.EndRound("c").status(), IsOk());
  RunStep(src, "c", MakeStep(30, &rng), true);
  KVT_ASSERT_OK_AND_ASSIGN(auto image, Handoff(src).ExportSession("c"));
  KVT_ASSERT_OK(Handoff(src).ExportTail("c", &image));

  // Writes header, layers (the `corrupt` one with the byte at `flip(past,
  // open)` of its data flipped after its crc, a third of the way by default)
  // and, when `tail`, the tail; returns the call's status. With
  // `tensor_checksums`, the layer crc leaves out the past tensors' buffer
  // data, as kvtier's sender does. With `apart`, each layer is a start
  // message, data-only messages (which the receiver takes on gRPC's thread
  // when nothing is queued) and an end message, as kvtier's sender sends
  // them; the `oversize` layer then carries one byte more than it announced.
  using Flip = std::function<size_t(const std::string& past, const std::string& open)>;
  auto send = [&](int corrupt, int layers, bool tail, bool tensor_checksums = false,
                  Flip flip = nullptr, bool apart = false, int oversize = -1) {
    grpc::ClientContext c;
    v1::TransferSessionResponse resp;
    auto w = ds->TransferSession(&c, &resp);
    v1::TransferChunk h;
    *h.mutable_header() = HeaderToProto("c", image);
    h.mutable_header()->set_tensor_checksums(tensor_checksums);
    w->Write(h);
    for (int l = 0; l < layers; ++l) {
      auto li = Handoff(src).ExportLayer("c", l);
      EXPECT_TRUE(li.ok());
      v1::TransferChunk ch;
      ch.set_layer(l);
      v1::TransferLayer* info = ch.mutable_layer_info();
      for (uint32_t r : li->rounds) info->add_rounds(r);
      const std::string past = li->PastBytes();
      info->set_past_bytes(past.size());
      info->set_open_rows(li->open_rows);
      info->set_q_first(li->q_first);
      info->set_q_rows(li->q_rows);
      info->set_open_bytes(li->open.size());
      std::string data = past + li->open;
      if (tensor_checksums) {
        absl::StatusOr<uint32_t> outside = Crc32cOutsidePayloadBufferData(0, past);
        EXPECT_TRUE(outside.ok()) << outside.status();
        ch.set_layer_crc32c(Crc32cExtend(outside.value_or(0), li->open.data(), li->open.size()));
      } else {
        ch.set_layer_crc32c(Crc32c(data));
      }
      if (l == corrupt) data[flip ? flip(past, li->open) : data.size() / 3] ^= 1;
      if (apart) {
        v1::TransferChunk start;
        start.set_layer(l);
        *start.mutable_layer_info() = *info;
        bool ok = w->Write(start);
        if (l == oversize) data += 'x';
        const size_t piece = data.size() / 3 + 1;
        for (size_t at = 0; ok && at < data.size(); at += piece) {
          v1::TransferChunk dc;
          dc.set_data(data.substr(at, piece));
          ok = w->Write(dc);
        }
        v1::TransferChunk end;
        end.set_layer(l);
        end.set_layer_end(true);
        end.set_layer_crc32c(ch.layer_crc32c());
        if (!ok || !w->Write(end)) break;
        continue;
      }
      ch.set_data(data);
      ch.set_layer_end(true);
      if (!w->Write(ch)) break;
    }
    if (tail) {
      v1::TransferChunk t;
      *t.mutable_tail() = TailToProto(image);
      w->Write(t);
    }
    w->WritesDone();
    return w->Finish();
  };
  grpc::Status st = send(/*corrupt=*/1, kShape.layers, true);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DATA_LOSS) << st.error_message();
  EXPECT_THAT(st.error_message(), ::testing::HasSubstr("layer 1"));
  st = send(-1, 2, false);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ABORTED) << st.error_message();
  st = send(-1, 2, true);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_EQ(d->engine()->totals().sessions, 0);
  EXPECT_EQ(d->engine()->totals().working_set_bytes, 0u);
  {
    grpc::ClientContext c;
    v1::TransferSessionResponse resp;
    auto w = ds->TransferSession(&c, &resp);
    v1::TransferChunk ch;
    ch.set_layer(0);
    w->Write(ch);
    w->WritesDone();
    EXPECT_EQ(w->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  // Under tensor_checksums: a flipped byte in a past tensor's buffer data
  // (its own crc32c), in the framing or in the open round (the layer crc).
  const Flip in_buffer = [](const std::string& past, const std::string&) {
    auto split = SplitPayload(past);
    EXPECT_TRUE(split.ok() && split->size() > 1);
    std::string_view data;
    for (const BufferView& b : (*split)[1].buffers) {
      if (b.data.size() > data.size()) data = b.data;
    }
    return static_cast<size_t>(data.data() - past.data()) + data.size() / 2;
  };
  const Flip in_framing = [](const std::string& past, const std::string&) {
    auto split = SplitPayload(past);
    EXPECT_TRUE(split.ok() && !split->empty());
    // The last byte of the first tensor's metadata before its first buffer.
    return static_cast<size_t>((*split)[0].buffers[0].data.data() - past.data()) - 1;
  };
  const Flip in_open = [](const std::string& past, const std::string& open) {
    return past.size() + open.size() / 2;
  };
  for (const Flip& flip : {in_buffer, in_framing, in_open}) {
    st = send(/*corrupt=*/1, kShape.layers, true, /*tensor_checksums=*/true, flip);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::DATA_LOSS) << st.error_message();
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr("layer 1 of the transfer is corrupt"));
  }
  EXPECT_EQ(d->engine()->totals().sessions, 0);
  // The same stream whole is taken, with either checksum, and the session
  // decodes as the source.
  st = send(-1, kShape.layers, true, /*tensor_checksums=*/true);
  ASSERT_TRUE(st.ok()) << st.error_message();
  {
    grpc::ClientContext c;
    v1::CloseSessionRequest req;
    req.set_session_id("c");
    v1::CloseSessionResponse resp;
    ASSERT_TRUE(ds->CloseSession(&c, req, &resp).ok());
  }
  // Data in messages of its own, as kvtier's sender sends it: checked the
  // same way (a flipped byte is DATA_LOSS, a byte over what the layer
  // announced INVALID_ARGUMENT, nothing kept), and taken whole otherwise.
  st = send(/*corrupt=*/1, kShape.layers, true, true, nullptr, /*apart=*/true);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DATA_LOSS) << st.error_message();
  st = send(-1, kShape.layers, true, true, nullptr, /*apart=*/true, /*oversize=*/1);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_THAT(st.error_message(), ::testing::HasSubstr("carries more than"));
  EXPECT_EQ(d->engine()->totals().sessions, 0);
  st = send(-1, kShape.layers, true);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(d->engine()->totals().sessions, 1);
  {
    grpc::ClientContext c;
    v1::CloseSessionRequest req;
    req.set_session_id("c");
    v1::CloseSessionResponse resp;
    ASSERT_TRUE(ds->CloseSession(&c, req, &resp).ok());
  }
  st = send(-1, kShape.layers, true, true, nullptr, /*apart=*/true);
  ASSERT_TRUE(st.ok()) << st.error_message();
  const Step tok = MakeStep(1, &rng);
  EXPECT_TRUE(Same(Decode(ds.get(), "c", tok), RunStep(src, "c", tok, false)));
}

// The CUDA IPC path is taken only when the receiver accepts the sender's
// device: HeldRounds says why not (sessions kept in host memory here, the
// path switched off, no device), and a stream whose layers name device
// rounds is refused unless its header names a device this worker accepts.
// Nothing is kept, and no handle is opened.
TEST_F(TransferServiceTest, DeviceRoundsNeedAnAcceptedSenderDevice) {
  v1::DeviceIdentity peer;
  peer.set_boot_id(worker::BootId());
  peer.set_gpu_uuid(std::string(16, '\xc3'));  // Raw bytes, not UTF-8.
  peer.set_pid(1);
  peer.set_probe_handle(std::string(64, '\x01'));
  peer.set_probe_nonce("0123456789abcdef");
  auto held = [&](WorkerServer* w) {
    grpc::ClientContext c;
    v1::HeldRoundsRequest r;
    r.set_session_id("nobody");
    r.set_incarnation(5);
    *r.mutable_device() = peer;
    r.set_nccl_link(std::string(128, '\x03'));  // An NCCL communicator from before.
    v1::HeldRoundsResponse resp;
    EXPECT_TRUE(Stub(*w)->HeldRounds(&c, r, &resp).ok());
    EXPECT_EQ(resp.device_paths_size(), 0);
    EXPECT_EQ(resp.nccl_link(), "");  // Not reserved by a receiver that refuses the path.
    return resp.device_refusal();
  };
  auto host = StartWorker();
  EXPECT_THAT(held(host.get()), ::testing::HasSubstr("host memory"));
  auto off = StartWorker(0, WorkerServiceOptions::Role::kBoth, [](WorkerServerOptions& o) {
    o.engine.placement = worker::EngineOptions::Placement::kAuto;
    o.engine.device_transfer = false;
  });
  EXPECT_THAT(held(off.get()), ::testing::HasSubstr("--device_transfer=grpc"));
  auto any = StartWorker(0, WorkerServiceOptions::Role::kBoth, [](WorkerServerOptions& o) {
    o.engine.placement = worker::EngineOptions::Placement::kAuto;
  });
  // Without a device: why; with one, this made-up peer is on another GPU.
  EXPECT_THAT(held(any.get()),
              ::testing::AnyOf(::testing::HasSubstr("CUDA"), ::testing::HasSubstr("another GPU")));

  // A stream naming device rounds, with and without a device in its header.
  worker::EngineOptions eo;
  eo.placement = worker::EngineOptions::Placement::kHost;
  Engine src(stack_.segments(), eo);
  SessionPolicy pol;
  pol.codec = *ParseCodecSetting("kivi4");
  ASSERT_THAT(src.OpenSession("g", kShape, pol), IsOk());
  std::mt19937 rng(23);
  RunStep(src, "g", MakeStep(20, &rng), true);
  ASSERT_THAT(src.EndRound("g").status(), IsOk());
  KVT_ASSERT_OK_AND_ASSIGN(auto image, Handoff(src).ExportSession("g"));
  KVT_ASSERT_OK(Handoff(src).ExportTail("g", &image));
  ASSERT_EQ(image.past.size(), 1u);
  auto send = [&](WorkerServer* w, bool with_device) {
    grpc::ClientContext c;
    v1::TransferSessionResponse resp;
    auto s = Stub(*w)->TransferSession(&c, &resp);
    v1::TransferChunk h;
    *h.mutable_header() = HeaderToProto("g", image);
    if (with_device) *h.mutable_header()->mutable_device() = peer;
    s->Write(h);
    v1::TransferChunk ch;
    ch.set_layer(0);
    v1::TransferLayer* info = ch.mutable_layer_info();
    info->add_rounds(image.past[0].round);
    v1::TransferDeviceRound* r = info->add_device_rounds();
    r->set_round(image.past[0].round);
    r->set_staged_bytes(4096);
    r->set_ipc_handle(std::string(64, '\x02'));
    s->Write(ch);
    s->WritesDone();
    return s->Finish();
  };
  for (WorkerServer* w : {host.get(), any.get()}) {
    grpc::Status st = send(w, false);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr("named no sender device"));
    st = send(w, true);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr("cannot take"));
    EXPECT_EQ(w->engine()->totals().sessions, 0);
  }

  // A host session's hand-off says nothing of devices.
  auto from = StartWorker();
  auto fs = Stub(*from);
  ASSERT_TRUE(Open(fs.get(), "h").ok());
  v1::SendSessionResponse sent;
  grpc::Status st = SendSession(fs.get(), "h", Target(*host), &sent);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(sent.report().path(), "grpc");
  EXPECT_EQ(sent.report().device_bytes(), 0u);
  EXPECT_EQ(sent.report().device_refusal(), "");
}

}  // namespace
}  // namespace kvtier
