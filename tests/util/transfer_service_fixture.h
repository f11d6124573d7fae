// The gRPC harness of the hand-off tests: kvtier-worker servers (in process
// and as processes) over one real kvtier-store, and one prefill or decode
// step driven through a Worker stub layer by layer.
#ifndef KVTIER_TESTS_UTIL_TRANSFER_SERVICE_FIXTURE_H_
#define KVTIER_TESTS_UTIL_TRANSFER_SERVICE_FIXTURE_H_

#include <sys/types.h>
#include <sys/wait.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "encoded/encode.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "kvtier/v1/worker.grpc.pb.h"
#include "services/worker/worker_server.h"
#include "testing/store_process.h"
#include "testing/test_util.h"
#include "tests/util/status_matchers.h"
#include "tests/util/transfer_steps.h"
#include "tests/util/worker_stack.h"

namespace kvtier::testing {

inline v1::DenseTensor Dense(const std::vector<float>& x, int64_t tokens, int heads) {
  v1::DenseTensor t;
  t.set_dtype(v1::DTYPE_FP32);
  t.add_shape(tokens);
  t.add_shape(heads);
  t.add_shape(kShape.head_dim);
  t.set_data(reinterpret_cast<const char*>(x.data()), x.size() * 4);
  return t;
}

inline void AppendFloats(const v1::DenseTensor& t, std::vector<float>* out) {
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
inline PrefillResult Prefill(v1::Worker::Stub* stub, const std::string& id, const Step& step,
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

inline std::vector<float> Decode(v1::Worker::Stub* stub, const std::string& id, const Step& step) {
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
    m->set_dtype(ToProto(kShape.dtype));
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
  // `port` is empty when it did not start within 60 s (a loaded 2-core
  // machine starts it in well under that) or exited first; then *why holds
  // its exit and the tail of its log.
  pid_t SpawnWorker(const std::string& dir, std::string* port, std::string* why) {
    const std::string port_file = dir + "/port";
    const pid_t pid = SpawnLogged(
        {KVTIER_WORKER_BINARY_PATH, "--listen=127.0.0.1:0", "--port_file=" + port_file,
         "--metrics_listen=", "--placement=host", "--store=" + stack_.store()->target()},
        dir + "/worker.log");
    const absl::Time until = absl::Now() + absl::Seconds(60);
    int status = 0;
    bool exited = false;
    while (pid > 0 && port->empty() && !exited && absl::Now() < until) {
      // Timed: a kvtier-worker process writes its port file once started.
      absl::SleepFor(absl::Milliseconds(20));
      std::ifstream in(port_file);
      std::getline(in, *port);
      exited = port->empty() && waitpid(pid, &status, WNOHANG) == pid;
    }
    if (port->empty()) {
      std::ifstream log(dir + "/worker.log");
      std::string line, tail;
      while (std::getline(log, line)) tail = tail.size() > 4000 ? line : tail + line + "\n";
      *why = absl::StrCat(exited ? absl::StrCat("exited with status ", status) : "no port in 60 s",
                          "; its log:\n", tail);
    }
    return pid;
  }

  StoreStack stack_;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_UTIL_TRANSFER_SERVICE_FIXTURE_H_
