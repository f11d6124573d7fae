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
#include "encoded/encoded_tensor.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "kernels/crc32c.h"
#include "kernels/half.h"
#include "kernels/recall.h"
#include "kernels/speculation.h"
#include "services/worker/transfer_proto.h"
#include "services/worker/worker_server.h"
#include "testing/store_process.h"
#include "testing/test_util.h"
#include "tests/util/status_matchers.h"
#include "tests/util/transfer_steps.h"
#include "tests/util/worker_stack.h"
#include "worker/engine.h"
#include "worker/transfer.h"

namespace kvtier {
namespace {

using ::kvtier::testing::Handoff;
using ::kvtier::testing::kShape;
using ::kvtier::testing::MakeStep;
using ::kvtier::testing::RunStep;
using ::kvtier::testing::Same;
using ::kvtier::testing::StatusIs;
using ::kvtier::testing::Step;
using worker::Engine;
using worker::SessionPolicy;

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

}  // namespace
}  // namespace kvtier
