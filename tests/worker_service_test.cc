// kvtier-worker over gRPC (in process, loopback, port 0) with a real
// kvtier-store process: the RPCs, their status codes, health and metrics.
#include <cmath>
#include <random>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "services/worker/worker_server.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_util.h"
#include "tests/util/worker_stack.h"

namespace kvtier {
namespace {

using ::kvtier::testing::IsOk;
#define KVT_ASSERT_OK(expr) ASSERT_THAT((expr), IsOk())

constexpr int kLayers = 3, kQHeads = 4, kKvHeads = 2, kDim = 8;

v1::DenseTensor Dense(const std::vector<float>& x, int64_t tokens, int heads) {
  v1::DenseTensor t;
  t.set_dtype(v1::DTYPE_FP32);
  t.add_shape(tokens);
  t.add_shape(heads);
  t.add_shape(kDim);
  t.set_data(reinterpret_cast<const char*>(x.data()), x.size() * 4);
  return t;
}

std::vector<float> Floats(const v1::DenseTensor& t) {
  std::vector<float> x(t.data().size() / 4);
  std::memcpy(x.data(), t.data().data(), t.data().size());
  return x;
}

class WorkerServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVT_ASSERT_OK(stack_.Start());
    stub_ = v1::Worker::NewStub(stack_.channel());
  }

  v1::OpenSessionRequest Open(const std::string& id) {
    v1::OpenSessionRequest r;
    r.set_session_id(id);
    r.mutable_model()->set_num_layers(kLayers);
    r.mutable_model()->set_num_q_heads(kQHeads);
    r.mutable_model()->set_num_kv_heads(kKvHeads);
    r.mutable_model()->set_head_dim(kDim);
    r.mutable_model()->set_dtype(v1::DTYPE_FP16);
    r.mutable_model()->set_rope_theta(10000);
    r.mutable_policy()->set_watershed_layer(1);
    r.mutable_policy()->set_recall("all");
    r.mutable_policy()->set_release_after_end_round(true);
    return r;
  }

  testing::WorkerStack stack_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

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
          EncodedView::Raw(v1::DTYPE_FP32, lk[l].data(), kKvHeads, t, kDim, kDim, kKvHeads * kDim),
          EncodedView::Raw(v1::DTYPE_FP32, lv[l].data(), kKvHeads, t, kDim, kDim, kKvHeads * kDim)};
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
  // grpc.health.v1.Health/Check with an empty request: SERVING is field 1 = 1.
  grpc::GenericStub generic(stack_.channel());
  grpc::ClientContext hc;
  grpc::Slice empty_slice(std::string{});
  grpc::ByteBuffer hreq(&empty_slice, 1), hresp;
  absl::Notification done;
  grpc::Status hstatus;
  generic.UnaryCall(&hc, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &hreq, &hresp,
                    [&](grpc::Status s) {
                      hstatus = s;
                      done.Notify();
                    });
  done.WaitForNotification();
  ASSERT_TRUE(hstatus.ok()) << hstatus.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(hresp.Dump(&slices).ok());
  std::string bytes;
  for (auto& sl : slices) bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  EXPECT_EQ(bytes, std::string("\x08\x01", 2));
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

}  // namespace
}  // namespace kvtier
