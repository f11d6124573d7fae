// The worker engine over an in-memory store (worker/memory_store.h): lossless
// equivalence with full attention, recall selection against the reference,
// one GetSegments per recall, a store that fails mid-recall or under
// EndRound, and 16 sessions at once. No kvtier-store process: the store's
// own behaviour is tested in cachestore/ and tests/store_integration_test.cc.
#include <cmath>
#include <limits>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "encoded/encode.h"
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
using worker::Engine;
using worker::ModelShape;
using worker::SessionPolicy;

using ::kvtier::engine_test::Handoff;
using ::kvtier::engine_test::kShape;
using ::kvtier::engine_test::LocalCache;
using ::kvtier::engine_test::Random;
using ::kvtier::engine_test::ReferenceKernels;
using ::kvtier::engine_test::WorkerEngineTest;

// Gemma 3's shape (head_dim 256, one KV head) with sliding layers below and
// above L_w: each round is five segments; once a round has left every
// window of a sliding segment, that segment leaves the store and the
// working set, and the tier still answers as windowed full attention,
// before and after a resume on another engine (which fetches only what is
// stored, and recall never asks for a dropped segment).
TEST_F(WorkerEngineTest, SlidingSegmentsLeaveTheStoreOnceOutOfEveryWindow) {
  // L_w = 1: [0] [1] | [2] [3, 5) [5].
  shape_ = ModelShape{.layers = 6,
                      .q_heads = 4,
                      .kv_heads = 1,
                      .head_dim = 256,
                      .dtype = DType::kFp16,
                      .window = {8, 0, 0, 8, 8, 0}};
  SessionPolicy p;
  KVT_ASSERT_OK_AND_ASSIGN(p.recall, ParseRecall("all"));
  p.watershed_layer = 1;
  KVT_ASSERT_OK(engine_->OpenSession("w", shape_, p));
  LocalCache local(shape_);
  std::mt19937 rng(5);
  std::vector<int64_t> ends;  // Each round's end position.
  for (int r = 0; r < 6; ++r) {
    EXPECT_LT(Round("w", 3 + r % 2, 2, 2, &rng, &local), 1e-5) << "round " << r;
    KVT_ASSERT_OK(engine_->EndRound("w").status());
    ends.push_back((ends.empty() ? 0 : ends.back()) + 3 + r % 2 + 2);
  }
  // Which rounds left the windows of 8 for a query at the next position.
  auto stored_segments = [&]() {
    std::vector<std::vector<uint32_t>> out;
    auto listed = store_.List("w", {});
    EXPECT_THAT(listed, IsOk());
    if (!listed.ok()) return out;
    for (const worker::SegmentStore::StoredRound& ri : *listed) {
      out.emplace_back();
      for (const auto& si : ri.segments) out.back().push_back(si.segment);
      std::sort(out.back().begin(), out.back().end());
    }
    return out;
  };
  auto expected = [&]() {
    std::vector<std::vector<uint32_t>> out;
    for (int64_t end : ends) {
      const bool left = end <= ends.back() - 8 + 1;
      out.push_back(left ? std::vector<uint32_t>{1, 2, 4} : std::vector<uint32_t>{0, 1, 2, 3, 4});
    }
    return out;
  };
  EXPECT_EQ(stored_segments(), expected());
  EXPECT_EQ(stored_segments().front().size(), 3u);  // Some did leave.
  // A resume on another engine answers as the first would have.
  Engine other(&store_, ReferenceKernels());
  KVT_ASSERT_OK_AND_ASSIGN(uint32_t next, other.ResumeSession("w", shape_, p, {}));
  EXPECT_EQ(next, 6u);
  const uint64_t gets = store_.counts().get_calls;
  for (int r = 6; r < 9; ++r) {
    EXPECT_LT(Round("w", 4, 2, 2, &rng, &local, -1, &other), 1e-5) << "round " << r;
    KVT_ASSERT_OK(other.EndRound("w").status());
    ends.push_back(ends.back() + 6);
    KVT_ASSERT_OK_AND_ASSIGN(auto st, other.Stats("w"));
    EXPECT_TRUE(st.recalls.back().gone.empty()) << "round " << r;
  }
  EXPECT_EQ(store_.counts().get_calls, gets + 3);  // One fetch per recall.
  EXPECT_EQ(stored_segments(), expected());
  // The P/D hand-off in the middle of a round, with recall done: the
  // selected rounds travel without the sliding layers they left, and the
  // receiver decodes as windowed full attention.
  EXPECT_LT(Round("w", 2, 2, 0, &rng, &local, -1, &other), 1e-5);
  Engine fourth(&store_, ReferenceKernels());
  {
    KVT_ASSERT_OK_AND_ASSIGN(worker::SessionImage image, Handoff(other).ExportSession("w"));
    std::vector<worker::LayerImage> layers;
    for (int l = 0; l < shape_.layers; ++l) {
      KVT_ASSERT_OK_AND_ASSIGN(worker::LayerImage li, Handoff(other).ExportLayer("w", l));
      layers.push_back(std::move(li));
    }
    KVT_ASSERT_OK(Handoff(other).ExportTail("w", &image));
    KVT_ASSERT_OK(Handoff(fourth).ImportSession("w", image, std::move(layers)));
    KVT_ASSERT_OK(Handoff(other).ForgetSession("w", /*keep_rounds=*/false));
  }
  const int d = shape_.head_dim;
  for (int step = 0; step < 2; ++step) {
    for (int l = 0; l < shape_.layers; ++l) {
      const auto q = Random(shape_.q_heads * d, &rng), k = Random(shape_.kv_heads * d, &rng),
                 v = Random(shape_.kv_heads * d, &rng);
      std::vector<float> out(q.size()), ref(q.size());
      KVT_ASSERT_OK(fourth.DecodeLayer("w", l, q.data(), k.data(), v.data(), out.data()));
      local.Layer(l, 1, q.data(), k.data(), v.data(), ref.data());
      for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 1e-5) << l;
    }
  }
  KVT_ASSERT_OK(fourth.EndRound("w").status());
  ends.push_back(ends.back() + 4);
  EXPECT_EQ(stored_segments(), expected());
  // A round with a sliding segment missing inside its window is lost data,
  // never a silent hole.
  KVT_ASSERT_OK(store_.DropSegments("w", {{8, 3}}, {}));
  Engine third(&store_, ReferenceKernels());
  EXPECT_THAT(third.ResumeSession("w", shape_, p, {}),
              StatusIs(absl::StatusCode::kDataLoss, ::testing::HasSubstr("inside its window")));
  // Under another watershed layer the segments do not fit.
  p.watershed_layer = 2;
  EXPECT_THAT(third.ResumeSession("w", shape_, p, {}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       ::testing::HasSubstr("does not fit this policy")));
}

// Eviction on a model with sliding layers evicts at its global layers only:
// a sliding layer keeps its window whole (and the round leaves it whole), so
// its outputs stay those of windowed full attention while the global layers'
// rounds shrink to the budget.
TEST_F(WorkerEngineTest, EvictionSparesSlidingLayers) {
  shape_ = ModelShape{.layers = 4,
                      .q_heads = 4,
                      .kv_heads = 1,
                      .head_dim = 32,
                      .dtype = DType::kFp16,
                      .window = {12, 0, 12, 0}};
  SessionPolicy p;
  KVT_ASSERT_OK_AND_ASSIGN(p.recall, ParseRecall("all"));
  p.watershed_layer = 1;
  KVT_ASSERT_OK_AND_ASSIGN(p.eviction, evict::ParsePolicy("snapkv:4:w=2"));
  KVT_ASSERT_OK(engine_->OpenSession("e", shape_, p));
  LocalCache local(shape_);
  std::mt19937 rng(9);
  std::vector<double> worst;
  for (int r = 0; r < 5; ++r) {
    Round("e", 8, 3, 2, &rng, &local, -1, nullptr, &worst);
    KVT_ASSERT_OK(engine_->EndRound("e").status());
  }
  ASSERT_EQ(worst.size(), 4u);
  EXPECT_LT(worst[0], 1e-5);
  EXPECT_LT(worst[2], 1e-5);
  EXPECT_GT(worst[1] + worst[3], 1e-3);  // The global layers did lose tokens.
  // The working set: the global layers' rounds at the budget (4 of 10
  // tokens), the sliding layers' only while inside their windows.
  KVT_ASSERT_OK_AND_ASSIGN(auto st, engine_->Stats("e"));
  EXPECT_LT(st.working_set_bytes, st.full_cache_bytes / 2);
}

// Every eviction method ends a round through the engine, including those
// that read no queries (streaming keeps none for its EndRound).
TEST_F(WorkerEngineTest, EveryEvictionMethodEndsRounds) {
  int n = 0;
  for (const char* method : {"streaming:8", "h2o:8", "snapkv:8:w=2", "pyramidkv:8:w=2",
                             "ada-snapkv:8:w=2", "ada-pyramid:8:w=2"}) {
    SCOPED_TRACE(method);
    const std::string id = absl::StrCat("evict-", n++);
    SessionPolicy p;
    KVT_ASSERT_OK_AND_ASSIGN(p.recall, ParseRecall("all"));
    p.watershed_layer = 1;
    KVT_ASSERT_OK_AND_ASSIGN(p.eviction, evict::ParsePolicy(method));
    KVT_ASSERT_OK(engine_->OpenSession(id, kShape, p));
    LocalCache local(kShape);
    std::mt19937 rng(5);
    for (int r = 0; r < 2; ++r) {
      Round(id, 16, 2, 2, &rng, &local);
      KVT_ASSERT_OK(engine_->EndRound(id).status());
    }
    KVT_ASSERT_OK_AND_ASSIGN(auto st, engine_->Stats(id));
    EXPECT_EQ(st.rounds, 2u);
    EXPECT_LT(st.working_set_bytes, st.full_cache_bytes);
  }
}

TEST_F(WorkerEngineTest, LosslessRecallAllEqualsFullAttention) {
  SessionPolicy p;
  KVT_ASSERT_OK_AND_ASSIGN(p.recall, ParseRecall("all"));
  p.watershed_layer = 1;
  KVT_ASSERT_OK(engine_->OpenSession("s1", kShape, p));
  LocalCache local(kShape);
  std::mt19937 rng(1);
  for (int r = 0; r < 5; ++r) {
    EXPECT_LT(Round("s1", 12 + r, 4, 3, &rng, &local), 1e-5) << "round " << r;
    KVT_ASSERT_OK_AND_ASSIGN(auto end, engine_->EndRound("s1"));
    EXPECT_EQ(end.round, static_cast<uint32_t>(r));
    EXPECT_GT(end.stored_bytes, 0u);
  }
  KVT_ASSERT_OK_AND_ASSIGN(auto st, engine_->Stats("s1"));
  EXPECT_EQ(st.rounds, 5u);
  ASSERT_EQ(st.recalls.size(), 4u);  // Rounds 1..4 recall; round 0 has no past.
  for (const auto& rc : st.recalls) EXPECT_EQ(rc.selected.size(), rc.round);
  // Each recall fetched every past round's upper segment in one call.
  EXPECT_EQ(store_.counts().get_calls, 4u);
  // Between rounds only the lower segments stay: 2 of 4 layers, but raw fp32
  // against the fp16 full cache, so about the same bytes plus metadata.
  EXPECT_GE(st.working_set_bytes, st.full_cache_bytes);
  EXPECT_LT(st.working_set_bytes, st.full_cache_bytes * 1.15)
      << "working set " << st.working_set_bytes << " full " << st.full_cache_bytes;
}

// A round the store dropped under pressure costs a recall nothing more: the
// one GetSegments call brings the other rounds and says which is gone, and
// the gone round is attended up to L_w from then on.
TEST_F(WorkerEngineTest, ADroppedRoundCostsTheRecallNoSecondCall) {
  std::mt19937 rng(4);
  ASSERT_NO_FATAL_FAILURE(StoredRounds(4, &rng));
  KVT_ASSERT_OK(store_.DropRound("s", 1, {}));
  const uint64_t calls = store_.counts().get_calls;
  Round("s", 4, 2, 0, &rng, nullptr);
  EXPECT_EQ(store_.counts().get_calls, calls + 1);
  KVT_ASSERT_OK_AND_ASSIGN(worker::SessionStats st, engine_->Stats("s"));
  ASSERT_FALSE(st.recalls.empty());
  EXPECT_EQ(st.recalls.back().gone, std::vector<uint32_t>{1});
  EXPECT_GT(st.recalls.back().bytes_fetched, 0u);
  KVT_ASSERT_OK(engine_->EndRound("s").status());
}

// A recall's fetch is timed from its start at layer L_w, so the part layer
// L_w + 1 waits for is never more than the whole: held in the store until
// that layer waits, the fetch's time covers the wait.
TEST_F(WorkerEngineTest, TheExposedPartOfAFetchIsWithinIt) {
  std::mt19937 rng(3);
  ASSERT_NO_FATAL_FAILURE(StoredRounds(3, &rng));
  const ModelShape s = kShape;
  const int64_t n = 4;
  auto layer = [&](int l) -> absl::StatusOr<std::optional<worker::RecallReport>> {
    const auto q = Random(n * s.q_heads * s.head_dim, &rng),
               k = Random(n * s.kv_heads * s.head_dim, &rng),
               v = Random(n * s.kv_heads * s.head_dim, &rng);
    std::vector<float> out(q.size());
    return engine_->PrefillLayer("s", l, n, 2, q.data(), k.data(), v.data(), out.data());
  };
  store_.HoldGets();
  KVT_ASSERT_OK(layer(0).status());
  KVT_ASSERT_OK(layer(1).status());  // Starts the fetch.
  store_.AwaitHeldGets(1);
  absl::StatusOr<std::optional<worker::RecallReport>> at_next;
  std::thread next([&] { at_next = layer(2); });  // Waits for the fetch.
  store_.ReleaseGets();
  next.join();
  KVT_ASSERT_OK(at_next.status());
  ASSERT_TRUE(at_next->has_value());
  const worker::RecallReport& r = **at_next;
  EXPECT_GT(r.fetched_segments, 0);
  EXPECT_GT(r.fetch_ms, 0.0);
  EXPECT_LE(r.exposed_ms, r.fetch_ms);
  KVT_ASSERT_OK(layer(3).status());
}

TEST_F(WorkerEngineTest, RecallSelectsTheReferenceRoundsInOneCall) {
  SessionPolicy p;
  KVT_ASSERT_OK_AND_ASSIGN(p.recall, ParseRecall("topk:2"));
  p.keep_recent_round = true;
  p.watershed_layer = 1;
  KVT_ASSERT_OK(engine_->OpenSession("s", kShape, p));
  std::mt19937 rng(2);
  // Rounds 0..5 each lean on their own channel; round 6's question leans on
  // channel 2, so round 2 should win.
  for (int r = 0; r < 6; ++r) {
    Round("s", 10, 4, 0, &rng, nullptr, r);
    KVT_ASSERT_OK(engine_->EndRound("s").status());
  }
  const uint64_t calls = store_.counts().get_calls;
  // Round 6 by hand, keeping layer L_w's inputs for the reference.
  const ModelShape s = kShape;
  const int d = s.head_dim;
  const int64_t n = 8, question = 5;
  std::optional<worker::RecallReport> at_lw, at_next;
  for (int l = 0; l < s.layers; ++l) {
    const auto q = Random(n * s.q_heads * d, &rng, 2), k = Random(n * s.kv_heads * d, &rng),
               v = Random(n * s.kv_heads * d, &rng);
    std::vector<float> out(q.size());
    KVT_ASSERT_OK_AND_ASSIGN(auto rep, engine_->PrefillLayer("s", l, n, question, q.data(),
                                                             k.data(), v.data(), out.data()));
    if (l == 1) {
      ASSERT_TRUE(rep.has_value());
      at_lw = rep;
      // Reference: QAttention over the past rounds' layer-1 keys as stored.
      std::vector<worker::SegmentStore::Segment> refs;
      for (uint32_t r = 0; r < 6; ++r) refs.push_back({r, 0});
      KVT_ASSERT_OK_AND_ASSIGN(auto got, store_.Get("s", refs, {}));
      std::vector<std::vector<float>> keys;
      std::vector<RoundKeys> rk(6);
      keys.reserve(12);
      for (int r = 0; r < 6; ++r) {
        v1::SegmentPayload pl;
        ASSERT_TRUE(pl.ParseFromString(got[r]));
        for (int h = 0; h < s.kv_heads; ++h) {
          // Layer 1, head h, K: tensor index (1 * kv_heads + h) * 2.
          KVT_ASSERT_OK_AND_ASSIGN(auto dec, Decode(pl.tensors((1 * s.kv_heads + h) * 2)));
          keys.push_back(std::move(dec));
          rk[r].keys.push_back(keys.back().data());
          rk[r].lens.push_back(static_cast<int64_t>(keys.back().size()) / d);
        }
      }
      const auto want =
          QAttention(s.q_heads, s.kv_heads, d, q.data(), s.q_heads * d, question, rk, k.data());
      ASSERT_EQ(rep->scores.size(), want.size());
      for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(rep->scores[i], want[i], 1e-9);
      const auto pick = SelectRounds(want, p.recall, true);
      EXPECT_EQ(rep->selected, pick);
      EXPECT_THAT(rep->selected, ::testing::Contains(2u));
      EXPECT_THAT(rep->selected, ::testing::Contains(5u));  // The most recent.
    }
    if (l == 2) at_next = rep;
  }
  ASSERT_TRUE(at_next.has_value());
  EXPECT_EQ(at_next->fetched_segments, static_cast<int>(at_lw->selected.size()));
  EXPECT_GT(at_next->bytes_fetched, 0u);
  // Exactly one GetSegments for the recall, and the test's own reference
  // read above.
  EXPECT_EQ(store_.counts().get_calls, calls + 2);
}

TEST_F(WorkerEngineTest, ResidentRecallsAreCountedInTheStore) {
  Engine& engine = *engine_;
  SessionPolicy p;
  KVT_ASSERT_OK_AND_ASSIGN(p.recall, ParseRecall("topk:1"));
  p.watershed_layer = 1;
  p.release_after_end_round = false;  // Every round stays resident.
  KVT_ASSERT_OK(engine.OpenSession("s", kShape, p));
  std::mt19937 rng(7);
  std::vector<uint64_t> want(7, 0);
  const int d = kShape.head_dim;
  for (int r = 0; r < 7; ++r) {
    // Round r's question leans on round r / 2's channel.
    if (r == 3) store_.FailNext(Op::kRecordRecalls, absl::UnavailableError("refused by the test"));
    for (int l = 0; l < kShape.layers; ++l) {
      const int64_t n = 6;
      const auto q = Random(n * kShape.q_heads * d, &rng, r / 2),
                 k = Random(n * kShape.kv_heads * d, &rng, r),
                 v = Random(n * kShape.kv_heads * d, &rng);
      std::vector<float> out(q.size());
      KVT_ASSERT_OK(
          engine.PrefillLayer("s", l, n, 3, q.data(), k.data(), v.data(), out.data()).status());
    }
    KVT_ASSERT_OK_AND_ASSIGN(auto end, engine.EndRound("s"));
    KVT_ASSERT_OK_AND_ASSIGN(auto st, engine.Stats("s"));
    std::vector<uint32_t> selected;
    if (r > 0) selected = st.recalls.back().selected;
    for (uint32_t x : selected) ++want[x];
    if (r == 3) {
      // The report failed: EndRound still succeeds and keeps the counts.
      EXPECT_TRUE(end.recalls_recorded.empty());
      EXPECT_EQ(st.pending_recall_counts, selected.size());
    } else if (r == 4) {
      // Round 3's counts go with round 4's.
      EXPECT_EQ(end.recalls_recorded.size(), st.recalls[2].selected.size() + selected.size());
      EXPECT_EQ(st.pending_recall_counts, 0u);
    } else {
      EXPECT_EQ(end.recalls_recorded, selected) << "round " << r;
    }
  }
  // Nothing was fetched: every recall was served from the working set, and
  // the store's round counters still count each one.
  EXPECT_EQ(store_.counts().get_calls, 0u);
  // Rounds 1..6 report (round 3's report refused).
  EXPECT_EQ(store_.counts().record_calls, 6u);
  EXPECT_EQ(store_.Rounds("s").size(), 7u);
  uint64_t total = 0;
  for (int r = 0; r < 7; ++r) {
    EXPECT_EQ(store_.Recalls("s", r), want[r]) << "round " << r;
    total += want[r];
  }
  EXPECT_GT(total, 6u);  // topk:1 plus the most recent round, when they differ.
  KVT_ASSERT_OK(engine.CloseSession("s", true));
}

TEST_F(WorkerEngineTest, EndRoundAfterAPartialPutReplacesTheStoredPart) {
  Engine& engine = *engine_;
  const absl::Status refused = absl::UnavailableError("refused by the test");
  // The store's segments of `session`, per stored round.
  auto listed = [&](const std::string& session) {
    std::vector<size_t> out;
    auto list = store_.List(session, {});
    EXPECT_THAT(list, IsOk());
    if (list.ok()) {
      for (const auto& r : *list) out.push_back(r.segments.size());
    }
    return out;
  };
  SessionPolicy p;
  p.watershed_layer = 1;
  KVT_ASSERT_OK(engine.OpenSession("s", kShape, p));
  std::mt19937 rng(8);
  const int d = kShape.head_dim;
  auto step = [&](int64_t n) {
    for (int l = 0; l < kShape.layers; ++l) {
      const auto q = Random(n * kShape.q_heads * d, &rng),
                 k = Random(n * kShape.kv_heads * d, &rng),
                 v = Random(n * kShape.kv_heads * d, &rng);
      std::vector<float> out(q.size());
      if (n > 1) {
        ASSERT_THAT(
            engine.PrefillLayer("s", l, n, 2, q.data(), k.data(), v.data(), out.data()).status(),
            IsOk());
      } else {
        ASSERT_THAT(engine.DecodeLayer("s", l, q.data(), k.data(), v.data(), out.data()), IsOk());
      }
    }
  };
  step(6);
  // The lower segment is stored, the upper one is refused: the round stays
  // open, and the half round is dropped from the store.
  store_.FailNext(Op::kPut, refused, 1, /*segment=*/1);
  EXPECT_THAT(engine.EndRound("s").status(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_EQ(listed("s"), std::vector<size_t>{});
  // Again, and this time the drop fails too: the half round stays.
  store_.FailNext(Op::kPut, refused, 1, /*segment=*/1);
  store_.FailNext(Op::kDropRound, refused);
  EXPECT_THAT(engine.EndRound("s").status(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_EQ(listed("s"), std::vector<size_t>{1});
  // The round grows by one token, then EndRound replaces the stale part.
  step(1);
  KVT_ASSERT_OK_AND_ASSIGN(auto end, engine.EndRound("s"));
  EXPECT_EQ(end.round, 0u);
  EXPECT_EQ(listed("s"), std::vector<size_t>{2});
  KVT_ASSERT_OK_AND_ASSIGN(auto got, store_.Get("s", {{0, 0}}, {}));
  v1::SegmentPayload payload;
  ASSERT_TRUE(payload.ParseFromString(got[0]));
  KVT_ASSERT_OK_AND_ASSIGN(EncodedView view, ParseEncoded(payload.tensors(0)));
  EXPECT_EQ(view.tokens, 7);  // Both steps, not the 6 of the failed attempt.
  // And the session goes on.
  step(5);
  KVT_ASSERT_OK(engine.EndRound("s").status());
  // Both segments go in one call, so the upper one can be stored while the
  // lower one is refused: that half is dropped too, and the round stays open.
  step(3);
  store_.FailNext(Op::kPut, refused, 1, /*segment=*/0);
  EXPECT_THAT(engine.EndRound("s").status(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_EQ(listed("s"), (std::vector<size_t>{2, 2}));  // Nothing of round 2.
  KVT_ASSERT_OK_AND_ASSIGN(auto again, engine.EndRound("s"));
  EXPECT_EQ(again.round, 2u);
  EXPECT_EQ(listed("s"), (std::vector<size_t>{2, 2, 2}));
}

TEST_F(WorkerEngineTest, StoreDeathMidRecallLeavesTheSessionConsistent) {
  SessionPolicy p;
  KVT_ASSERT_OK_AND_ASSIGN(p.recall, ParseRecall("all"));
  p.watershed_layer = 1;
  KVT_ASSERT_OK(engine_->OpenSession("s", kShape, p));
  std::mt19937 rng(3);
  for (int r = 0; r < 2; ++r) {
    Round("s", 6, 3, 1, &rng, nullptr);
    KVT_ASSERT_OK(engine_->EndRound("s").status());
  }
  KVT_ASSERT_OK_AND_ASSIGN(auto before, engine_->Stats("s"));
  store_.FailAll(absl::UnavailableError("kvtier-store is down (the test)"));
  const int d = kShape.head_dim;
  for (int attempt = 0; attempt < 2; ++attempt) {
    absl::Status failed;
    for (int l = 0; l < kShape.layers && failed.ok(); ++l) {
      const auto q = Random(5 * kShape.q_heads * d, &rng),
                 k = Random(5 * kShape.kv_heads * d, &rng),
                 v = Random(5 * kShape.kv_heads * d, &rng);
      std::vector<float> out(q.size());
      failed =
          engine_->PrefillLayer("s", l, 5, 3, q.data(), k.data(), v.data(), out.data()).status();
      if (l < 2) {
        KVT_ASSERT_OK(failed);
      }
    }
    EXPECT_THAT(failed, StatusIs(absl::StatusCode::kUnavailable));
    // Rolled back: the same tokens as before, and layer 0 is next again.
    KVT_ASSERT_OK_AND_ASSIGN(auto after, engine_->Stats("s"));
    EXPECT_EQ(after.tokens, before.tokens);
    EXPECT_EQ(after.working_set_bytes, before.working_set_bytes);
  }
  const std::vector<float> q(kShape.q_heads * d, 0.1f), kv(kShape.kv_heads * d, 0.1f);
  std::vector<float> out(q.size());
  EXPECT_THAT(engine_->DecodeLayer("s", 0, q.data(), kv.data(), kv.data(), out.data()),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(engine_->DecodeLayer("nope", 0, q.data(), kv.data(), kv.data(), out.data()),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(WorkerEngineTest, EndRoundWithTheStoreDownKeepsTheRoundOpen) {
  KVT_ASSERT_OK(engine_->OpenSession("s", kShape, SessionPolicy{}));
  std::mt19937 rng(4);
  Round("s", 6, 3, 0, &rng, nullptr);
  store_.FailAll(absl::UnavailableError("kvtier-store is down (the test)"));
  EXPECT_THAT(engine_->EndRound("s").status(), StatusIs(absl::StatusCode::kUnavailable));
  KVT_ASSERT_OK_AND_ASSIGN(auto st, engine_->Stats("s"));
  EXPECT_EQ(st.rounds, 0u);
  EXPECT_EQ(st.tokens, 6u);
  // Still open: a decode step continues the round.
  Round("s", 1, 0, 1, &rng, nullptr);
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

// The open round keeps K/V in the model's dtype and only the queries its
// eviction reads. After many steps, a rolled-back decode and a rolled-back
// prefill longer than the window, EndRound keeps exactly the rows SnapKV
// selects from the whole round's queries and keys, and stores them exactly.
TEST_F(WorkerEngineTest, OpenRoundKeepsTheModelDtypeAndOnlyTheWindowsQueries) {
  const ModelShape s = kShape;  // fp16
  const int d = s.head_dim;
  SessionPolicy p;
  KVT_ASSERT_OK_AND_ASSIGN(p.codec, ParseCodecSetting("raw"));  // fp16, exact
  KVT_ASSERT_OK_AND_ASSIGN(p.eviction, evict::ParsePolicy("snapkv:24:w=8"));
  KVT_ASSERT_OK(engine_->OpenSession("w", s, p));
  std::mt19937 rng(21);
  // The whole round, token-major per layer, as the test's reference.
  std::vector<std::vector<float>> all_q(s.layers), all_k(s.layers);
  int64_t tokens = 0;
  auto step = [&](int64_t n, bool prefill, int layers_to_run) {
    for (int l = 0; l < layers_to_run; ++l) {
      const auto q = Random(n * s.q_heads * d, &rng, 3), k = Random(n * s.kv_heads * d, &rng, 3),
                 v = Random(n * s.kv_heads * d, &rng);
      std::vector<float> out(q.size());
      if (prefill) {
        ASSERT_THAT(
            engine_->PrefillLayer("w", l, n, 0, q.data(), k.data(), v.data(), out.data()).status(),
            IsOk());
      } else {
        ASSERT_THAT(engine_->DecodeLayer("w", l, q.data(), k.data(), v.data(), out.data()), IsOk());
      }
      if (layers_to_run == s.layers) {
        all_q[l].insert(all_q[l].end(), q.begin(), q.end());
        all_k[l].insert(all_k[l].end(), k.begin(), k.end());
      }
    }
    if (layers_to_run == s.layers) tokens += n;
  };
  step(40, true, s.layers);
  KVT_ASSERT_OK_AND_ASSIGN(auto st, engine_->Stats("w"));
  // K and V at 2 bytes (not 4), and 40 of the round's queries at most (the
  // first step's own, until the next one commits).
  const uint64_t kv = static_cast<uint64_t>(40) * s.layers * s.kv_heads * d * 2 * 2;
  EXPECT_GE(st.open_round_bytes, kv);
  EXPECT_LE(st.open_round_bytes, kv + uint64_t{40} * s.layers * s.q_heads * d * 4);
  for (int i = 0; i < 30; ++i) {
    step(1, false, s.layers);
    if (i == 10) {
      step(1, false, 2);  // A decode step rolled back after two layers.
      KVT_ASSERT_OK(engine_->AbortStep("w"));
    }
  }
  step(20, true, 3);  // A prefill longer than the window, rolled back.
  KVT_ASSERT_OK(engine_->AbortStep("w"));
  for (int i = 0; i < 5; ++i) step(1, false, s.layers);
  KVT_ASSERT_OK_AND_ASSIGN(st, engine_->Stats("w"));
  // Queries: at most 2w + a step per head and layer, not the round's 75.
  const uint64_t kv75 = static_cast<uint64_t>(tokens) * s.layers * s.kv_heads * d * 2 * 2;
  EXPECT_LE(st.open_round_bytes,
            2 * kv75 + static_cast<uint64_t>(2 * 8 + 16) * s.layers * s.q_heads * d * 4);
  KVT_ASSERT_OK(engine_->EndRound("w").status());

  KVT_ASSERT_OK_AND_ASSIGN(auto payloads, store_.Get("w", {{0, 0}, {0, 1}}, {}));
  std::vector<TensorParts> tensors;
  for (const std::string& payload : payloads) {
    KVT_ASSERT_OK_AND_ASSIGN(auto parts, SplitPayload(payload));
    for (auto& t : parts) tensors.push_back(std::move(t));
  }
  ASSERT_EQ(tensors.size(), static_cast<size_t>(s.layers * s.kv_heads * 2));
  for (int l = 0; l < s.layers; ++l) {
    // The reference: SnapKV over the whole round, head-major.
    std::vector<float> qh(all_q[l].size()), kh(all_k[l].size());
    for (int64_t t = 0; t < tokens; ++t) {
      for (int h = 0; h < s.q_heads; ++h)
        std::copy_n(&all_q[l][(t * s.q_heads + h) * d], d, &qh[(h * tokens + t) * d]);
      for (int h = 0; h < s.kv_heads; ++h)
        std::copy_n(&all_k[l][(t * s.kv_heads + h) * d], d, &kh[(h * tokens + t) * d]);
    }
    evict::LayerQK x{s.q_heads, s.kv_heads, d, tokens, qh.data(), kh.data()};
    KVT_ASSERT_OK_AND_ASSIGN(auto keep, evict::SelectTokens(p.eviction, l, s.layers, x));
    for (int h = 0; h < s.kv_heads; ++h) {
      SCOPED_TRACE(::testing::Message() << "layer " << l << " head " << h);
      KVT_ASSERT_OK_AND_ASSIGN(EncodedView view, ParseEncoded(tensors[(l * s.kv_heads + h) * 2]));
      ASSERT_EQ(view.tokens, static_cast<int64_t>(keep[h].size()));
      std::vector<float> got(view.tokens * d);
      DecodeRows(view, 0, 0, view.tokens, got.data());
      for (size_t j = 0; j < keep[h].size(); ++j) {
        for (int c = 0; c < d; ++c) {
          ASSERT_EQ(got[j * d + c], kh[(h * tokens + keep[h][j]) * d + c]) << "row " << j;
        }
      }
    }
  }
}

// Idle ages are read from the engine's clock: a session's age grows with
// the clock and a step starts it again.
TEST(WorkerEngineClockTest, IdleAgesFollowTheInjectedClock) {
  FakeClock clock;
  worker::MemorySegmentStore store;
  worker::EngineOptions o = ReferenceKernels();
  o.clock = &clock;
  Engine engine(&store, o);
  ASSERT_THAT(engine.OpenSession("s", kShape, SessionPolicy{}), IsOk());
  auto idle = [&] {
    const std::vector<Engine::SessionEntry> all = engine.Sessions();
    return all.size() == 1 ? all[0].idle_ms : -1;
  };
  EXPECT_EQ(idle(), 0);
  clock.AdvanceMs(5'000);
  EXPECT_EQ(idle(), 5'000);
  const int d = kShape.head_dim;
  std::mt19937 rng(1);
  const std::vector<float> q = Random(kShape.q_heads * d, &rng),
                           k = Random(kShape.kv_heads * d, &rng);
  std::vector<float> out(q.size());
  ASSERT_THAT(engine.PrefillLayer("s", 0, 1, 0, q.data(), k.data(), k.data(), out.data()).status(),
              IsOk());
  EXPECT_EQ(idle(), 0);
  clock.AdvanceMs(1'500);
  EXPECT_EQ(idle(), 1'500);
}

}  // namespace
}  // namespace kvtier
