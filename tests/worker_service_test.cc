// kvtier-worker over gRPC (in process, loopback, port 0) with a real
// kvtier-store process: the RPCs, their status codes, health and metrics.
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
#include "tests/util/worker_stack.h"

namespace kvtier {
namespace {

using ::kvtier::testing::IsOk;
using ::kvtier::testing::RawUnary;
using ::kvtier::testing::StatusIs;

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

// The tests' session: the small model above, L_w = 1, recall "all".
v1::OpenSessionRequest OpenRequest(const std::string& id) {
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

class WorkerServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVT_ASSERT_OK(stack_.Start());
    stub_ = v1::Worker::NewStub(stack_.channel());
  }

  v1::OpenSessionRequest Open(const std::string& id) { return OpenRequest(id); }

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
  EXPECT_EQ(testing::GrpcHealthStatus(stack_.channel()), 1);  // SERVING
}

// An identity skew (A = I, the first r columns) for a model of this shape.
std::string IdentitySkew(int layers, int q_heads, int kv_heads, int d, int r) {
  return spec::SerializeSkew(spec::IdentitySkew(layers, q_heads, kv_heads, d, r));
}

// PutSkew in slices: OK and the id; a slice past 1 MiB, a file that is not
// a skew, and a skew for another model get precise statuses.
absl::StatusOr<v1::PutSkewResponse> PutSkew(v1::Worker::Stub* stub, const std::string& bytes,
                                            size_t slice) {
  grpc::ClientContext c;
  v1::PutSkewResponse resp;
  auto w = stub->PutSkew(&c, &resp);
  for (size_t at = 0; at < bytes.size(); at += slice) {
    v1::PutSkewRequest r;
    r.set_data(bytes.substr(at, slice));
    if (!w->Write(r)) break;
  }
  w->WritesDone();
  grpc::Status st = w->Finish();
  if (!st.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(st.error_code()), st.error_message());
  }
  return resp;
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

// Sends the first `layers` layers of a 2-token prefill of `id` on `s`, each
// answered; false when the stream broke.
bool SendPrefillLayers(grpc::ClientReaderWriter<v1::LayerRequest, v1::LayerResponse>* s,
                       const std::string& id, int layers) {
  const std::vector<float> q(2 * kQHeads * kDim, 0.1f), kv(2 * kKvHeads * kDim, 0.2f);
  for (int l = 0; l < layers; ++l) {
    v1::LayerRequest req;
    if (l == 0) req.set_session_id(id);
    req.set_layer(l);
    *req.mutable_q() = Dense(q, 2, kQHeads);
    *req.mutable_k() = Dense(kv, 2, kKvHeads);
    *req.mutable_v() = Dense(kv, 2, kKvHeads);
    v1::LayerResponse resp;
    if (!s->Write(req) || !s->Read(&resp)) return false;
  }
  return true;
}

// Calls `f` until it returns something other than `code` (at most 50 tries,
// 20 ms apart): for the moments the worker finishes an abandoned call on
// its own threads. Returns the last result.
template <typename F>
auto RetryWhile(grpc::StatusCode code, F f) {
  auto st = f();
  for (int attempt = 1; attempt < 50 && st.error_code() == code; ++attempt) {
    absl::SleepFor(absl::Milliseconds(20));
    st = f();
  }
  return st;
}

// After a stopped store resumes: it first serves the calls that queued
// while it was stopped, which on a loaded machine can outlast the worker's
// store deadline (1 s in these tests) once or twice; a retry then finds it
// caught up. ABORTED is an attempt still finishing on the worker, and
// UNAVAILABLE a step it has not rolled back yet.
template <typename F>
auto RetryWhileResuming(F f) {
  auto st = f();
  for (int attempt = 1;
       attempt < 50 && (st.error_code() == grpc::StatusCode::ABORTED ||
                        st.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
                        st.error_code() == grpc::StatusCode::UNAVAILABLE ||
                        (attempt < 5 && st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED));
       ++attempt) {
    absl::SleepFor(absl::Milliseconds(20));
    st = f();
  }
  return st;
}

// Runs one whole prefill step of n tokens for `id` over `stub`, returning
// the stream's final status.
grpc::Status PrefillStep(v1::Worker::Stub* stub, const std::string& id, int64_t n,
                         std::mt19937* rng, absl::Duration deadline = absl::Seconds(30),
                         const std::string& token = "") {
  std::normal_distribution<float> nd;
  auto rnd = [&](size_t len) {
    std::vector<float> x(len);
    for (float& v : x) v = nd(*rng);
    return x;
  };
  grpc::ClientContext c;
  c.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  if (!token.empty()) c.AddMetadata("authorization", "Bearer " + token);
  auto s = stub->Prefill(&c);
  for (int l = 0; l < kLayers; ++l) {
    v1::LayerRequest req;
    if (l == 0) req.set_session_id(id);
    req.set_layer(l);
    *req.mutable_q() = Dense(rnd(n * kQHeads * kDim), n, kQHeads);
    *req.mutable_k() = Dense(rnd(n * kKvHeads * kDim), n, kKvHeads);
    *req.mutable_v() = Dense(rnd(n * kKvHeads * kDim), n, kKvHeads);
    v1::LayerResponse resp;
    if (!s->Write(req) || !s->Read(&resp)) break;
  }
  s->WritesDone();
  return s->Finish();
}

grpc::Status EndRound(v1::Worker::Stub* stub, const std::string& id, v1::EndRoundResponse* resp,
                      absl::Duration deadline = absl::Seconds(30), const std::string& token = "") {
  grpc::ClientContext c;
  c.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  if (!token.empty()) c.AddMetadata("authorization", "Bearer " + token);
  v1::EndRoundRequest r;
  r.set_session_id(id);
  return stub->EndRound(&c, r, resp);
}

// A hostile tenant names its own listener as a store replica, to catch the
// worker's store token: in OpenSession, in a TransferSession header, and
// beside the worker's real store. Each is PERMISSION_DENIED naming the
// address; the listener never sees a connection, even after the steps and
// EndRound that would have written rounds there; malformed addresses are
// INVALID_ARGUMENT; the worker's own --store still works.
TEST_F(WorkerServiceTest, ATenantCannotPointTheWorkerAtAnAddressOfItsChoosing) {
  testing::TrapListener trap;
  ASSERT_TRUE(trap.ok());
  std::mt19937 rng(9);
  v1::EndRoundResponse end;
  for (const std::vector<std::string>& stores :
       {std::vector<std::string>{trap.address()},
        std::vector<std::string>{stack_.store()->target(), trap.address()}}) {
    v1::OpenSessionRequest open = Open("steal");
    for (const std::string& a : stores) open.add_store_addresses(a);
    grpc::ClientContext c;
    v1::OpenSessionResponse r;
    const grpc::Status st = stub_->OpenSession(&c, open, &r);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr(trap.address()));
    EXPECT_EQ(PrefillStep(stub_.get(), "steal", 4, &rng).error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(EndRound(stub_.get(), "steal", &end, absl::Seconds(2)).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  for (const std::string& bad :
       {std::string("127.0.0.1:70 70"), std::string("evil\n:1"), std::string(10'000, 'x') + ":1"}) {
    v1::OpenSessionRequest open = Open("malformed");
    open.add_store_addresses(bad);
    grpc::ClientContext c;
    v1::OpenSessionResponse r;
    const grpc::Status st = stub_->OpenSession(&c, open, &r);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_LT(st.error_message().size(), 400u);
  }
  {
    // A hand-off stream whose header names the listener ends at the header.
    grpc::ClientContext c;
    c.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::TransferSessionResponse resp;
    auto w = stub_->TransferSession(&c, &resp);
    v1::TransferChunk chunk;
    v1::TransferHeader* h = chunk.mutable_header();
    h->set_session_id("moved");
    *h->mutable_model() = Open("moved").model();
    h->add_store_addresses(trap.address());
    w->Write(chunk);
    w->WritesDone();
    const grpc::Status st = w->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr(trap.address()));
  }
  EXPECT_EQ(trap.Connections(), 0);
  // The worker's own store is allowed by name.
  v1::OpenSessionRequest own = Open("own");
  own.add_store_addresses(stack_.store()->target());
  grpc::ClientContext c;
  v1::OpenSessionResponse r;
  const grpc::Status st = stub_->OpenSession(&c, own, &r);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_TRUE(PrefillStep(stub_.get(), "own", 4, &rng).ok());
  ASSERT_TRUE(EndRound(stub_.get(), "own", &end).ok());
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
        const KvBlock b{EncodedView::Raw(v1::DTYPE_FP32, k.data(), kKv, i + 1, kD, kD, kKv * kD),
                        EncodedView::Raw(v1::DTYPE_FP32, v.data(), kKv, i + 1, kD, kD, kKv * kD)};
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

// A store that stops answering (SIGSTOP) costs a call its deadline and a
// precise DEADLINE_EXCEEDED, never a hang: the caller's own deadline when
// it sets one, the worker's store deadline when it does not.
class WorkerDeadlineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVT_ASSERT_OK(stack_.Start(absl::Seconds(1)));
    stub_ = v1::Worker::NewStub(stack_.channel());
  }
  void TearDown() override { stack_.store()->Resume(); }
  testing::WorkerStack stack_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

TEST_F(WorkerDeadlineTest, StoppedStoreGivesDeadlineExceeded) {
  v1::OpenSessionRequest open;
  open.set_session_id("s");
  open.mutable_model()->set_num_layers(kLayers);
  open.mutable_model()->set_num_q_heads(kQHeads);
  open.mutable_model()->set_num_kv_heads(kKvHeads);
  open.mutable_model()->set_head_dim(kDim);
  open.mutable_model()->set_dtype(v1::DTYPE_FP16);
  open.mutable_policy()->set_watershed_layer(1);
  open.mutable_policy()->set_recall("all");
  grpc::ClientContext oc;
  v1::OpenSessionResponse or_;
  ASSERT_TRUE(stub_->OpenSession(&oc, open, &or_).ok());
  std::mt19937 rng(2);
  v1::EndRoundResponse end;
  ASSERT_TRUE(PrefillStep(stub_.get(), "s", 4, &rng).ok());
  ASSERT_TRUE(EndRound(stub_.get(), "s", &end).ok());
  ASSERT_TRUE(PrefillStep(stub_.get(), "s", 4, &rng).ok());

  stack_.store()->Pause();
  // The caller's deadline (0.5 s) reaches the store.
  auto t0 = absl::Now();
  grpc::Status s = EndRound(stub_.get(), "s", &end, absl::Milliseconds(500));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  // Without a caller deadline: the worker's own store deadline (1 s). The
  // first attempt may still be finishing on the worker (its store call had
  // the same 0.5 s): that is ABORTED, and a retry.
  s = RetryWhile(grpc::StatusCode::ABORTED, [&] {
    t0 = absl::Now();
    grpc::ClientContext c;
    v1::EndRoundRequest r;
    r.set_session_id("s");
    return stub_->EndRound(&c, r, &end);
  });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(900));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  // The engine directly: its Get/Put pass the deadline on.
  worker::Engine* engine = stack_.server()->engine();
  absl::Status direct;
  for (int attempt = 0; attempt < 50; ++attempt) {
    t0 = absl::Now();
    direct = engine->EndRound("s", CallOptions::Within(absl::Milliseconds(300))).status();
    if (!absl::IsAborted(direct)) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_THAT(direct, StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3));

  // The round stayed open; with the store back, EndRound succeeds.
  stack_.store()->Resume();
  s = RetryWhileResuming([&] { return EndRound(stub_.get(), "s", &end); });
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(end.round(), 1u);

  // The recall fetch at L_w + 1 waits at most the caller's deadline.
  stack_.store()->Pause();
  t0 = absl::Now();
  s = PrefillStep(stub_.get(), "s", 4, &rng, absl::Milliseconds(700));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  stack_.store()->Resume();
  // Rolled back: the whole step can be sent again.
  const grpc::Status again =
      RetryWhileResuming([&] { return PrefillStep(stub_.get(), "s", 4, &rng); });
  EXPECT_TRUE(again.ok()) << again.error_message();
}

// Tenants are a (tenant, session) pair, never one joined string: with
// tenants `acme` and `acme.eu`, `acme` naming session `eu.x` reaches its own
// session, not acme.eu's `x`. The worker acts for each end tenant at the
// store (a node token), so rounds land under the end tenant and its own
// store quota applies.
TEST(WorkerTenantTest, TenantsCannotReachEachOther) {
  testing::TempDir dir;
  const std::string worker_tenants = dir.path() + "/worker-tenants";
  const std::string store_tenants = dir.path() + "/store-tenants";
  testing::WriteFile(worker_tenants,
                     "acme-token-1   acme     readwrite\n"
                     "acmeeu-token-1 acme.eu  readwrite\n");
  // The worker's node token; readonly tokens for looking, and acme's quota
  // (too small for one round).
  testing::WriteFile(store_tenants,
                     "worker-node-token worker   node\n"
                     "acme-reader-1     acme     readonly 1024\n"
                     "acmeeu-reader-1   acme.eu  readonly\n");
  testing::WorkerStackOptions o;
  o.worker_tenants_file = worker_tenants;
  o.store_flags = {"--tenants_file=" + store_tenants};
  o.store_token = "worker-node-token";
  testing::WorkerStack stack;
  KVT_ASSERT_OK(stack.Start(o));
  auto stub = v1::Worker::NewStub(stack.channel());
  auto open = [&](const std::string& id, const std::string& token) {
    grpc::ClientContext c;
    c.AddMetadata("authorization", "Bearer " + token);
    v1::OpenSessionResponse resp;
    return stub->OpenSession(&c, OpenRequest(id), &resp);
  };
  auto close = [&](const std::string& id, const std::string& token) {
    grpc::ClientContext c;
    c.AddMetadata("authorization", "Bearer " + token);
    v1::CloseSessionRequest r;
    r.set_session_id(id);
    r.set_delete_from_store(true);
    v1::CloseSessionResponse resp;
    return stub->CloseSession(&c, r, &resp);
  };
  std::mt19937 rng(7);
  ASSERT_TRUE(open("x", "acmeeu-token-1").ok());
  ASSERT_TRUE(PrefillStep(stub.get(), "x", 4, &rng, absl::Seconds(30), "acmeeu-token-1").ok());
  v1::EndRoundResponse end;
  ASSERT_TRUE(EndRound(stub.get(), "x", &end, absl::Seconds(30), "acmeeu-token-1").ok());

  // acme cannot touch acme.eu's x under any spelling.
  EXPECT_EQ(EndRound(stub.get(), "eu.x", &end, absl::Seconds(30), "acme-token-1").error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(close("eu.x", "acme-token-1").error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(close("x", "acme-token-1").error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(open("acme.eu/x", "acme-token-1").error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Its own eu.x is a different session; filling it leaves acme.eu's alone.
  ASSERT_TRUE(open("eu.x", "acme-token-1").ok());
  ASSERT_TRUE(PrefillStep(stub.get(), "eu.x", 4, &rng, absl::Seconds(30), "acme-token-1").ok());
  // acme's store quota (1 KiB) holds per end tenant: its round is refused...
  const grpc::Status over = EndRound(stub.get(), "eu.x", &end, absl::Seconds(30), "acme-token-1");
  EXPECT_EQ(over.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << over.error_message();
  // ...while acme.eu, with no quota, goes on.
  ASSERT_TRUE(PrefillStep(stub.get(), "x", 2, &rng, absl::Seconds(30), "acmeeu-token-1").ok());
  ASSERT_TRUE(EndRound(stub.get(), "x", &end, absl::Seconds(30), "acmeeu-token-1").ok());

  // In the store, the rounds are acme.eu's, under its own session name.
  auto store = v1::Store::NewStub(
      grpc::CreateChannel(stack.store()->target(), grpc::InsecureChannelCredentials()));
  auto list = [&](const std::string& token, const std::string& session, int* rounds) {
    grpc::ClientContext c;
    c.AddMetadata("authorization", "Bearer " + token);
    v1::ListRoundsRequest r;
    r.set_session_id(session);
    v1::ListRoundsResponse resp;
    grpc::Status st = store->ListRounds(&c, r, &resp);
    *rounds = resp.rounds_size();
    return st.error_code();
  };
  int rounds = 0;
  EXPECT_EQ(list("acmeeu-reader-1", "x", &rounds), grpc::StatusCode::OK);
  EXPECT_EQ(rounds, 2);
  EXPECT_EQ(list("acme-reader-1", "x", &rounds), grpc::StatusCode::NOT_FOUND);
  // acme's refused round left nothing behind (its session record may stay).
  rounds = -1;
  list("acme-reader-1", "eu.x", &rounds);
  EXPECT_EQ(rounds, 0);
  // Deleting from the store also acts for the end tenant.
  EXPECT_TRUE(close("x", "acmeeu-token-1").ok());
  EXPECT_EQ(list("acmeeu-reader-1", "x", &rounds), grpc::StatusCode::NOT_FOUND);
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

// Two tenants on one worker, one hostile. The hostile one opens sessions
// until its default share (--tenant_max_sessions) refuses it, grows one
// past its working-set share, opens a PutSkew stream and goes silent, and
// tries a second, then sends more skew bytes than its share: each refusal
// is RESOURCE_EXHAUSTED naming the limit, and the silent stream ends
// DEADLINE_EXCEEDED after the idle deadline. The
// well-behaved tenant's every call meanwhile succeeds at once: its
// sessions open, step and end rounds, and its skew uploads.
TEST(WorkerFairnessTest, AHostileTenantTakesOnlyItsShare) {
  testing::TempDir dir;
  testing::WriteFile(dir.path() + "/tenants",
                     "evil-token-00001 evil readwrite\n"
                     "good-token-00001 good readwrite\n");
  testing::StoreProcess store(dir.path() + "/db");
  ASSERT_TRUE(store.Start().ok());
  WorkerServerOptions wo;
  wo.listen = "127.0.0.1:0";
  wo.metrics_listen = "";
  wo.tenants_file = dir.path() + "/tenants";
  wo.store.target = store.target();
  wo.engine.max_sessions = 64;
  // Shares: 4 sessions and room for 64 tokens of the tests' model (fp16).
  wo.engine.default_tenant_limit = {4, 64 * kLayers * kKvHeads * kDim * 2 * 2};
  wo.service.skew_uploads_per_tenant = 1;
  wo.service.skew_upload_bytes_per_tenant = 1 << 20;
  wo.service.skew_upload_idle = absl::Milliseconds(500);
  auto worker = WorkerServer::Start(wo);
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*worker)->port()),
                                                      grpc::InsecureChannelCredentials()));
  const std::string evil = "evil-token-00001", good = "good-token-00001";
  auto open = [&](const std::string& token, const std::string& id) {
    grpc::ClientContext c;
    c.AddMetadata("authorization", "Bearer " + token);
    v1::OpenSessionResponse r;
    return stub->OpenSession(&c, OpenRequest(id), &r);
  };
  auto upload = [&](const std::string& token, grpc::ClientContext* c, v1::PutSkewResponse* resp) {
    c->AddMetadata("authorization", "Bearer " + token);
    c->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    return stub->PutSkew(c, resp);
  };
  std::mt19937 rng(21);
  v1::EndRoundResponse end;

  for (int i = 0; i < 4; ++i) ASSERT_TRUE(open(evil, absl::StrCat("e", i)).ok()) << i;
  const grpc::Status more = open(evil, "e4");
  EXPECT_EQ(more.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(more.error_message(), ::testing::HasSubstr("--tenant_max_sessions"));
  ASSERT_TRUE(PrefillStep(stub.get(), "e0", 60, &rng, absl::Seconds(30), evil).ok());
  const grpc::Status grown = PrefillStep(stub.get(), "e1", 60, &rng, absl::Seconds(30), evil);
  EXPECT_EQ(grown.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(grown.error_message(), ::testing::HasSubstr("--tenant_max_working_set_mb"));
  // A skew upload that sends one slice and then nothing; a second refused.
  grpc::ClientContext silent_ctx;
  v1::PutSkewResponse silent_resp;
  auto silent = upload(evil, &silent_ctx, &silent_resp);
  v1::PutSkewRequest slice;
  slice.set_data(std::string(1000, 'x'));
  silent->WaitForInitialMetadata();  // Admitted.
  ASSERT_TRUE(silent->Write(slice));
  const absl::Time silent_since = absl::Now();
  {
    grpc::ClientContext c;
    v1::PutSkewResponse r;
    auto second = upload(evil, &c, &r);
    second->WritesDone();
    const grpc::Status st = second->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr("--skew_uploads_per_tenant"));
  }

  // Meanwhile the other tenant is served in full.
  for (int i = 0; i < 4; ++i) {
    const std::string id = absl::StrCat("g", i);
    ASSERT_TRUE(open(good, id).ok()) << id;
    ASSERT_TRUE(PrefillStep(stub.get(), id, 12, &rng, absl::Seconds(30), good).ok()) << id;
    ASSERT_TRUE(EndRound(stub.get(), id, &end, absl::Seconds(30), good).ok()) << id;
  }
  {
    grpc::ClientContext c;
    v1::PutSkewResponse r;
    auto w = upload(good, &c, &r);
    v1::PutSkewRequest req;
    req.set_data(IdentitySkew(kLayers, kQHeads, kKvHeads, kDim, 2));
    ASSERT_TRUE(w->Write(req));
    w->WritesDone();
    const grpc::Status st = w->Finish();
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_FALSE(r.skew_id().empty());
  }

  // The silent stream ends by the idle deadline, not the call's, and gives
  // its slot back.
  const grpc::Status st = silent->Finish();  // Never half-closed.
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
  EXPECT_THAT(st.error_message(), ::testing::HasSubstr("PutSkew idle for 500ms"));
  EXPECT_GE(absl::Now() - silent_since, absl::Milliseconds(500));
  {
    grpc::ClientContext c;
    v1::PutSkewResponse r;
    auto again = upload(evil, &c, &r);
    v1::PutSkewRequest req;
    req.set_data(IdentitySkew(kLayers, kQHeads, kKvHeads, kDim, 1));
    ASSERT_TRUE(again->Write(req));
    again->WritesDone();
    EXPECT_TRUE(again->Finish().ok());
  }
  // Bytes in flight are capped per tenant too (1 MiB here).
  grpc::ClientContext c;
  v1::PutSkewResponse r;
  auto big = upload(evil, &c, &r);
  v1::PutSkewRequest half;
  half.set_data(std::string(600 << 10, 'x'));
  big->Write(half);
  big->Write(half);
  big->WritesDone();
  const grpc::Status capped = big->Finish();
  EXPECT_EQ(capped.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << capped.error_message();
  EXPECT_THAT(capped.error_message(), ::testing::HasSubstr("--skew_upload_mb_per_tenant"));
}

// A session opened with store replicas keeps every round on each of them,
// byte for byte; when its first replica dies, recalls come from the next;
// a round that cannot reach every replica is refused (UNAVAILABLE, naming
// the store) and leaves no half round behind.
TEST(WorkerReplicationTest, RoundsLandOnEveryReplicaAndRecallsFallBack) {
  testing::TempDir dir;
  testing::StoreProcess a(dir.path() + "/a"), b(dir.path() + "/b");
  ASSERT_TRUE(a.Start().ok());
  ASSERT_TRUE(b.Start().ok());
  WorkerServerOptions wo;
  wo.listen = "127.0.0.1:0";
  wo.metrics_listen = "";
  wo.store.target = a.target();
  wo.replica_stores = {b.target()};
  wo.service.store_deadline = absl::Seconds(5);
  auto worker = WorkerServer::Start(wo);
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*worker)->port()),
                                                      grpc::InsecureChannelCredentials()));
  v1::OpenSessionRequest open = OpenRequest("r");
  open.add_store_addresses(b.target());  // b first: the primary.
  open.add_store_addresses(a.target());
  {
    v1::OpenSessionRequest bad = open;
    bad.set_session_id("bad");
    bad.add_store_addresses(a.target());  // Repeated.
    grpc::ClientContext c;
    v1::OpenSessionResponse r;
    EXPECT_EQ(stub->OpenSession(&c, bad, &r).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext c;
    v1::OpenSessionResponse r;
    ASSERT_TRUE(stub->OpenSession(&c, open, &r).ok());
  }
  std::mt19937 rng(11);
  v1::EndRoundResponse end;
  for (int round = 0; round < 2; ++round) {
    ASSERT_TRUE(PrefillStep(stub.get(), "r", 4, &rng).ok());
    ASSERT_TRUE(EndRound(stub.get(), "r", &end).ok());
  }
  auto client = [](const testing::StoreProcess& p) {
    StoreClientOptions o;
    o.target = p.target();
    return std::move(StoreClient::Connect(o)).value();
  };
  auto ca = client(a), cb = client(b);
  const std::vector<v1::SegmentRef> refs = testing::BothSegments(2);
  auto got_a = ca->GetSegments("r", refs);
  auto got_b = cb->GetSegments("r", refs);
  ASSERT_TRUE(got_a.ok()) << got_a.status();
  ASSERT_TRUE(got_b.ok()) << got_b.status();
  for (size_t i = 0; i < refs.size(); ++i) {
    EXPECT_TRUE((*got_a)[i].payload == (*got_b)[i].payload) << "segment " << i;
  }

  // The primary dies: the next round's recall is served by the other.
  b.Kill();
  const uint64_t before = (*worker)->segments()->read_fallbacks();
  const grpc::Status st = PrefillStep(stub.get(), "r", 4, &rng);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ((*worker)->segments()->read_fallbacks(), before + 1);
  // The round cannot reach every replica: refused, and a holds no half of it.
  const grpc::Status ended = EndRound(stub.get(), "r", &end);
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(ended.error_message(), ::testing::HasSubstr(b.target()));
  auto list = ca->ListRounds("r");
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->rounds_size(), 2);
}

// With a controller, a dead replica is replaced and repaired: three real
// stores and a worker join kvtier-controller (R = 2); the session's primary
// is killed; once the controller has declared it dead, the next round lands
// on the surviving replica and the store that replaces the dead one, and the
// controller copies the older round there: R = 2 again, byte for byte.
TEST(WorkerReplicationTest, ADeadReplicaIsReplacedThroughTheController) {
  testing::TempDir dir;
  const std::string tenants = dir.path() + "/tenants";
  testing::WriteFile(tenants,
                     "node-token-00001 nodes node\n"
                     "acme-token-00001 acme  readwrite\n");
  ControllerServerOptions co;
  co.listen = "127.0.0.1:0";
  co.metrics_listen = "";
  co.tenants_file = tenants;
  co.controller.replicas = 2;
  co.controller.membership.heartbeat_interval = absl::Milliseconds(100);
  co.controller.membership.warmup = absl::ZeroDuration();
  co.repair.store_token = "node-token-00001";
  auto controller = ControllerServer::Start(co);
  ASSERT_TRUE(controller.ok()) << controller.status();
  const std::string target = absl::StrCat("127.0.0.1:", (*controller)->port());
  std::vector<std::unique_ptr<testing::StoreProcess>> stores;
  for (const char* id : {"s-a", "s-b", "s-c"}) {
    stores.push_back(std::make_unique<testing::StoreProcess>(
        dir.path() + "/" + id,
        std::vector<std::string>{"--controller=" + target, "--controller_token=node-token-00001",
                                 std::string("--node_id=") + id}));
    ASSERT_TRUE(stores.back()->Start().ok());
  }
  WorkerServerOptions wo;
  wo.listen = "127.0.0.1:0";
  wo.metrics_listen = "";
  wo.tenants_file = tenants;
  wo.store.target = stores[0]->target();
  wo.cluster.controller = target;
  wo.cluster.controller_token = "node-token-00001";
  wo.cluster.node_id = "w-a";
  auto worker = WorkerServer::Start(wo);
  ASSERT_TRUE(worker.ok()) << worker.status();
  controller::Controller* ctl = (*controller)->controller();
  auto live = [&](controller::NodeKind k) { return ctl->membership().Live(k).size(); };
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while ((live(controller::NodeKind::kStore) < 3 || live(controller::NodeKind::kWorker) < 1) &&
         absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(live(controller::NodeKind::kStore), 3u);

  // The engine routes the session as its tenant and opens it on the worker.
  KVT_ASSERT_OK_AND_ASSIGN(controller::Placement pl, ctl->Route("acme", "chat"));
  ASSERT_EQ(pl.stores.size(), 2u);
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*worker)->port()),
                                                      grpc::InsecureChannelCredentials()));
  v1::OpenSessionRequest open = OpenRequest("chat");
  for (const auto& st : pl.stores) open.add_store_addresses(st.spec.address);
  {
    // Beside a store the controller placed, an address it does not know
    // is refused: the worker asked the controller, not the tenant.
    testing::TrapListener trap;
    ASSERT_TRUE(trap.ok());
    v1::OpenSessionRequest hostile = OpenRequest("chat-hostile");
    hostile.add_store_addresses(pl.stores[0].spec.address);
    hostile.add_store_addresses(trap.address());
    grpc::ClientContext c;
    c.AddMetadata("authorization", "Bearer acme-token-00001");
    v1::OpenSessionResponse r;
    const grpc::Status st = stub->OpenSession(&c, hostile, &r);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr("controller lists"));
    EXPECT_EQ(trap.Connections(), 0);
  }
  {
    grpc::ClientContext c;
    c.AddMetadata("authorization", "Bearer acme-token-00001");
    v1::OpenSessionResponse r;
    const grpc::Status st = stub->OpenSession(&c, open, &r);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  {
    // Nor may it hand the session to a "worker" the controller does not
    // list: refused before anything is dialled.
    testing::TrapListener trap;
    ASSERT_TRUE(trap.ok());
    grpc::ClientContext c;
    c.AddMetadata("authorization", "Bearer acme-token-00001");
    v1::SendSessionRequest send;
    send.set_session_id("chat");
    send.set_target(trap.address());
    v1::SendSessionResponse r;
    const grpc::Status st = stub->SendSession(&c, send, &r);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr("hand-off target"));
    EXPECT_EQ(trap.Connections(), 0);
  }
  const std::string token = "acme-token-00001";
  std::mt19937 rng(5);
  v1::EndRoundResponse end;
  ASSERT_TRUE(PrefillStep(stub.get(), "chat", 4, &rng, absl::Seconds(30), token).ok());
  ASSERT_TRUE(EndRound(stub.get(), "chat", &end, absl::Seconds(30), token).ok());

  // The primary dies, and the controller notices.
  testing::StoreProcess* primary = nullptr;
  testing::StoreProcess* survivor = nullptr;
  testing::StoreProcess* spare = nullptr;
  for (auto& st : stores) {
    if (st->target() == pl.stores[0].spec.address) {
      primary = st.get();
    } else if (st->target() == pl.stores[1].spec.address) {
      survivor = st.get();
    } else {
      spare = st.get();
    }
  }
  ASSERT_TRUE(primary != nullptr && survivor != nullptr && spare != nullptr);
  primary->Kill();
  const absl::Time dead_by = absl::Now() + absl::Seconds(10);
  while (live(controller::NodeKind::kStore) != 2 && absl::Now() < dead_by) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(live(controller::NodeKind::kStore), 2u);

  // The next round: its recall falls back to the survivor, and it is
  // stored on the survivor and the spare.
  ASSERT_TRUE(PrefillStep(stub.get(), "chat", 4, &rng, absl::Seconds(30), token).ok());
  const grpc::Status ended = EndRound(stub.get(), "chat", &end, absl::Seconds(30), token);
  ASSERT_TRUE(ended.ok()) << ended.error_message();
  EXPECT_EQ(end.round(), 1u);
  EXPECT_EQ((*worker)->segments()->reroutes(), 1u);
  auto client_of = [&](testing::StoreProcess* p) {
    StoreClientOptions o;
    o.target = p->target();
    return std::move(StoreClient::Connect(o)).value();
  };
  CallOptions as_acme;
  as_acme.tenant = "acme";
  auto rounds_on = [&](testing::StoreProcess* p) {
    auto list = client_of(p)->ListRounds("chat", as_acme);
    std::vector<uint32_t> out;
    if (list.ok()) {
      for (const auto& r : list->rounds()) out.push_back(r.round());
    }
    return out;
  };
  EXPECT_THAT(rounds_on(survivor), ::testing::ElementsAre(0u, 1u));
  // Repair copies round 0 from the survivor to the spare.
  const absl::Time repaired_by = absl::Now() + absl::Seconds(20);
  while ((ctl->RepairsPending() > 0 || rounds_on(spare).size() < 2) && absl::Now() < repaired_by) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(ctl->RepairsPending(), 0u);
  EXPECT_EQ(ctl->UnderReplicated(), 0u);
  ASSERT_THAT(rounds_on(spare), ::testing::ElementsAre(0u, 1u));
  const RepairStats rs = (*controller)->repairer()->stats();
  EXPECT_EQ(rs.sessions_repaired, 1u);
  EXPECT_GE(rs.segments_copied + rs.segments_present, 2u);  // Round 0 at least.
  const std::vector<v1::SegmentRef> refs = testing::BothSegments(2);
  auto from_survivor = client_of(survivor)->GetSegments("chat", refs, as_acme);
  auto from_spare = client_of(spare)->GetSegments("chat", refs, as_acme);
  ASSERT_TRUE(from_survivor.ok()) << from_survivor.status();
  ASSERT_TRUE(from_spare.ok()) << from_spare.status();
  for (size_t i = 0; i < refs.size(); ++i) {
    EXPECT_TRUE((*from_survivor)[i].payload == (*from_spare)[i].payload) << "segment " << i;
    EXPECT_EQ((*from_survivor)[i].info.layer_end(), (*from_spare)[i].info.layer_end());
  }
  // The copy was not counted as a recall on the survivor: round 0 was
  // recalled once (by round 1's prefill), plus this test's own read.
  auto listed = client_of(survivor)->ListRounds("chat", as_acme);
  ASSERT_TRUE(listed.ok());
  EXPECT_LE(listed->rounds(0).summary().recall_count(), 2u);
}

// Worker failover: a worker that never held a session resumes it from the
// store (OpenSession with resume) and answers the next step exactly as the
// worker that held it does (a lossless policy; same inputs, same outputs).
TEST(WorkerResumeTest, AnotherWorkerResumesFromTheStore) {
  testing::TempDir dir;
  testing::StoreProcess store(dir.path() + "/db");
  ASSERT_TRUE(store.Start().ok());
  auto start_worker = [&]() {
    WorkerServerOptions wo;
    wo.listen = "127.0.0.1:0";
    wo.metrics_listen = "";
    wo.store.target = store.target();
    return std::move(WorkerServer::Start(wo)).value();
  };
  auto a = start_worker();
  auto b = start_worker();
  auto stub_for = [](WorkerServer& w) {
    return v1::Worker::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", w.port()),
                                                   grpc::InsecureChannelCredentials()));
  };
  auto sa = stub_for(*a), sb = stub_for(*b);
  auto open = [](v1::Worker::Stub* stub, bool resume, v1::OpenSessionResponse* r) {
    v1::OpenSessionRequest req = OpenRequest("f");
    req.set_resume(resume);
    grpc::ClientContext c;
    return stub->OpenSession(&c, req, r);
  };
  v1::OpenSessionResponse ra, rb;
  EXPECT_EQ(open(sb.get(), true, &rb).error_code(), grpc::StatusCode::NOT_FOUND);
  ASSERT_TRUE(open(sa.get(), false, &ra).ok());
  std::mt19937 rng(21);
  v1::EndRoundResponse end;
  for (int round = 0; round < 3; ++round) {
    ASSERT_TRUE(PrefillStep(sa.get(), "f", 5, &rng).ok());
    ASSERT_TRUE(EndRound(sa.get(), "f", &end).ok());
  }
  // b never held "f": it resumes from the store's three rounds.
  ASSERT_TRUE(open(sb.get(), true, &rb).ok());
  EXPECT_EQ(rb.next_round(), 3u);
  // Resuming a session the worker holds is ALREADY_EXISTS.
  EXPECT_EQ(open(sb.get(), true, &rb).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  // The same step on both workers: the same outputs.
  std::vector<std::vector<float>> q(kLayers), k(kLayers), v(kLayers);
  std::normal_distribution<float> nd;
  for (int l = 0; l < kLayers; ++l) {
    for (auto* x : {&q[l], &k[l], &v[l]}) {
      x->resize((x == &q[l] ? kQHeads : kKvHeads) * kDim * 4);
      for (float& e : *x) e = nd(rng);
    }
  }
  auto step = [&](v1::Worker::Stub* stub) {
    std::vector<std::vector<float>> outs;
    grpc::ClientContext c;
    auto s = stub->Prefill(&c);
    for (int l = 0; l < kLayers; ++l) {
      v1::LayerRequest req;
      if (l == 0) req.set_session_id("f");
      req.set_layer(l);
      *req.mutable_q() = Dense(q[l], 4, kQHeads);
      *req.mutable_k() = Dense(k[l], 4, kKvHeads);
      *req.mutable_v() = Dense(v[l], 4, kKvHeads);
      v1::LayerResponse resp;
      EXPECT_TRUE(s->Write(req) && s->Read(&resp));
      outs.push_back(Floats(resp.o()));
    }
    s->WritesDone();
    EXPECT_TRUE(s->Finish().ok());
    return outs;
  };
  const auto out_a = step(sa.get());
  const auto out_b = step(sb.get());
  ASSERT_EQ(out_a.size(), out_b.size());
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_EQ(out_a[l].size(), static_cast<size_t>(4 * kQHeads * kDim));
    EXPECT_EQ(out_a[l], out_b[l]) << "layer " << l;
  }
  // b carries on: its round is round 3.
  ASSERT_TRUE(EndRound(sb.get(), "f", &end).ok());
  EXPECT_EQ(end.round(), 3u);
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

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

// A controller (heartbeats every 100 ms, sessions cold after 300 ms), a
// kvtier-store process and an in-process worker, both joined to it.
struct PressureCluster {
  absl::Status Start(double pressure_moderate, double pressure_high, const std::string& store_id,
                     const std::string& disk_budget_mb, const std::string& worker_id,
                     uint64_t max_working_set_bytes) {
    ControllerServerOptions co;
    co.listen = "127.0.0.1:0";
    co.metrics_listen = "";
    co.controller.membership.heartbeat_interval = absl::Milliseconds(100);
    co.controller.membership.warmup = absl::ZeroDuration();
    co.controller.membership.pressure_moderate = pressure_moderate;
    co.controller.membership.pressure_high = pressure_high;
    co.policy.cold_after = absl::Milliseconds(300);
    KVT_ASSIGN_OR_RETURN(controller, ControllerServer::Start(co));
    target = absl::StrCat("127.0.0.1:", controller->port());
    store = std::make_unique<testing::StoreProcess>(
        dir.path() + "/db",
        std::vector<std::string>{"--controller=" + target, "--node_id=" + store_id,
                                 "--disk_budget_mb=" + disk_budget_mb});
    KVT_RETURN_IF_ERROR(store->Start());
    WorkerServerOptions wo;
    wo.listen = "127.0.0.1:0";
    wo.metrics_listen = "";
    wo.store.target = store->target();
    wo.cluster.controller = target;
    wo.cluster.node_id = worker_id;
    wo.engine.max_working_set_bytes = max_working_set_bytes;
    KVT_ASSIGN_OR_RETURN(worker, WorkerServer::Start(wo));
    stub = v1::Worker::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", worker->port()),
                                                   grpc::InsecureChannelCredentials()));
    return absl::OkStatus();
  }

  testing::TempDir dir;
  std::unique_ptr<ControllerServer> controller;
  std::string target;  // The controller's address.
  std::unique_ptr<testing::StoreProcess> store;
  std::unique_ptr<WorkerServer> worker;
  std::unique_ptr<v1::Worker::Stub> stub;
};

// Memory pressure end to end, with a real controller, store and worker: a
// model's policy is registered; a session opens without a Policy and gets
// it; once the session is cold and its nodes are under pressure (the
// thresholds here make any use HIGH), the worker runs its next rounds with
// the tightened policy (raw -> 4-bit KIVI), and the store drops the
// session's never-recalled rounds but its newest. The session goes on.
TEST(WorkerPressureTest, ColdSessionsGetTighterPoliciesAndLoseUnrecalledRounds) {
  PressureCluster pc;
  const absl::Status started =
      pc.Start(1e-9, 1e-9, "store-p", "64", "worker-p", uint64_t{64} << 20);
  ASSERT_TRUE(started.ok()) << started;
  ControllerClientOptions cco;
  cco.target = pc.target;
  auto admin = std::move(ControllerClient::Connect(cco)).value();

  // The model's policy recalls only a round that takes all the attention
  // mass (round 0, the one past round of round 1), so rounds 1 and 2 are
  // never recalled.
  v1::SetPolicyRequest set;
  set.set_model_name("tiny");
  set.mutable_policy()->set_watershed_layer(1);
  set.mutable_policy()->set_recall("threshold:1");
  set.mutable_policy()->set_keep_recent_round(false);
  {
    auto registered = admin->SetPolicy(set);
    ASSERT_TRUE(registered.ok()) << registered.status();
  }
  v1::OpenSessionRequest open = OpenRequest("p");
  open.clear_policy();
  open.mutable_model()->set_name("tiny");
  {
    grpc::ClientContext c;
    v1::OpenSessionResponse r;
    const grpc::Status st = pc.stub->OpenSession(&c, open, &r);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(r.effective_policy().recall(), "threshold:1");
    EXPECT_FALSE(r.effective_policy().keep_recent_round());
  }
  std::mt19937 rng(9);
  v1::EndRoundResponse end;
  for (int round = 0; round < 3; ++round) {
    ASSERT_TRUE(PrefillStep(pc.stub.get(), "p", 4, &rng).ok());
    ASSERT_TRUE(EndRound(pc.stub.get(), "p", &end).ok());
  }
  worker::Engine* engine = pc.worker->engine();
  const worker::SessionKey key("", "p");
  auto stats = engine->Stats(key);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->policy.codec.codec, v1::CODEC_RAW);

  StoreClientOptions so;
  so.target = pc.store->target();
  auto client = std::move(StoreClient::Connect(so)).value();
  const absl::Time until = absl::Now() + absl::Seconds(15);
  bool tightened = false, dropped = false;
  while ((!tightened || !dropped) && absl::Now() < until) {
    // ListRounds is a use of the session: poll slower than it goes cold.
    absl::SleepFor(absl::Milliseconds(700));
    stats = engine->Stats(key);
    tightened =
        stats.ok() && stats->policy.codec.codec == v1::CODEC_KIVI && stats->policy.codec.bits == 4;
    auto listed = client->ListRounds("p");
    // Round 1 goes; round 2 is the newest.
    dropped = listed.ok() && listed->rounds_size() >= 1 &&
              listed->rounds(listed->rounds_size() - 1).round() == 2;
    if (dropped) {
      for (const auto& r : listed->rounds()) dropped &= r.round() != 1;
    }
  }
  EXPECT_TRUE(tightened) << "the worker never applied the tightened policy";
  EXPECT_TRUE(dropped) << "the store never dropped round 1";
  EXPECT_EQ(stats->policy.watershed_layer, 1);  // Stored rounds stay split where they were.

  // GetPolicy says why, and the metrics count it.
  v1::GetPolicyRequest q;
  q.set_session_id("p");
  q.mutable_model()->set_name("tiny");
  q.set_idle_ms(1000);
  q.set_node_id("worker-p");
  auto answer = admin->GetPolicy(q);
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_TRUE(answer->tightened());
  EXPECT_EQ(answer->pressure(), v1::PRESSURE_HIGH);
  EXPECT_THAT(
      pc.controller->RenderMetrics(),
      ::testing::HasSubstr("kvtier_controller_node_pressure{kind=\"store\",node=\"store-p\"} 2"));

  // The session goes on, its new rounds 4-bit.
  ASSERT_TRUE(PrefillStep(pc.stub.get(), "p", 4, &rng).ok());
  ASSERT_TRUE(EndRound(pc.stub.get(), "p", &end).ok());
  EXPECT_EQ(end.round(), 3u);
}

// A workload that writes past the cluster's budget: one store with a 1 MiB
// disk budget (its capacity in the cluster), two sessions that go cold, and
// a pinned session that keeps writing. The store frees what it can (the
// cold sessions' rounds, never-recalled ones first) and answers
// RESOURCE_EXHAUSTED, as backpressure, only when nothing unpinned is left to
// drop; the controller saw the store at HIGH; no process dies, and the
// pinned session's acknowledged rounds are all there.
TEST(WorkerPressureTest, WritesPastTheBudgetAreRefusedOnlyWhenNothingCanBeFreed) {
  PressureCluster pc;
  const absl::Status started = pc.Start(0.80, 0.95, "store-b", "1", "worker-b", 0);
  ASSERT_TRUE(started.ok()) << started;
  StoreClientOptions so;
  so.target = pc.store->target();
  auto client = std::move(StoreClient::Connect(so)).value();
  auto open = [&](const std::string& id) {
    grpc::ClientContext c;
    v1::OpenSessionResponse r;
    return pc.stub->OpenSession(&c, OpenRequest(id), &r);
  };
  std::mt19937 rng(13);
  v1::EndRoundResponse end;
  // Two sessions write 4 rounds each (about 25 KB a round) and go cold.
  for (const char* id : {"cold-0", "cold-1"}) {
    ASSERT_TRUE(open(id).ok());
    for (int round = 0; round < 4; ++round) {
      ASSERT_TRUE(PrefillStep(pc.stub.get(), id, 256, &rng).ok());
      ASSERT_TRUE(EndRound(pc.stub.get(), id, &end).ok());
    }
  }
  // The pinned one writes until the store refuses.
  ASSERT_TRUE(open("pinned").ok());
  ASSERT_TRUE(PrefillStep(pc.stub.get(), "pinned", 256, &rng).ok());
  ASSERT_TRUE(EndRound(pc.stub.get(), "pinned", &end).ok());
  ASSERT_TRUE(client->PinSession("pinned", true).ok());
  int acknowledged = 1;
  uint64_t pinned_bytes = end.stored_bytes();
  const uint64_t round_bytes = end.stored_bytes();
  grpc::Status refused;
  for (int round = 1; round < 200 && refused.ok(); ++round) {
    ASSERT_TRUE(PrefillStep(pc.stub.get(), "pinned", 256, &rng).ok()) << "round " << round;
    refused = EndRound(pc.stub.get(), "pinned", &end);
    if (refused.ok()) {
      ++acknowledged;
      pinned_bytes += end.stored_bytes();
    }
  }
  ASSERT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_THAT(refused.error_message(), ::testing::HasSubstr("disk budget"));
  // Refused only when the pinned rounds alone leave no room for one more.
  EXPECT_LE(pinned_bytes, uint64_t{1} << 20);
  EXPECT_GT(pinned_bytes + round_bytes, uint64_t{1} << 20);
  // Nothing unpinned was left to drop, and the pinned rounds are all there.
  for (const char* id : {"cold-0", "cold-1"}) {
    auto listed = client->ListRounds(id);
    EXPECT_TRUE(!listed.ok() || listed->rounds_size() == 0) << id << " still holds rounds";
  }
  auto pinned = client->ListRounds("pinned");
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_EQ(pinned->rounds_size(), acknowledged);
  auto stats = client->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_GE(stats->drops(), 8u);
  // The controller saw the store at HIGH (every stored byte counts against
  // its budget).
  const absl::Time until = absl::Now() + absl::Seconds(5);
  const std::string high = "kvtier_controller_node_pressure{kind=\"store\",node=\"store-b\"} 2";
  while (!absl::StrContains(pc.controller->RenderMetrics(), high) && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_THAT(pc.controller->RenderMetrics(), ::testing::HasSubstr(high));
  // Both processes are alive and serve: the open round can still be closed.
  grpc::ClientContext c;
  v1::CloseSessionRequest close;
  close.set_session_id("pinned");
  v1::CloseSessionResponse closed;
  EXPECT_TRUE(pc.stub->CloseSession(&c, close, &closed).ok());
  EXPECT_TRUE(client->ListRounds("pinned").ok());
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

// Polls `pred` for up to 15 s.
bool Eventually(const std::function<bool()>& pred) {
  for (int i = 0; i < 150; ++i) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return pred();
}

// A worker is live while it runs and ready while its store answers: its gRPC
// health ("" and "kvtier.v1.Worker") and /readyz follow a SIGSTOPped store
// and its return; /healthz stays 200. The store serves its own name too.
TEST(WorkerHealthTest, ReadinessFollowsTheStore) {
  using ::testing::HasSubstr;
  testing::WorkerStackOptions o;
  o.metrics_listen = "127.0.0.1:0";
  o.store_probe_interval = absl::Milliseconds(300);
  testing::WorkerStack stack;
  ASSERT_THAT(stack.Start(o), IsOk());
  const int http = stack.server()->metrics_port();
  ASSERT_GT(http, 0);
  auto ready = [&] { return absl::StrContains(testing::HttpGet(http, "/readyz"), " 200 OK"); };
  ASSERT_TRUE(Eventually(ready)) << testing::HttpGet(http, "/readyz");
  EXPECT_EQ(testing::GrpcHealthStatus(stack.channel(), ""), 1);
  EXPECT_EQ(testing::GrpcHealthStatus(stack.channel(), "kvtier.v1.Worker"), 1);
  EXPECT_THAT(testing::HttpGet(http, "/healthz"), HasSubstr("\r\n\r\nok\n"));
  EXPECT_THAT(testing::HttpGet(http, "/metrics"), HasSubstr("kvtier_worker_"));
  auto store_channel =
      grpc::CreateChannel(stack.store()->target(), grpc::InsecureChannelCredentials());
  EXPECT_EQ(testing::GrpcHealthStatus(store_channel, "kvtier.v1.Store"), 1);

  stack.store()->Pause();
  ASSERT_TRUE(Eventually([&] { return !ready(); }));
  const std::string body = testing::HttpGet(http, "/readyz");
  EXPECT_THAT(body, HasSubstr(" 503 "));
  EXPECT_THAT(body, HasSubstr("does not answer"));
  EXPECT_THAT(body, HasSubstr(stack.store()->target()));
  EXPECT_EQ(testing::GrpcHealthStatus(stack.channel(), ""), 2);
  EXPECT_EQ(testing::GrpcHealthStatus(stack.channel(), "kvtier.v1.Worker"), 2);
  EXPECT_THAT(testing::HttpGet(http, "/healthz"), HasSubstr(" 200 OK"));

  stack.store()->Resume();
  ASSERT_TRUE(Eventually(ready));
  EXPECT_EQ(testing::GrpcHealthStatus(stack.channel(), "kvtier.v1.Worker"), 1);
}

}  // namespace
// Rounds record the identity of the model that made them: a worker never
// resumes a session from rounds of another model of the same shape.
TEST(WorkerResumeTest, RoundsOfAnotherModelAreNeverResumed) {
  testing::TempDir dir;
  testing::StoreProcess store(dir.path() + "/db");
  ASSERT_TRUE(store.Start().ok());
  WorkerServerOptions wo;
  wo.listen = "127.0.0.1:0";
  wo.metrics_listen = "";
  wo.store.target = store.target();
  auto a = std::move(WorkerServer::Start(wo)).value();
  auto b = std::move(WorkerServer::Start(wo)).value();
  auto stub_for = [](WorkerServer& w) {
    return v1::Worker::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", w.port()),
                                                   grpc::InsecureChannelCredentials()));
  };
  auto sa = stub_for(*a), sb = stub_for(*b);
  auto open = [](v1::Worker::Stub* stub, bool resume, uint64_t model, v1::OpenSessionResponse* r) {
    v1::OpenSessionRequest req = OpenRequest("m");
    req.set_resume(resume);
    req.mutable_model()->set_model_digest(model);
    grpc::ClientContext c;
    return stub->OpenSession(&c, req, r);
  };
  v1::OpenSessionResponse r;
  ASSERT_TRUE(open(sa.get(), false, 0x1111, &r).ok());
  std::mt19937 rng(5);
  v1::EndRoundResponse end;
  for (int round = 0; round < 2; ++round) {
    ASSERT_TRUE(PrefillStep(sa.get(), "m", 5, &rng).ok());
    ASSERT_TRUE(EndRound(sa.get(), "m", &end).ok());
  }
  const grpc::Status other = open(sb.get(), true, 0x2222, &r);
  EXPECT_EQ(other.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(other.error_message(), ::testing::HasSubstr("holds K/V of model 0000000000001111"));
  EXPECT_THAT(other.error_message(),
              ::testing::HasSubstr("this session's model is 0000000000002222"));
  ASSERT_TRUE(open(sb.get(), true, 0x1111, &r).ok());
  EXPECT_EQ(r.next_round(), 2u);
}

}  // namespace kvtier
