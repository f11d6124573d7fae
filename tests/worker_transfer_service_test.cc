// The hand-off between two kvtier-worker processes over gRPC (TransferSession)
// against a real kvtier-store: prefill on one worker and decode on another
// answer as one worker does; a failed, stalled, corrupt or unfinished
// hand-off undoes its step or is refused; TLS between workers; device rounds
// only to an accepted sender device.
#include <signal.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>

#include "absl/strings/str_cat.h"
#include "client/session_router.h"
#include "encoded/encode.h"
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
#include "tests/util/transfer_service_fixture.h"
#include "tests/util/transfer_steps.h"
#include "tests/util/worker_stack.h"
#include "worker/engine.h"
#include "worker/transfer.h"

namespace kvtier {
namespace {
using ::kvtier::testing::Decode;
using ::kvtier::testing::Dense;
using ::kvtier::testing::Handoff;
using ::kvtier::testing::IsOk;
using ::kvtier::testing::kShape;
using ::kvtier::testing::MakeStep;
using ::kvtier::testing::Prefill;
using ::kvtier::testing::PrefillResult;
using ::kvtier::testing::RunStep;
using ::kvtier::testing::Same;
using ::kvtier::testing::Step;
using ::kvtier::testing::TransferServiceTest;
using worker::Engine;
using worker::SessionPolicy;

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
  for (int i = 0; i < 1000 && p->engine()->Stats("s")->tokens != 0; ++i) {
    // Timed: the receiver rolls the cancelled step back on its own threads.
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(p->engine()->Stats("s")->tokens, 0u);
  for (int i = 0; i < 1000 && d->engine()->totals().sessions != 0; ++i) {
    // Timed: as above, for the session the decode worker drops.
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(d->engine()->totals().sessions, 0);
  {
    // A real kvtier-worker process, killed (-9) half way through the step.
    testing::TempDir dir;
    std::string port, why;
    const pid_t pid = SpawnWorker(dir.path(), &port, &why);
    ASSERT_GT(pid, 0);
    ASSERT_FALSE(port.empty()) << "kvtier-worker did not start: " << why;
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
    // Timed: the kernel stops the process (SIGSTOP) when it gets to it.
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

// A receiver that accepts connections and never answers (SIGSTOP). Before
// any connection, gRPC gives up on the handshake: UNAVAILABLE (or, under
// load, the deadline comes first). On a connection already up, the hand-off runs out of its
// deadline (the prefill worker's store deadline when the Prefill call has none): DEADLINE_EXCEEDED.
// Either way the step is undone.
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
    std::string port, why;
    const pid_t pid = SpawnWorker(dir.path(), &port, &why);
    ASSERT_GT(pid, 0);
    ASSERT_FALSE(port.empty()) << "kvtier-worker did not start: " << why;
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
