// What the worker service tests share: a small model (3 layers, 4 query and
// 2 KV heads of 8), its session request, dense tensors, one whole prefill
// step and EndRound over a stub, the fixture of a worker over a real
// kvtier-store process, identity skews, and the retry loops for moments the
// worker finishes a call on its own threads.
#ifndef KVTIER_TESTS_UTIL_WORKER_RPC_H_
#define KVTIER_TESTS_UTIL_WORKER_RPC_H_

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/speculation.h"
#include "kvtier/v1/worker.grpc.pb.h"
#include "tests/util/status_matchers.h"
#include "tests/util/worker_stack.h"

namespace kvtier::testing {

constexpr int kLayers = 3, kQHeads = 4, kKvHeads = 2, kDim = 8;

inline v1::DenseTensor Dense(const std::vector<float>& x, int64_t tokens, int heads) {
  v1::DenseTensor t;
  t.set_dtype(v1::DTYPE_FP32);
  t.add_shape(tokens);
  t.add_shape(heads);
  t.add_shape(kDim);
  t.set_data(reinterpret_cast<const char*>(x.data()), x.size() * 4);
  return t;
}

inline std::vector<float> Floats(const v1::DenseTensor& t) {
  std::vector<float> x(t.data().size() / 4);
  std::memcpy(x.data(), t.data().data(), t.data().size());
  return x;
}

// The tests' session: the small model above, L_w = 1, recall "all".
inline v1::OpenSessionRequest OpenRequest(const std::string& id) {
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

  WorkerStack stack_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

// An identity skew (A = I, the first r columns) for a model of this shape.
inline std::string IdentitySkew(int layers, int q_heads, int kv_heads, int d, int r) {
  return spec::SerializeSkew(spec::IdentitySkew(layers, q_heads, kv_heads, d, r));
}

// PutSkew in slices: OK and the id; a slice past 1 MiB, a file that is not
// a skew, and a skew for another model get precise statuses.
inline absl::StatusOr<v1::PutSkewResponse> PutSkew(v1::Worker::Stub* stub, const std::string& bytes,
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

// Sends the first `layers` layers of a 2-token prefill of `id` on `s`, each
// answered; false when the stream broke.
inline bool SendPrefillLayers(grpc::ClientReaderWriter<v1::LayerRequest, v1::LayerResponse>* s,
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
    // Timed: the worker finishes an abandoned call on its own threads; no hook reaches them.
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
    // Timed: a resumed store process serves its backlog first (a real process).
    absl::SleepFor(absl::Milliseconds(20));
    st = f();
  }
  return st;
}

// Runs one whole prefill step of n tokens for `id` over `stub`, returning
// the stream's final status.
inline grpc::Status PrefillStep(v1::Worker::Stub* stub, const std::string& id, int64_t n,
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

inline grpc::Status EndRound(v1::Worker::Stub* stub, const std::string& id,
                             v1::EndRoundResponse* resp,
                             absl::Duration deadline = absl::Seconds(30),
                             const std::string& token = "") {
  grpc::ClientContext c;
  c.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  if (!token.empty()) c.AddMetadata("authorization", "Bearer " + token);
  v1::EndRoundRequest r;
  r.set_session_id(id);
  return stub->EndRound(&c, r, resp);
}

// Polls `pred` for up to 15 s.
inline bool Eventually(const std::function<bool()>& pred) {
  for (int i = 0; i < 150; ++i) {
    if (pred()) return true;
    // Timed: polls real processes (a stopped and resumed store, HTTP probes).
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return pred();
}

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_UTIL_WORKER_RPC_H_
