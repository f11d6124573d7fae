// kvtier-hop-bench: the cost of one per-layer hop to kvtier-worker, against
// two baselines measured in the same run:
//  - the floor: a bare gRPC bidi ping-pong on loopback with the same message
//    sizes (the demo's 6 KiB of fp32 q/k/v out, 4 KiB of o back), served by
//    a callback-API echo in this process;
//  - the in-process full cache: the same worker::Engine decode steps called
//    directly, without gRPC.
// The worker runs in this process on 127.0.0.1 (port 0), and its sessions
// are prefilled with --context tokens. Each kvtier row drives one long-lived
// Decode stream with every session's item for a layer in one DecodeRequest;
// the "stream per token" row is the old engine client (a new stream per
// token, one item per request), kept for comparison.
//
// --dtype=fp16: the model's K/V dtype and the wire's q/k/v are fp16 (the
// floor's messages halve with them); the in-process rows send fp32 either
// way.
//
//   kvtier-hop-bench [--hops=N] [--context=T] [--sessions=1,8,32] [--dtype=fp32|fp16]
//                    [--csv=FILE]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/server_builder.h"
#include "kernels/half.h"
#include "rpc/raw_call.h"
#include "rpc/wire_format.h"
#include "services/worker/worker_server.h"

namespace kvtier {
namespace {

// The demo's synthetic model (traces/synthetic_chat.h).
constexpr int kLayers = 32, kQHeads = 8, kKvHeads = 2, kDim = 128;

using Clock = std::chrono::steady_clock;
double UsSince(Clock::time_point t) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t).count();
}

// The floor's server: echoes a fixed reply to every message of a bidi stream.
class Echo : public grpc::CallbackGenericService {
 public:
  explicit Echo(size_t reply_bytes) : reply_(std::string(reply_bytes, 'o')) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    class R : public grpc::ServerGenericBidiReactor {
     public:
      explicit R(const std::string& reply) {
        grpc::Slice s(reply);
        reply_ = grpc::ByteBuffer(&s, 1);
        StartRead(&in_);
      }
      void OnReadDone(bool ok) override {
        if (!ok) {
          Finish(grpc::Status::OK);
          return;
        }
        StartWrite(&reply_);
      }
      void OnWriteDone(bool ok) override {
        if (!ok) {
          Finish(grpc::Status::CANCELLED);
          return;
        }
        StartRead(&in_);
      }
      void OnDone() override { delete this; }

     private:
      grpc::ByteBuffer in_, reply_;
    };
    return new R(reply_);
  }

 private:
  std::string reply_;
};

grpc::ByteBuffer Bytes(size_t n) {
  grpc::Slice s(std::string(n, 'q'));
  return grpc::ByteBuffer(&s, 1);
}

// One token's rows of `heads` heads, random, in fp32 or fp16.
v1::DenseTensor Dense(int heads, bool fp16, std::mt19937* rng) {
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<size_t>(heads) * kDim);
  for (float& v : x) v = nd(*rng);
  v1::DenseTensor t;
  t.add_shape(1);
  t.add_shape(heads);
  t.add_shape(kDim);
  if (fp16) {
    std::vector<uint16_t> h(x.size());
    for (size_t i = 0; i < x.size(); ++i) h[i] = FloatToHalf(x[i]);
    t.set_dtype(v1::DTYPE_FP16);
    t.set_data(reinterpret_cast<const char*>(h.data()), h.size() * 2);
  } else {
    t.set_dtype(v1::DTYPE_FP32);
    t.set_data(reinterpret_cast<const char*>(x.data()), x.size() * 4);
  }
  return t;
}

struct Row {
  std::string name;
  int sessions = 1;
  double hop_us = 0;  // One request/response round trip (all its items).
  double tokens_per_s = 0;
  std::string ratio;  // Against its baseline, said in words.
};

class Bench {
 public:
  absl::Status Start(int context, bool fp16) {
    fp16_ = fp16;
    WorkerServerOptions o;
    o.listen = "127.0.0.1:0";
    o.metrics_listen = "";
    // Decode never reaches the store; the target only has to parse.
    o.store.target = "127.0.0.1:1";
    o.engine.placement = worker::EngineOptions::Placement::kHost;
    auto s = WorkerServer::Start(o);
    if (!s.ok()) return s.status();
    worker_ = std::move(*s);
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", worker_->port()),
                                   grpc::InsecureChannelCredentials());
    context_ = context;
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    echo_ = std::make_unique<Echo>(kQHeads * kDim * ElementBytes());
    b.RegisterCallbackGenericService(echo_.get());
    echo_server_ = b.BuildAndStart();
    if (echo_server_ == nullptr) return absl::UnavailableError("echo server did not start");
    echo_channel_ =
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
    return absl::OkStatus();
  }

  // Opens `n` sessions named prefix0.. and prefills `context_` tokens each,
  // directly in the engine (setup, not measured).
  absl::Status Sessions(const std::string& prefix, int n) {
    worker::ModelShape shape{kLayers, kQHeads, kKvHeads, kDim, fp16_ ? DType::kFp16 : DType::kFp32};
    std::mt19937 rng(7);
    std::normal_distribution<float> nd;
    std::vector<float> q(static_cast<size_t>(context_) * kQHeads * kDim),
        kv(static_cast<size_t>(context_) * kKvHeads * kDim), out(q.size());
    for (float& x : q) x = nd(rng);
    for (float& x : kv) x = nd(rng);
    for (int i = 0; i < n; ++i) {
      const std::string id = absl::StrCat(prefix, i);
      if (absl::Status s = worker_->engine()->OpenSession(id, shape, {}); !s.ok()) return s;
      for (int l = 0; l < kLayers; ++l) {
        auto r = worker_->engine()->PrefillLayer(id, l, context_, 0, q.data(), kv.data(), kv.data(),
                                                 out.data());
        if (!r.ok()) return r.status();
      }
      // One decode token, untimed: the open round's buffers grow on the
      // first one (a reallocation of every layer), which no row should pay.
      for (int l = 0; l < kLayers; ++l) {
        absl::Status s =
            worker_->engine()->DecodeLayer(id, l, q.data(), kv.data(), kv.data(), out.data());
        if (!s.ok()) return s;
      }
    }
    return absl::OkStatus();
  }

  void Close(const std::string& prefix, int n) {
    for (int i = 0; i < n; ++i) {
      // No store call: the sessions have no resident recalls to report.
      worker_->engine()->CloseSession(absl::StrCat(prefix, i), false).IgnoreError();
    }
  }

  Row Floor(int hops) {
    grpc::ClientContext ctx;
    RawCall call(echo_channel_, &ctx, "/bench.Echo/PingPong");
    const grpc::ByteBuffer out = Bytes((kQHeads + 2 * kKvHeads) * kDim * ElementBytes());
    grpc::ByteBuffer in;
    for (int i = 0; i < hops / 10; ++i) call.Write(out), call.Read(&in);  // Warm-up.
    const auto t0 = Clock::now();
    for (int i = 0; i < hops; ++i) {
      if (!call.Write(out) || !call.Read(&in)) break;
    }
    const double us = UsSince(t0) / hops;
    call.WritesDone();
    call.Finish().ok();
    return {fp16_ ? "gRPC ping-pong floor (3 KiB out, 2 KiB back)"
                  : "gRPC ping-pong floor (6 KiB out, 4 KiB back)",
            1, us, 0, "1.00x (baseline)"};
  }

  // `hops` requests over one stream, each with one item per session for the
  // next layer. new_stream_per_token: the old client's shape instead.
  absl::StatusOr<Row> Kvtier(const std::string& prefix, int sessions, int hops,
                             bool new_stream_per_token) {
    std::mt19937 rng(11);
    std::vector<grpc::ByteBuffer> per_layer(kLayers);
    for (int l = 0; l < kLayers; ++l) {
      v1::DecodeRequest req;
      for (int i = 0; i < sessions; ++i) {
        auto* item = req.add_items();
        item->set_session_id(absl::StrCat(prefix, i));
        item->set_layer(l);
        *item->mutable_q() = Dense(kQHeads, fp16_, &rng);
        *item->mutable_k() = Dense(kKvHeads, fp16_, &rng);
        *item->mutable_v() = Dense(kKvHeads, fp16_, &rng);
      }
      per_layer[l] = wire::Serialize(req);
    }
    hops = (hops + kLayers - 1) / kLayers * kLayers;  // Whole tokens.
    std::unique_ptr<grpc::ClientContext> ctx;
    std::unique_ptr<RawCall> call;
    grpc::ByteBuffer in;
    v1::DecodeResponse resp;
    const auto t0 = Clock::now();
    for (int h = 0; h < hops; ++h) {
      const int l = h % kLayers;
      if (call == nullptr || (new_stream_per_token && l == 0)) {
        if (call != nullptr) {
          call->WritesDone();
          if (grpc::Status s = call->Finish(); !s.ok()) {
            return absl::InternalError(absl::StrCat("Decode: ", s.error_message()));
          }
        }
        call.reset();
        ctx = std::make_unique<grpc::ClientContext>();
        call = std::make_unique<RawCall>(channel_, ctx.get(), "/kvtier.v1.Worker/Decode");
      }
      if (!call->Write(per_layer[l]) || !call->Read(&in)) {
        grpc::Status s = call->Finish();
        return absl::InternalError(absl::StrCat("Decode hop failed: ", s.error_message()));
      }
      if (h == 0) {
        if (absl::Status p = wire::Parse(in, &resp); !p.ok()) return p;
        if (resp.o_size() != sessions) return absl::InternalError("short DecodeResponse");
      }
    }
    const double total_us = UsSince(t0);
    call->WritesDone();
    call->Finish().ok();
    Row r;
    r.sessions = sessions;
    r.hop_us = total_us / hops;
    r.tokens_per_s = static_cast<double>(hops / kLayers) * sessions / (total_us * 1e-6);
    return r;
  }

  // The same steps in process: worker::Engine::DecodeLayer, session after
  // session, one thread.
  absl::StatusOr<Row> InProcess(const std::string& prefix, int sessions, int hops) {
    std::mt19937 rng(13);
    std::normal_distribution<float> nd;
    std::vector<float> q(kQHeads * kDim), k(kKvHeads * kDim), v(k.size()), out(q.size());
    for (float& x : q) x = nd(rng);
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    hops = (hops + kLayers - 1) / kLayers * kLayers;
    const auto t0 = Clock::now();
    for (int h = 0; h < hops; ++h) {
      for (int i = 0; i < sessions; ++i) {
        absl::Status s = worker_->engine()->DecodeLayer(absl::StrCat(prefix, i), h % kLayers,
                                                        q.data(), k.data(), v.data(), out.data());
        if (!s.ok()) return s;
      }
    }
    const double total_us = UsSince(t0);
    Row r;
    r.sessions = sessions;
    r.hop_us = total_us / hops;
    r.tokens_per_s = static_cast<double>(hops / kLayers) * sessions / (total_us * 1e-6);
    return r;
  }

 private:
  int ElementBytes() const { return fp16_ ? 2 : 4; }

  bool fp16_ = false;
  std::unique_ptr<WorkerServer> worker_;
  std::shared_ptr<grpc::Channel> channel_, echo_channel_;
  std::unique_ptr<Echo> echo_;
  std::unique_ptr<grpc::Server> echo_server_;
  int context_ = 0;
};

int Main(int argc, char** argv) {
  int hops = 3200, context = 256;
  std::vector<int> sizes = {1, 8, 32};
  std::string csv;
  bool fp16 = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      const std::string f = absl::StrCat("--", flag, "=");
      return a.rfind(f, 0) == 0 ? argv[i] + f.size() : nullptr;
    };
    if (const char* v = value("hops"); v && absl::SimpleAtoi(v, &hops) && hops > 0) continue;
    if (const char* v = value("context"); v && absl::SimpleAtoi(v, &context) && context > 0) {
      continue;
    }
    if (const char* v = value("dtype");
        v && (std::string(v) == "fp16" || std::string(v) == "fp32")) {
      fp16 = std::string(v) == "fp16";
      continue;
    }
    if (const char* v = value("csv")) {
      csv = v;
      continue;
    }
    if (const char* v = value("sessions")) {
      sizes.clear();
      for (absl::string_view p : absl::StrSplit(v, ',')) {
        int n = 0;
        if (!absl::SimpleAtoi(p, &n) || n < 1) {
          std::fprintf(stderr, "kvtier-hop-bench: bad --sessions\n");
          return 2;
        }
        sizes.push_back(n);
      }
      continue;
    }
    std::fprintf(stderr,
                 "usage: kvtier-hop-bench [--hops=N] [--context=T] [--sessions=1,8,32] "
                 "[--dtype=fp32|fp16] [--csv=FILE]\n");
    return a == "--help" ? 0 : 2;
  }
  Bench b;
  if (absl::Status s = b.Start(context, fp16); !s.ok()) {
    std::fprintf(stderr, "kvtier-hop-bench: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf(
      "kvtier-hop-bench: %d layers, %d q / %d kv heads, d=%d, %s model and wire, "
      "%d tokens of context per session, %d hops per row\n",
      kLayers, kQHeads, kKvHeads, kDim, fp16 ? "fp16" : "fp32", context, hops);
  std::vector<Row> rows;
  const Row floor = b.Floor(hops);
  rows.push_back(floor);
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "kvtier-hop-bench: %s\n", s.ToString().c_str());
    return 1;
  };
  // Every row gets its own freshly prefilled sessions.
  int row_id = 0;
  auto measure = [&](int n, auto&& body) -> absl::StatusOr<Row> {
    const std::string prefix = absl::StrCat("r", row_id++, "-");
    KVT_RETURN_IF_ERROR(b.Sessions(prefix, n));
    absl::StatusOr<Row> r = body(prefix);
    b.Close(prefix, n);
    return r;
  };
  for (int n : sizes) {
    std::fprintf(stderr, "kvtier-hop-bench: %d session(s)...\n", n);
    const int row_hops = std::max(kLayers, hops / n);
    auto inproc = measure(n, [&](const std::string& p) { return b.InProcess(p, n, row_hops); });
    if (!inproc.ok()) return fail(inproc.status());
    inproc->name = absl::StrCat("in-process engine, ", n, " session(s)");
    inproc->ratio = "1.00x (baseline)";
    auto hop = measure(n, [&](const std::string& p) { return b.Kvtier(p, n, row_hops, false); });
    if (!hop.ok()) return fail(hop.status());
    hop->name = absl::StrCat("kvtier-worker, ", n, " session(s), one stream, batched");
    hop->ratio =
        absl::StrFormat("%.2fx in-process tokens/s", hop->tokens_per_s / inproc->tokens_per_s);
    rows.push_back(*inproc);
    if (n == 1) {
      // The hop's own cost: what it adds to the same attention in process.
      hop->ratio += absl::StrFormat("; hop %.2fx the floor, %.2fx without the attention",
                                    hop->hop_us / floor.hop_us,
                                    (hop->hop_us - inproc->hop_us) / floor.hop_us);
      auto old = measure(n, [&](const std::string& p) { return b.Kvtier(p, n, row_hops, true); });
      if (!old.ok()) return fail(old.status());
      old->name = "kvtier-worker, 1 session, new stream per token (old client)";
      old->ratio = absl::StrFormat("hop %.2fx the floor, %.2fx without the attention",
                                   old->hop_us / floor.hop_us,
                                   (old->hop_us - inproc->hop_us) / floor.hop_us);
      rows.push_back(*old);
    }
    rows.push_back(*hop);
  }
  std::printf("\n%-62s %8s %10s %12s  %s\n", "case", "sessions", "hop_us", "tokens/s", "ratio");
  for (const Row& r : rows) {
    std::printf("%-62s %8d %10.1f %12s  %s\n", r.name.c_str(), r.sessions, r.hop_us,
                r.tokens_per_s > 0 ? absl::StrFormat("%.0f", r.tokens_per_s).c_str() : "-",
                r.ratio.c_str());
  }
  if (!csv.empty()) {
    std::ofstream f(csv);
    f << "case,sessions,hop_us,tokens_per_s,ratio\n";
    for (const Row& r : rows) {
      f << '"' << r.name << "\"," << r.sessions << ',' << r.hop_us << ',' << r.tokens_per_s << ",\""
        << r.ratio << "\"\n";
    }
  }
  return 0;
}

}  // namespace
}  // namespace kvtier

int main(int argc, char** argv) { return kvtier::Main(argc, argv); }
