// kvtier-worker over gRPC (in process, loopback, port 0) with a real
// kvtier-store process: the RPCs, their status codes and metrics, chunked
// layers, rollback, batched decode, speculation, and malformed input.
#include <chrono>
#include <cmath>
#include <functional>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/half.h"
#include "kernels/speculation.h"
#include "services/controller/controller_server.h"
#include "services/worker/worker_server.h"
#include "testing/test_util.h"
#include "tests/util/grpc_health.h"
#include "tests/util/raw_unary.h"
#include "tests/util/segment_refs.h"
#include "tests/util/status_matchers.h"
#include "tests/util/trap_listener.h"
#include "tests/util/worker_rpc.h"
#include "tests/util/worker_stack.h"

namespace kvtier {
namespace {

using ::kvtier::testing::Dense;
using ::kvtier::testing::EndRound;
using ::kvtier::testing::Floats;
using ::kvtier::testing::IdentitySkew;
using ::kvtier::testing::kDim;
using ::kvtier::testing::kKvHeads;
using ::kvtier::testing::kLayers;
using ::kvtier::testing::kQHeads;
using ::kvtier::testing::PrefillStep;
using ::kvtier::testing::PutSkew;
using ::kvtier::testing::RawUnary;
using ::kvtier::testing::RetryWhile;
using ::kvtier::testing::SendPrefillLayers;
using ::kvtier::testing::StatusIs;
using ::kvtier::testing::WorkerServiceTest;

TEST_F(WorkerServiceTest, RoundsOverGrpcMatchFullAttention) {
  grpc::ClientContext oc;
  v1::OpenSessionResponse open;
  ASSERT_TRUE(stub_->OpenSession(&oc, Open("chat-1"), &open).ok());
  EXPECT_EQ(open.effective_policy().watershed_layer(), 1u);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  auto rnd = [&](size_t n) {
    std::vector<float> x(n);
    for (float& v : x) v = nd(rng);
    return x;
  };
  // The local truth: per layer, all K/V so far, token-major.
  std::vector<std::vector<float>> lk(kLayers), lv(kLayers);
  auto local = [&](int l, int64_t n, const std::vector<float>& q, const std::vector<float>& k,
                   const std::vector<float>& v) {
    lk[l].insert(lk[l].end(), k.begin(), k.end());
    lv[l].insert(lv[l].end(), v.begin(), v.end());
    const int64_t total = static_cast<int64_t>(lk[l].size()) / (kKvHeads * kDim);
    std::vector<float> out(q.size());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = total - n + i + 1;
      const KvBlock b{
          EncodedView::Raw(DType::kFp32, lk[l].data(), kKvHeads, t, kDim, kDim, kKvHeads * kDim),
          EncodedView::Raw(DType::kFp32, lv[l].data(), kKvHeads, t, kDim, kDim, kKvHeads * kDim)};
      EXPECT_TRUE(DecodeAttention({kQHeads, kKvHeads, kDim}, q.data() + i * kQHeads * kDim, {&b, 1},
                                  out.data() + i * kQHeads * kDim, KernelLevel::kReference)
                      .ok());
    }
    return out;
  };
  double worst = 0;
  int recalls = 0;
  for (int round = 0; round < 3; ++round) {
    grpc::ClientContext pc;
    auto prefill = stub_->Prefill(&pc);
    const int64_t n = 6;
    for (int l = 0; l < kLayers; ++l) {
      v1::LayerRequest req;
      if (l == 0) req.set_session_id("chat-1");
      req.set_layer(l);
      req.set_question_tokens(3);
      const auto q = rnd(n * kQHeads * kDim), k = rnd(n * kKvHeads * kDim),
                 v = rnd(n * kKvHeads * kDim);
      *req.mutable_q() = Dense(q, n, kQHeads);
      *req.mutable_k() = Dense(k, n, kKvHeads);
      *req.mutable_v() = Dense(v, n, kKvHeads);
      ASSERT_TRUE(prefill->Write(req));
      v1::LayerResponse resp;
      ASSERT_TRUE(prefill->Read(&resp));
      EXPECT_EQ(resp.layer(), static_cast<uint32_t>(l));
      if (l == 1 && round > 0) {
        EXPECT_EQ(resp.recall().selected_rounds_size(), round);
        ++recalls;
      }
      const auto want = local(l, n, q, k, v);
      const auto got = Floats(resp.o());
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i)
        worst = std::max(worst, double(std::fabs(got[i] - want[i])));
    }
    prefill->WritesDone();
    ASSERT_TRUE(prefill->Finish().ok());
    // Two decode steps, each layer a request.
    grpc::ClientContext dc;
    auto decode = stub_->Decode(&dc);
    for (int step = 0; step < 2; ++step) {
      for (int l = 0; l < kLayers; ++l) {
        v1::DecodeRequest req;
        auto* item = req.add_items();
        item->set_session_id("chat-1");
        item->set_layer(l);
        const auto q = rnd(kQHeads * kDim), k = rnd(kKvHeads * kDim), v = rnd(kKvHeads * kDim);
        *item->mutable_q() = Dense(q, 1, kQHeads);
        *item->mutable_k() = Dense(k, 1, kKvHeads);
        *item->mutable_v() = Dense(v, 1, kKvHeads);
        ASSERT_TRUE(decode->Write(req));
        v1::DecodeResponse resp;
        ASSERT_TRUE(decode->Read(&resp));
        ASSERT_EQ(resp.o_size(), 1);
        const auto want = local(l, 1, q, k, v);
        const auto got = Floats(resp.o(0));
        for (size_t i = 0; i < got.size(); ++i)
          worst = std::max(worst, double(std::fabs(got[i] - want[i])));
      }
    }
    decode->WritesDone();
    ASSERT_TRUE(decode->Finish().ok());
    grpc::ClientContext ec;
    v1::EndRoundRequest er;
    er.set_session_id("chat-1");
    v1::EndRoundResponse end;
    ASSERT_TRUE(stub_->EndRound(&ec, er, &end).ok());
    EXPECT_EQ(end.round(), static_cast<uint32_t>(round));
    EXPECT_GT(end.stored_bytes(), 0u);
    EXPECT_GE(end.round_working_set_bytes(), end.working_set_bytes());
    EXPECT_GT(end.full_cache_bytes(), 0u);
  }
  // The model is fp16, so the raw codec keeps past rounds in fp16 (the
  // model's own precision): the outputs match fp32 attention to fp16 error.
  EXPECT_LT(worst, 2e-3);
  EXPECT_GT(worst, 0.0);
  EXPECT_EQ(recalls, 2);
  EXPECT_THAT(stack_.server()->RenderMetrics(),
              ::testing::HasSubstr("kvtier_worker_recalls_total 2"));
  EXPECT_EQ(testing::GrpcHealthStatus(stack_.channel()), 1);  // SERVING
}

TEST_F(WorkerServiceTest, SpeculationOverGrpc) {
  // 6 heads of 512 x 512 floats: a 6 MiB file, sent in 1 MiB slices.
  const std::string big = IdentitySkew(kLayers, kQHeads, kKvHeads, 512, 100);
  ASSERT_GT(big.size(), size_t{5} << 20);
  auto up = PutSkew(stub_.get(), big, size_t{1} << 20);
  ASSERT_TRUE(up.ok()) << up.status();
  EXPECT_EQ(up->layers(), static_cast<uint32_t>(kLayers));
  EXPECT_EQ(up->model(), "identity");
  EXPECT_THAT(PutSkew(stub_.get(), big, (size_t{1} << 20) + 1).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("at most")));
  EXPECT_THAT(PutSkew(stub_.get(), "not a skew file at all", 100).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("skew file")));
  {
    grpc::ClientContext c;
    v1::OpenSessionResponse r;
    v1::OpenSessionRequest o = Open("spec");
    o.mutable_policy()->set_speculation_skew(up->skew_id());
    grpc::Status st = stub_->OpenSession(&c, o, &r);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr("head_dim 512"));
  }
  auto small = PutSkew(stub_.get(), IdentitySkew(kLayers, kQHeads, kKvHeads, kDim, 2), 1000);
  ASSERT_TRUE(small.ok()) << small.status();
  {
    grpc::ClientContext c;
    v1::OpenSessionResponse r;
    v1::OpenSessionRequest o = Open("spec");
    o.mutable_policy()->set_speculation_skew(small->skew_id());
    o.mutable_policy()->set_speculation_budget(2);
    ASSERT_TRUE(stub_->OpenSession(&c, o, &r).ok());
    EXPECT_EQ(r.effective_policy().speculation_skew(), small->skew_id());
    EXPECT_EQ(r.effective_policy().speculation_alpha(), 4.0f);  // The default, filled in.
  }
  std::mt19937 rng(9);
  std::normal_distribution<float> nd;
  auto rnd = [&](size_t n) {
    std::vector<float> x(n);
    for (float& v : x) v = nd(rng);
    return x;
  };
  for (int round = 0; round < 2; ++round) {
    grpc::ClientContext pc;
    auto prefill = stub_->Prefill(&pc);
    for (int l = 0; l < kLayers; ++l) {
      v1::LayerRequest req;
      if (l == 0) req.set_session_id("spec");
      req.set_layer(l);
      *req.mutable_q() = Dense(rnd(8 * kQHeads * kDim), 8, kQHeads);
      *req.mutable_k() = Dense(rnd(8 * kKvHeads * kDim), 8, kKvHeads);
      *req.mutable_v() = Dense(rnd(8 * kKvHeads * kDim), 8, kKvHeads);
      ASSERT_TRUE(prefill->Write(req));
      v1::LayerResponse resp;
      ASSERT_TRUE(prefill->Read(&resp));
    }
    prefill->WritesDone();
    ASSERT_TRUE(prefill->Finish().ok());
    grpc::ClientContext dc;
    auto decode = stub_->Decode(&dc);
    for (int step = 0; step < 3; ++step) {
      for (int l = 0; l < kLayers; ++l) {
        v1::DecodeRequest req;
        auto* item = req.add_items();
        item->set_session_id("spec");
        item->set_layer(l);
        *item->mutable_q() = Dense(rnd(kQHeads * kDim), 1, kQHeads);
        *item->mutable_k() = Dense(rnd(kKvHeads * kDim), 1, kKvHeads);
        *item->mutable_v() = Dense(rnd(kKvHeads * kDim), 1, kKvHeads);
        *item->mutable_q_next() = Dense(rnd(kQHeads * kDim), 1, kQHeads);
        ASSERT_TRUE(decode->Write(req));
        v1::DecodeResponse resp;
        ASSERT_TRUE(decode->Read(&resp));
      }
    }
    decode->WritesDone();
    ASSERT_TRUE(decode->Finish().ok());
    grpc::ClientContext ec;
    v1::EndRoundRequest er;
    er.set_session_id("spec");
    v1::EndRoundResponse end;
    ASSERT_TRUE(stub_->EndRound(&ec, er, &end).ok());
    if (round == 0) {
      EXPECT_EQ(end.speculation_size(), 0);  // Nothing in the past to speculate over.
      continue;
    }
    ASSERT_EQ(end.speculation_size(), kLayers);
    EXPECT_EQ(end.speculation(0).steps(), 0u);
    for (int l = 1; l < kLayers; ++l) {
      EXPECT_EQ(end.speculation(l).steps(), 3u);
      EXPECT_EQ(end.speculation(l).kept(), 3u * 2u);  // The budget.
      EXPECT_EQ(end.speculation(l).sampled(), 1u);
    }
  }
  EXPECT_THAT(stack_.server()->RenderMetrics(),
              ::testing::HasSubstr("kvtier_worker_speculation_steps_total{layer=\"1\"} 3"));
  // A q_next of the wrong shape.
  grpc::ClientContext pc;
  auto prefill = stub_->Prefill(&pc);
  for (int l = 0; l < kLayers; ++l) {
    v1::LayerRequest req;
    if (l == 0) req.set_session_id("spec");
    req.set_layer(l);
    *req.mutable_q() = Dense(rnd(kQHeads * kDim), 1, kQHeads);
    *req.mutable_k() = Dense(rnd(kKvHeads * kDim), 1, kKvHeads);
    *req.mutable_v() = Dense(rnd(kKvHeads * kDim), 1, kKvHeads);
    ASSERT_TRUE(prefill->Write(req));
    v1::LayerResponse resp;
    ASSERT_TRUE(prefill->Read(&resp));
  }
  prefill->WritesDone();
  ASSERT_TRUE(prefill->Finish().ok());
  grpc::ClientContext dc;
  auto decode = stub_->Decode(&dc);
  v1::DecodeRequest req;
  auto* item = req.add_items();
  item->set_session_id("spec");
  item->set_layer(0);
  *item->mutable_q() = Dense(rnd(kQHeads * kDim), 1, kQHeads);
  *item->mutable_k() = Dense(rnd(kKvHeads * kDim), 1, kKvHeads);
  *item->mutable_v() = Dense(rnd(kKvHeads * kDim), 1, kKvHeads);
  *item->mutable_q_next() = Dense(rnd(kKvHeads * kDim), 1, kKvHeads);
  ASSERT_TRUE(decode->Write(req));
  v1::DecodeResponse resp;
  EXPECT_FALSE(decode->Read(&resp));
  grpc::Status st = decode->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), ::testing::HasSubstr("q_next"));
}

TEST_F(WorkerServiceTest, BadInputGetsPreciseStatus) {
  {
    grpc::ClientContext c;
    v1::OpenSessionResponse r;
    v1::OpenSessionRequest bad = Open("s");
    bad.mutable_model()->set_num_kv_heads(3);
    EXPECT_EQ(stub_->OpenSession(&c, bad, &r).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext c;
    v1::OpenSessionResponse r;
    v1::OpenSessionRequest bad = Open("s");
    bad.mutable_policy()->set_recall("best:2");
    EXPECT_EQ(stub_->OpenSession(&c, bad, &r).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext c;
    v1::OpenSessionResponse r;
    ASSERT_TRUE(stub_->OpenSession(&c, Open("s"), &r).ok());
  }
  {
    grpc::ClientContext c;
    v1::OpenSessionResponse r;
    EXPECT_EQ(stub_->OpenSession(&c, Open("s"), &r).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  }
  auto prefill_status = [&](const std::string& id, int layer, int q_heads) {
    grpc::ClientContext c;
    auto s = stub_->Prefill(&c);
    v1::LayerRequest req;
    req.set_session_id(id);
    req.set_layer(layer);
    const std::vector<float> q(2 * q_heads * kDim, 0.1f), kv(2 * kKvHeads * kDim, 0.1f);
    *req.mutable_q() = Dense(q, 2, q_heads);
    *req.mutable_k() = Dense(kv, 2, kKvHeads);
    *req.mutable_v() = Dense(kv, 2, kKvHeads);
    s->Write(req);
    s->WritesDone();
    v1::LayerResponse resp;
    while (s->Read(&resp)) {
    }
    return s->Finish();
  };
  EXPECT_EQ(prefill_status("s", 0, 3).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(prefill_status("s", 1, kQHeads).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(prefill_status("nope", 0, kQHeads).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(prefill_status("bad id!", 0, kQHeads).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  {
    grpc::ClientContext c;
    v1::EndRoundRequest er;
    er.set_session_id("nope");
    v1::EndRoundResponse r;
    EXPECT_EQ(stub_->EndRound(&c, er, &r).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext c;
    v1::CloseSessionRequest cr;
    cr.set_session_id("s");
    cr.set_delete_from_store(true);
    v1::CloseSessionResponse r;
    EXPECT_TRUE(stub_->CloseSession(&c, cr, &r).ok());
  }
}

// A Policy left at its defaults is the documented default policy: upper
// segments leave the working set at EndRound, the recent round is kept; and
// an explicit false means false.
TEST_F(WorkerServiceTest, DefaultPolicyIsTheDocumentedDefault) {
  v1::OpenSessionRequest open = Open("d");
  open.clear_policy();
  grpc::ClientContext oc;
  v1::OpenSessionResponse resp;
  ASSERT_TRUE(stub_->OpenSession(&oc, open, &resp).ok());
  EXPECT_TRUE(resp.effective_policy().has_release_after_end_round());
  EXPECT_TRUE(resp.effective_policy().release_after_end_round());
  EXPECT_TRUE(resp.effective_policy().keep_recent_round());
  std::mt19937 rng(3);
  v1::EndRoundResponse end;
  for (int round = 0; round < 5; ++round) {
    ASSERT_TRUE(PrefillStep(stub_.get(), "d", 8, &rng).ok());
    ASSERT_TRUE(EndRound(stub_.get(), "d", &end).ok());
  }
  const uint64_t released = end.working_set_bytes();

  v1::OpenSessionRequest keep = Open("k");
  keep.mutable_policy()->set_release_after_end_round(false);
  keep.mutable_policy()->set_keep_recent_round(false);
  grpc::ClientContext kc;
  ASSERT_TRUE(stub_->OpenSession(&kc, keep, &resp).ok());
  EXPECT_FALSE(resp.effective_policy().release_after_end_round());
  EXPECT_FALSE(resp.effective_policy().keep_recent_round());
  for (int round = 0; round < 5; ++round) {
    ASSERT_TRUE(PrefillStep(stub_.get(), "k", 8, &rng).ok());
    ASSERT_TRUE(EndRound(stub_.get(), "k", &end).ok());
  }
  // Everything resident: the working set is (at least) the full cache. With
  // the default, 3 layers and L_w = 1, layer 2 of every round left it: 2/3.
  EXPECT_GE(end.working_set_bytes(), end.full_cache_bytes());
  const double ratio = static_cast<double>(released) / static_cast<double>(end.working_set_bytes());
  EXPECT_NEAR(ratio, 2.0 / 3.0, 0.02) << released << " of " << end.working_set_bytes();
}

// A layer larger than gRPC's 4 MiB message limit travels in chunks and
// comes back in slices; as one message it is refused.
TEST_F(WorkerServiceTest, LargeLayersTravelInChunks) {
  v1::OpenSessionRequest open = Open("big");
  open.mutable_model()->set_num_q_heads(64);
  open.mutable_model()->set_num_kv_heads(8);
  open.mutable_model()->set_head_dim(64);
  grpc::ClientContext oc;
  v1::OpenSessionResponse or_;
  ASSERT_TRUE(stub_->OpenSession(&oc, open, &or_).ok());
  constexpr int kQ = 64, kKv = 8, kD = 64;
  constexpr int64_t kTokens = 320;  // q: 320 * 64 * 64 * 4 = 5 MiB per layer.
  std::mt19937 rng(9);
  std::normal_distribution<float> nd;
  // fp16 values (the model's dtype) on an fp32 wire: the worker holds them
  // exactly.
  auto rnd = [&](size_t len) {
    std::vector<float> x(len);
    for (float& v : x) v = HalfToFloat(FloatToHalf(nd(rng)));
    return x;
  };
  auto dense = [](const std::vector<float>& x, int64_t t0, int64_t n, int heads) {
    v1::DenseTensor t;
    t.set_dtype(v1::DTYPE_FP32);
    t.add_shape(n);
    t.add_shape(heads);
    t.add_shape(kD);
    t.set_data(reinterpret_cast<const char*>(x.data() + t0 * heads * kD), n * heads * kD * 4);
    return t;
  };
  {  // One message: over the limit.
    grpc::ClientContext c;
    auto s = stub_->Prefill(&c);
    v1::LayerRequest req;
    req.set_session_id("big");
    const auto q = rnd(kTokens * kQ * kD), kv = rnd(kTokens * kKv * kD);
    *req.mutable_q() = dense(q, 0, kTokens, kQ);
    *req.mutable_k() = dense(kv, 0, kTokens, kKv);
    *req.mutable_v() = dense(kv, 0, kTokens, kKv);
    s->Write(req);
    s->WritesDone();
    v1::LayerResponse resp;
    while (s->Read(&resp)) {
    }
    EXPECT_EQ(s->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  grpc::ClientContext c;
  auto s = stub_->Prefill(&c);
  size_t max_msg = 0;
  for (int l = 0; l < kLayers; ++l) {
    const auto q = rnd(kTokens * kQ * kD), k = rnd(kTokens * kKv * kD), v = rnd(kTokens * kKv * kD);
    constexpr int64_t kPer = 40;  // 40 tokens: 0.8 MiB per message.
    for (int64_t t = 0; t < kTokens; t += kPer) {
      v1::LayerRequest req;
      if (l == 0 && t == 0) req.set_session_id("big");
      req.set_layer(l);
      *req.mutable_q() = dense(q, t, kPer, kQ);
      *req.mutable_k() = dense(k, t, kPer, kKv);
      *req.mutable_v() = dense(v, t, kPer, kKv);
      req.set_more_chunks(t + kPer < kTokens);
      ASSERT_TRUE(s->Write(req));
    }
    // Layer 0 of a fresh round attends only to itself: check it against the
    // reference, slice by slice.
    std::vector<float> got;
    v1::LayerResponse resp;
    int slices = 0;
    do {
      ASSERT_TRUE(s->Read(&resp));
      EXPECT_EQ(resp.layer(), static_cast<uint32_t>(l));
      max_msg = std::max(max_msg, resp.ByteSizeLong());
      const auto part = Floats(resp.o());
      got.insert(got.end(), part.begin(), part.end());
      ++slices;
    } while (resp.more_chunks());
    ASSERT_EQ(got.size(), q.size());
    EXPECT_GE(slices, 5);
    if (l == 0) {
      double worst = 0;
      for (int64_t i = 0; i < kTokens; i += 63) {
        const KvBlock b{EncodedView::Raw(DType::kFp32, k.data(), kKv, i + 1, kD, kD, kKv * kD),
                        EncodedView::Raw(DType::kFp32, v.data(), kKv, i + 1, kD, kD, kKv * kD)};
        std::vector<float> want(kQ * kD);
        ASSERT_TRUE(DecodeAttention({kQ, kKv, kD}, q.data() + i * kQ * kD, {&b, 1}, want.data(),
                                    KernelLevel::kReference)
                        .ok());
        for (int j = 0; j < kQ * kD; ++j) {
          worst = std::max(worst, double(std::fabs(got[i * kQ * kD + j] - want[j])));
        }
      }
      EXPECT_LT(worst, 1e-4);
    }
  }
  s->WritesDone();
  ASSERT_TRUE(s->Finish().ok());
  EXPECT_LE(max_msg, (size_t{1} << 20) + 1024);
}

// A Prefill cancelled in the middle of its layers rolls the step back: the
// next Prefill starts again at layer 0, and the round ends normally.
TEST_F(WorkerServiceTest, CancelledPrefillRollsBack) {
  grpc::ClientContext oc;
  v1::OpenSessionResponse or_;
  ASSERT_TRUE(stub_->OpenSession(&oc, Open("c"), &or_).ok());
  std::mt19937 rng(4);
  {
    grpc::ClientContext c;
    auto s = stub_->Prefill(&c);
    ASSERT_TRUE(SendPrefillLayers(s.get(), "c", 2));
    c.TryCancel();
    EXPECT_EQ(s->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  // The worker notices the cancellation on its own thread; until it has
  // rolled the step back, a new stream's layer 0 is UNAVAILABLE (retry),
  // never FAILED_PRECONDITION.
  const grpc::Status st = RetryWhile(grpc::StatusCode::UNAVAILABLE,
                                     [&] { return PrefillStep(stub_.get(), "c", 4, &rng); });
  ASSERT_TRUE(st.ok()) << st.error_message();
  v1::EndRoundResponse end;
  ASSERT_TRUE(EndRound(stub_.get(), "c", &end).ok());
  EXPECT_EQ(end.full_cache_bytes(), 4u * kLayers * kKvHeads * kDim * 2 * 2);
}

// One DecodeRequest carries several sessions' items; each gets the output
// it gets alone, in the dtype it sent (fp16 here).
TEST_F(WorkerServiceTest, DecodeBatchesSessionsInOneRequest) {
  constexpr int kSessions = 4;
  std::mt19937 rng(8);
  for (int i = 0; i < kSessions; ++i) {
    const std::string id = "b" + std::to_string(i);
    grpc::ClientContext oc;
    v1::OpenSessionResponse or_;
    ASSERT_TRUE(stub_->OpenSession(&oc, Open(id), &or_).ok());
    ASSERT_TRUE(PrefillStep(stub_.get(), id, 5, &rng).ok());
    // A twin session with the same prefill, decoded alone below.
  }
  std::normal_distribution<float> nd;
  auto half = [&](int heads) {
    v1::DenseTensor t;
    t.set_dtype(v1::DTYPE_FP16);
    t.add_shape(1);
    t.add_shape(heads);
    t.add_shape(kDim);
    std::string data(heads * kDim * 2, '\0');
    for (int j = 0; j < heads * kDim; ++j) {
      const uint16_t h = FloatToHalf(nd(rng));
      std::memcpy(&data[2 * j], &h, 2);
    }
    t.set_data(data);
    return t;
  };
  grpc::ClientContext dc;
  auto stream = stub_->Decode(&dc);
  for (int step = 0; step < 2; ++step) {
    for (int l = 0; l < kLayers; ++l) {
      v1::DecodeRequest req;
      for (int i = 0; i < kSessions; ++i) {
        auto* item = req.add_items();
        item->set_session_id("b" + std::to_string(i));
        item->set_layer(l);
        *item->mutable_q() = half(kQHeads);
        *item->mutable_k() = half(kKvHeads);
        *item->mutable_v() = half(kKvHeads);
      }
      ASSERT_TRUE(stream->Write(req));
      v1::DecodeResponse resp;
      ASSERT_TRUE(stream->Read(&resp));
      ASSERT_EQ(resp.o_size(), kSessions);
      for (const auto& o : resp.o()) {
        EXPECT_EQ(o.dtype(), v1::DTYPE_FP16);
        EXPECT_EQ(o.data().size(), static_cast<size_t>(kQHeads * kDim * 2));
      }
    }
  }
  stream->WritesDone();
  ASSERT_TRUE(stream->Finish().ok());
  for (int i = 0; i < kSessions; ++i) {
    auto st = stack_.server()->engine()->Stats("b" + std::to_string(i));
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(st->tokens, 7u);
  }
}

// Every way a stream can end mid-step rolls the step back: a Prefill
// half-closed after layer 1 (FAILED_PRECONDITION for it), a Decode cancelled
// after layer 1, a Decode whose deadline runs out mid-step. Each time the
// session carries on from where it was before the step.
TEST_F(WorkerServiceTest, StreamsEndingMidStepRollBack) {
  grpc::ClientContext oc;
  v1::OpenSessionResponse or_;
  ASSERT_TRUE(stub_->OpenSession(&oc, Open("m"), &or_).ok());
  std::mt19937 rng(12);
  ASSERT_TRUE(PrefillStep(stub_.get(), "m", 4, &rng).ok());
  const std::vector<float> q(kQHeads * kDim, 0.1f), kv(kKvHeads * kDim, 0.2f);
  auto layer_req = [&](int l) {
    v1::DecodeRequest req;
    auto* item = req.add_items();
    item->set_session_id("m");
    item->set_layer(l);
    *item->mutable_q() = Dense(q, 1, kQHeads);
    *item->mutable_k() = Dense(kv, 1, kKvHeads);
    *item->mutable_v() = Dense(kv, 1, kKvHeads);
    return req;
  };
  {  // Prefill half-closed after two of three layers.
    grpc::ClientContext c;
    auto s = stub_->Prefill(&c);
    ASSERT_TRUE(SendPrefillLayers(s.get(), "m", 2));
    s->WritesDone();
    EXPECT_EQ(s->Finish().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  }
  {  // Decode cancelled after layer 1.
    grpc::ClientContext c;
    auto s = stub_->Decode(&c);
    for (int l = 0; l < 2; ++l) {
      ASSERT_TRUE(s->Write(layer_req(l)));
      v1::DecodeResponse resp;
      ASSERT_TRUE(s->Read(&resp));
    }
    c.TryCancel();
    EXPECT_EQ(s->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  {  // Decode whose deadline runs out after layer 0. The cancelled stream
     // above is rolled back on the worker's own thread: until then layer 0
     // is UNAVAILABLE with a retry hint, so that is retried.
    grpc::Status end = RetryWhile(grpc::StatusCode::UNAVAILABLE, [&] {
      grpc::ClientContext c;
      c.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(300)));
      auto s = stub_->Decode(&c);
      v1::DecodeResponse resp;
      if (s->Write(layer_req(0)) && s->Read(&resp)) {
        EXPECT_FALSE(s->Read(&resp));  // Nothing more comes; the deadline ends it.
      }
      return s->Finish();
    });
    EXPECT_EQ(end.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  // Each step was rolled back: a whole decode step goes through from layer 0.
  const grpc::Status st = RetryWhile(grpc::StatusCode::UNAVAILABLE, [&] {
    grpc::ClientContext c;
    auto s = stub_->Decode(&c);
    for (int l = 0; l < kLayers; ++l) {
      v1::DecodeResponse resp;
      if (!s->Write(layer_req(l)) || !s->Read(&resp)) break;
    }
    s->WritesDone();
    return s->Finish();
  });
  ASSERT_TRUE(st.ok()) << st.error_message();
  v1::EndRoundResponse end;
  ASSERT_TRUE(EndRound(stub_.get(), "m", &end).ok());
  // 4 prefill tokens and the one decode token, nothing of the abandoned steps.
  EXPECT_EQ(end.full_cache_bytes(), 5u * kLayers * kKvHeads * kDim * 2 * 2);
}

// Sends `bytes` as one message on a bidi stream `method`, half-closes, reads
// whatever comes, and returns the final status.
grpc::Status RawStream(const std::shared_ptr<grpc::Channel>& ch, const std::string& method,
                       const std::string& bytes, int* responses) {
  grpc::GenericStub generic(ch);
  grpc::CompletionQueue cq;
  grpc::ClientContext c;
  c.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  auto call = generic.PrepareCall(&c, method, &cq);
  auto step = [&](intptr_t tag) {
    void* got = nullptr;
    bool ok = false;
    EXPECT_TRUE(cq.Next(&got, &ok));
    EXPECT_EQ(reinterpret_cast<intptr_t>(got), tag);
    return ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  step(1);
  grpc::Slice slice(bytes);
  grpc::ByteBuffer out(&slice, 1);
  call->Write(out, reinterpret_cast<void*>(2));
  step(2);
  call->WritesDone(reinterpret_cast<void*>(3));
  step(3);
  *responses = 0;
  for (;;) {
    grpc::ByteBuffer in;
    call->Read(&in, reinterpret_cast<void*>(4));
    if (!step(4)) break;
    ++*responses;
  }
  grpc::Status fin;
  call->Finish(&fin, reinterpret_cast<void*>(5));
  step(5);
  cq.Shutdown();
  void* tag;
  bool ok;
  while (cq.Next(&tag, &ok)) {
  }
  return fin;
}

// Issue 14 #7: garbage frames, wrapping shapes and out-of-range policy
// fields used to end with OK and no response (streams), INTERNAL with no
// details (unary calls), UNKNOWN, or be accepted. Each is now
// INVALID_ARGUMENT with a reason, and the session is unharmed.
TEST_F(WorkerServiceTest, MalformedInputIsInvalidArgument) {
  const std::string garbage("\xff\xff\xff\xff\x0f\x01\x02", 7);
  for (const char* m : {"/kvtier.v1.Worker/OpenSession", "/kvtier.v1.Worker/EndRound",
                        "/kvtier.v1.Worker/CloseSession"}) {
    const grpc::Status st = RawUnary(stack_.channel(), m, garbage);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << m;
    EXPECT_FALSE(st.error_message().empty()) << m;
  }
  for (const char* m : {"/kvtier.v1.Worker/Prefill", "/kvtier.v1.Worker/Decode"}) {
    int responses = -1;
    const grpc::Status st = RawStream(stack_.channel(), m, garbage, &responses);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << m << ": " << st.error_message();
    EXPECT_EQ(responses, 0);
  }
  auto open_status = [&](const v1::OpenSessionRequest& r) {
    grpc::ClientContext c;
    v1::OpenSessionResponse resp;
    return stub_->OpenSession(&c, r, &resp);
  };
  v1::OpenSessionRequest bogus = Open("p");
  bogus.mutable_policy()->set_eviction("bogus");
  bogus.mutable_policy()->set_budget_tokens(64);
  EXPECT_EQ(open_status(bogus).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::OpenSessionRequest far = Open("p");
  far.mutable_policy()->set_watershed_layer(0xffffffffu);
  const grpc::Status fs = open_status(far);
  EXPECT_EQ(fs.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << fs.error_message();
  far.mutable_policy()->set_watershed_layer(kLayers);  // Past the model's last layer.
  EXPECT_EQ(open_status(far).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // A q shape whose element count wraps 64 bits: [2^60 + 1, 2, 4] times 4 bytes.
  ASSERT_TRUE(open_status(Open("p")).ok());
  {
    grpc::ClientContext c;
    auto s = stub_->Prefill(&c);
    v1::LayerRequest req;
    req.set_session_id("p");
    req.set_layer(0);
    const std::vector<float> kv(2 * kKvHeads * kDim, 0.1f);
    v1::DenseTensor* q = req.mutable_q();
    q->set_dtype(v1::DTYPE_FP32);
    q->add_shape((int64_t{1} << 60) + 1);
    q->add_shape(kQHeads);
    q->add_shape(kDim);
    q->set_data(std::string(kQHeads * kDim * 4, '\0'));
    *req.mutable_k() = Dense(kv, 2, kKvHeads);
    *req.mutable_v() = Dense(kv, 2, kKvHeads);
    s->Write(req);
    s->WritesDone();
    v1::LayerResponse resp;
    while (s->Read(&resp)) {
    }
    const grpc::Status st = s->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  }
  // Nothing above harmed the session: a whole step and a round go through.
  std::mt19937 rng(3);
  ASSERT_TRUE(PrefillStep(stub_.get(), "p", 3, &rng).ok());
  v1::EndRoundResponse end;
  ASSERT_TRUE(EndRound(stub_.get(), "p", &end).ok());
}

// Rounds the store dropped (under pressure) while the worker still holds
// their lower segments: a recall that selects them gets the others, and
// they are attended up to L_w only, from then on.
TEST_F(WorkerServiceTest, RoundsTheStoreDroppedAreAttendedUpToTheWatershed) {
  grpc::ClientContext oc;
  v1::OpenSessionResponse resp;
  ASSERT_TRUE(stub_->OpenSession(&oc, Open("g"), &resp).ok());  // recall "all"
  std::mt19937 rng(5);
  v1::EndRoundResponse end;
  for (int round = 0; round < 3; ++round) {
    ASSERT_TRUE(PrefillStep(stub_.get(), "g", 4, &rng).ok());
    ASSERT_TRUE(EndRound(stub_.get(), "g", &end).ok());
  }
  StoreClientOptions so;
  so.target = stack_.store()->target();
  auto store = std::move(StoreClient::Connect(so)).value();
  ASSERT_TRUE(store->DropRounds("g", {0}).ok());

  const grpc::Status st = PrefillStep(stub_.get(), "g", 4, &rng);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_TRUE(EndRound(stub_.get(), "g", &end).ok());
  worker::Engine* engine = stack_.server()->engine();
  auto stats = engine->Stats(worker::SessionKey("", "g"));
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_THAT(stats->recalls.back().selected, ::testing::ElementsAre(1, 2));
  EXPECT_THAT(stats->recalls.back().gone, ::testing::ElementsAre(0));
  // Never selected again, and never fetched again.
  ASSERT_TRUE(PrefillStep(stub_.get(), "g", 4, &rng).ok());
  stats = engine->Stats(worker::SessionKey("", "g"));
  ASSERT_TRUE(stats.ok());
  EXPECT_THAT(stats->recalls.back().selected, ::testing::ElementsAre(1, 2, 3));
  EXPECT_TRUE(stats->recalls.back().gone.empty());
}

}  // namespace
}  // namespace kvtier
