#include "services/worker/worker_server.h"

#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server_builder.h"
#include "kernels/half.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "services/common/grpc_status.h"
#include "services/common/metrics_exposer.h"
#include "services/common/server_credentials.h"

namespace kvtier {

absl::StatusOr<worker::ModelShape> ShapeFromProto(const v1::ModelSpec& m) {
  worker::ModelShape s;
  s.layers = static_cast<int>(m.num_layers());
  s.q_heads = static_cast<int>(m.num_q_heads());
  s.kv_heads = static_cast<int>(m.num_kv_heads());
  s.head_dim = static_cast<int>(m.head_dim());
  switch (m.dtype()) {
    case v1::DTYPE_FP32:
      s.dtype_bytes = 4;
      break;
    case v1::DTYPE_FP16:
    case v1::DTYPE_BF16:
      s.dtype_bytes = 2;
      break;
    default:
      return absl::InvalidArgumentError("ModelSpec.dtype must be fp16, bf16 or fp32");
  }
  if (s.layers < 1 || s.layers > 1024 || s.q_heads < 1 || s.q_heads > 1024 || s.kv_heads < 1 ||
      s.q_heads % s.kv_heads != 0 || s.head_dim < 1 || s.head_dim > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad ModelSpec: layers ", s.layers, ", q_heads ", s.q_heads, ", kv_heads ",
                     s.kv_heads, " (must divide q_heads), head_dim ", s.head_dim));
  }
  return s;
}

absl::StatusOr<worker::SessionPolicy> PolicyFromProto(const v1::Policy& p, v1::DType model_dtype) {
  worker::SessionPolicy s;
  const v1::CodecParams& cp = p.codec_params();
  switch (p.codec()) {
    case v1::CODEC_UNSPECIFIED:
    case v1::CODEC_RAW:
      // Lossless for the model: its own dtype.
      s.codec = worker::SessionPolicy::RawFp32Codec();
      if (model_dtype == v1::DTYPE_FP16 || model_dtype == v1::DTYPE_BF16) {
        s.codec.dtype = model_dtype;
      }
      break;
    case v1::CODEC_KIVI:
    case v1::CODEC_KCVT:
    case v1::CODEC_GEAR:
    case v1::CODEC_GEAR_L: {
      CodecConfig c;
      c.codec = p.codec();
      c.bits = cp.bits() != 0
                   ? static_cast<int>(cp.bits())
                   : (p.codec() == v1::CODEC_GEAR || p.codec() == v1::CODEC_GEAR_L ? 2 : 4);
      if (cp.group_size() != 0) c.group_size = static_cast<int>(cp.group_size());
      c.residual_tokens = static_cast<int>(cp.residual_tokens());
      if (cp.rank() != 0) c.rank = static_cast<int>(cp.rank());
      if (cp.outlier_fraction() != 0) c.outlier_fraction = cp.outlier_fraction();
      if (cp.backbone() != v1::CODEC_UNSPECIFIED) c.backbone = cp.backbone();
      s.codec = c;
      break;
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown codec ", p.codec()));
  }
  KVT_RETURN_IF_ERROR(ValidateCodecConfig(s.codec));
  if (!p.eviction().empty() && p.eviction() != "none" && p.budget_tokens() != 0) {
    std::string name = p.eviction() == "streamingllm" ? "streaming" : p.eviction();
    std::string text = absl::StrCat(name, ":", p.budget_tokens());
    if (p.window() != 0) absl::StrAppend(&text, ":w=", p.window());
    if (p.pool_kernel() != 0) absl::StrAppend(&text, ":k=", p.pool_kernel());
    if (p.ada_alpha() != 0) absl::StrAppend(&text, ":alpha=", p.ada_alpha());
    if (p.pyramid_beta() != 0) absl::StrAppend(&text, ":beta=", p.pyramid_beta());
    KVT_ASSIGN_OR_RETURN(s.eviction, evict::ParsePolicy(text));
  }
  // 0 is proto3's unset: the engine's default, L / 3.
  s.watershed_layer = p.watershed_layer() == 0 ? -1 : static_cast<int>(p.watershed_layer());
  if (!p.recall().empty()) {
    KVT_ASSIGN_OR_RETURN(s.recall, worker::ParseRecall(p.recall()));
  }
  // proto3 cannot tell false from unset; the published default (true) wins.
  s.keep_recent_round = true;
  s.release_after_end_round = p.release_after_end_round();
  return s;
}

// Prometheus metrics of the worker.
class WorkerMetrics {
 public:
  WorkerMetrics()
      : registry_(std::make_shared<prometheus::Registry>()),
        working_set_(prometheus::BuildGauge()
                         .Name("kvtier_worker_working_set_bytes")
                         .Help("Working-set bytes over all sessions")
                         .Register(*registry_)
                         .Add({})),
        recalls_(prometheus::BuildCounter()
                     .Name("kvtier_worker_recalls_total")
                     .Help("Round recalls at the watershed layer")
                     .Register(*registry_)
                     .Add({})),
        selected_(prometheus::BuildCounter()
                      .Name("kvtier_worker_recall_rounds_selected_total")
                      .Help("Past rounds selected by recall")
                      .Register(*registry_)
                      .Add({})),
        candidates_(prometheus::BuildCounter()
                        .Name("kvtier_worker_recall_rounds_candidate_total")
                        .Help("Past rounds recall chose from")
                        .Register(*registry_)
                        .Add({})),
        fetched_(prometheus::BuildCounter()
                     .Name("kvtier_worker_bytes_fetched_total")
                     .Help("Payload bytes fetched from kvtier-store by recall")
                     .Register(*registry_)
                     .Add({})),
        stored_(prometheus::BuildCounter()
                    .Name("kvtier_worker_bytes_stored_total")
                    .Help("Payload bytes written to kvtier-store at EndRound")
                    .Register(*registry_)
                    .Add({})),
        layer_latency_(&prometheus::BuildHistogram()
                            .Name("kvtier_worker_layer_seconds")
                            .Help("Per-layer attention latency")
                            .Register(*registry_)),
        requests_(&prometheus::BuildCounter()
                       .Name("kvtier_worker_requests_total")
                       .Help("RPCs by method and outcome")
                       .Register(*registry_)) {}

  absl::StatusOr<int> Serve(const std::string& address) {
    KVT_ASSIGN_OR_RETURN(endpoint_, ServeMetrics(address, {registry_}));
    return endpoint_.port;
  }
  void Layer(const char* kind, double seconds) {
    static const prometheus::Histogram::BucketBoundaries kBuckets = {
        0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5};
    layer_latency_->Add({{"kind", kind}}, kBuckets).Observe(seconds);
  }
  void Request(const char* method, bool ok) {
    requests_->Add({{"method", method}, {"outcome", ok ? "ok" : "error"}}).Increment();
  }
  void Recall(const worker::RecallReport& r, bool completed) {
    if (completed) {
      fetched_.Increment(static_cast<double>(r.bytes_fetched));
      return;
    }
    recalls_.Increment();
    selected_.Increment(static_cast<double>(r.selected.size()));
    candidates_.Increment(static_cast<double>(r.scores.size()));
  }
  void Stored(uint64_t bytes) { stored_.Increment(static_cast<double>(bytes)); }
  void WorkingSet(double bytes) { working_set_.Set(bytes); }
  std::string Render() const {
    return prometheus::TextSerializer().Serialize(registry_->Collect());
  }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Gauge& working_set_;
  prometheus::Counter &recalls_, &selected_, &candidates_, &fetched_, &stored_;
  prometheus::Family<prometheus::Histogram>* layer_latency_;
  prometheus::Family<prometheus::Counter>* requests_;
  MetricsEndpoint endpoint_;
};

namespace {

// DenseTensor [tokens, heads, d] of fp32/fp16/bf16 to fp32.
absl::Status ReadDense(const v1::DenseTensor& t, int64_t tokens, int heads, int d, const char* what,
                       std::vector<float>* out) {
  if (t.shape_size() != 3 || t.shape(0) != tokens || t.shape(1) != heads || t.shape(2) != d) {
    std::string got;
    for (int64_t s : t.shape()) absl::StrAppend(&got, got.empty() ? "" : ",", s);
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has shape [", got, "], expected [", tokens, ",", heads, ",", d, "]"));
  }
  const int64_t n = tokens * heads * d;
  const size_t es = t.dtype() == v1::DTYPE_FP32 ? 4 : 2;
  if (t.dtype() != v1::DTYPE_FP32 && t.dtype() != v1::DTYPE_FP16 && t.dtype() != v1::DTYPE_BF16) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": dtype must be fp32, fp16 or bf16"));
  }
  if (t.data().size() != n * es) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " holds ", t.data().size(), " bytes, expected ", n * es));
  }
  out->resize(n);
  const char* p = t.data().data();
  if (t.dtype() == v1::DTYPE_FP32) {
    std::memcpy(out->data(), p, n * 4);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      (*out)[i] = t.dtype() == v1::DTYPE_FP16 ? HalfToFloat(h) : Bf16ToFloat(h);
    }
  }
  return absl::OkStatus();
}

void WriteDense(const std::vector<float>& x, int64_t tokens, int heads, int d, v1::DenseTensor* t) {
  t->set_dtype(v1::DTYPE_FP32);
  t->add_shape(tokens);
  t->add_shape(heads);
  t->add_shape(d);
  t->set_data(reinterpret_cast<const char*>(x.data()), x.size() * sizeof(float));
}

void FillRecall(const worker::RecallReport& r, v1::RecallDecision* d) {
  for (uint32_t s : r.selected) d->add_selected_rounds(s);
  for (double s : r.scores) d->add_round_scores(static_cast<float>(s));
  d->set_bytes_fetched(r.bytes_fetched);
  d->set_fetched_segments(static_cast<uint32_t>(r.fetched_segments));
  d->set_fetch_ms(r.fetch_ms);
  d->set_exposed_ms(r.exposed_ms);
}

}  // namespace

class WorkerService final : public v1::Worker::Service {
 public:
  WorkerService(worker::Engine* engine, const Authenticator* auth, WorkerMetrics* metrics)
      : engine_(engine), auth_(auth), metrics_(metrics) {}

  grpc::Status OpenSession(grpc::ServerContext* ctx, const v1::OpenSessionRequest* req,
                           v1::OpenSessionResponse* resp) override {
    auto s = [&]() -> absl::Status {
      KVT_ASSIGN_OR_RETURN(std::string id, Key(*ctx, req->session_id()));
      if (req->resume()) {
        return absl::UnimplementedError("resume from the store is not supported yet");
      }
      KVT_ASSIGN_OR_RETURN(worker::ModelShape shape, ShapeFromProto(req->model()));
      KVT_ASSIGN_OR_RETURN(worker::SessionPolicy policy,
                           PolicyFromProto(req->policy(), req->model().dtype()));
      KVT_RETURN_IF_ERROR(engine_->OpenSession(id, shape, policy));
      KVT_ASSIGN_OR_RETURN(worker::SessionPolicy eff, engine_->Policy(id));
      *resp->mutable_effective_policy() = req->policy();
      resp->mutable_effective_policy()->set_watershed_layer(eff.watershed_layer);
      resp->mutable_effective_policy()->set_recall(worker::RecallName(eff.recall));
      resp->mutable_effective_policy()->set_keep_recent_round(eff.keep_recent_round);
      KVT_ASSIGN_OR_RETURN(worker::SessionStats st, engine_->Stats(id));
      resp->set_on_device(st.on_device);
      resp->set_next_round(0);
      return absl::OkStatus();
    }();
    return Done("OpenSession", s);
  }

  grpc::Status Prefill(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::LayerResponse, v1::LayerRequest>* stream) override {
    v1::LayerRequest req;
    std::string id;
    worker::ModelShape shape;
    std::vector<float> q, k, v, out;
    while (stream->Read(&req)) {
      absl::Status s = [&]() -> absl::Status {
        if (id.empty()) {
          KVT_ASSIGN_OR_RETURN(id, Key(*ctx, req.session_id()));
          KVT_ASSIGN_OR_RETURN(shape, engine_->Shape(id));
        }
        const int64_t n = req.q().shape_size() > 0 ? req.q().shape(0) : 0;
        if (n < 1) return absl::InvalidArgumentError("q must be [tokens >= 1, q_heads, head_dim]");
        KVT_RETURN_IF_ERROR(ReadDense(req.q(), n, shape.q_heads, shape.head_dim, "q", &q));
        KVT_RETURN_IF_ERROR(ReadDense(req.k(), n, shape.kv_heads, shape.head_dim, "k", &k));
        KVT_RETURN_IF_ERROR(ReadDense(req.v(), n, shape.kv_heads, shape.head_dim, "v", &v));
        out.resize(q.size());
        const auto t0 = std::chrono::steady_clock::now();
        KVT_ASSIGN_OR_RETURN(auto recall, engine_->PrefillLayer(id, static_cast<int>(req.layer()),
                                                                n, req.question_tokens(), q.data(),
                                                                k.data(), v.data(), out.data()));
        metrics_->Layer(
            "prefill",
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        v1::LayerResponse resp;
        resp.set_layer(req.layer());
        WriteDense(out, n, shape.q_heads, shape.head_dim, resp.mutable_o());
        if (recall.has_value()) {
          FillRecall(*recall, resp.mutable_recall());
          metrics_->Recall(*recall, recall->fetched_segments > 0 && recall->bytes_fetched > 0);
        }
        if (!stream->Write(resp)) return absl::CancelledError("client went away");
        return absl::OkStatus();
      }();
      if (!s.ok()) return Done("Prefill", s);
    }
    UpdateWorkingSet();
    return Done("Prefill", absl::OkStatus());
  }

  grpc::Status Decode(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::DecodeResponse, v1::DecodeRequest>* stream) override {
    v1::DecodeRequest req;
    std::vector<float> q, k, v, out;
    while (stream->Read(&req)) {
      v1::DecodeResponse resp;
      absl::Status s = [&]() -> absl::Status {
        // One request may batch steps of several sessions.
        for (const v1::DecodeItem& item : req.items()) {
          KVT_ASSIGN_OR_RETURN(std::string id, Key(*ctx, item.session_id()));
          KVT_ASSIGN_OR_RETURN(worker::ModelShape shape, engine_->Shape(id));
          KVT_RETURN_IF_ERROR(ReadDense(item.q(), 1, shape.q_heads, shape.head_dim, "q", &q));
          KVT_RETURN_IF_ERROR(ReadDense(item.k(), 1, shape.kv_heads, shape.head_dim, "k", &k));
          KVT_RETURN_IF_ERROR(ReadDense(item.v(), 1, shape.kv_heads, shape.head_dim, "v", &v));
          out.resize(q.size());
          const auto t0 = std::chrono::steady_clock::now();
          KVT_RETURN_IF_ERROR(engine_->DecodeLayer(id, static_cast<int>(item.layer()), q.data(),
                                                   k.data(), v.data(), out.data()));
          metrics_->Layer(
              "decode",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
          WriteDense(out, 1, shape.q_heads, shape.head_dim, resp.add_o());
        }
        if (!stream->Write(resp)) return absl::CancelledError("client went away");
        return absl::OkStatus();
      }();
      if (!s.ok()) return Done("Decode", s);
    }
    return Done("Decode", absl::OkStatus());
  }

  grpc::Status EndRound(grpc::ServerContext* ctx, const v1::EndRoundRequest* req,
                        v1::EndRoundResponse* resp) override {
    auto s = [&]() -> absl::Status {
      KVT_ASSIGN_OR_RETURN(std::string id, Key(*ctx, req->session_id()));
      KVT_ASSIGN_OR_RETURN(worker::EndRoundReport r, engine_->EndRound(id));
      resp->set_round(r.round);
      resp->set_stored_bytes(r.stored_bytes);
      resp->set_working_set_bytes(r.working_set_bytes);
      resp->set_round_working_set_bytes(r.round_working_set_bytes);
      resp->set_full_cache_bytes(r.full_cache_bytes);
      for (uint32_t x : r.recalls_recorded) resp->add_recalls_counted(x);
      resp->set_compression_ratio(r.stored_bytes > 0 ? static_cast<float>(r.full_bytes) /
                                                           static_cast<float>(r.stored_bytes)
                                                     : 0.0f);
      metrics_->Stored(r.stored_bytes);
      return absl::OkStatus();
    }();
    UpdateWorkingSet();
    return Done("EndRound", s);
  }

  grpc::Status CloseSession(grpc::ServerContext* ctx, const v1::CloseSessionRequest* req,
                            v1::CloseSessionResponse*) override {
    auto s = [&]() -> absl::Status {
      KVT_ASSIGN_OR_RETURN(std::string id, Key(*ctx, req->session_id()));
      return engine_->CloseSession(id, req->delete_from_store());
    }();
    UpdateWorkingSet();
    return Done("CloseSession", s);
  }

  grpc::Status TransferSession(grpc::ServerContext*, grpc::ServerReader<v1::TransferChunk>*,
                               v1::TransferSessionResponse*) override {
    return Done("TransferSession",
                absl::UnimplementedError("TransferSession (prefill -> decode hand-off) is not "
                                         "implemented yet"));
  }

 private:
  // The engine's key for a caller's session: tenant-scoped.
  absl::StatusOr<std::string> Key(const grpc::ServerContext& ctx, const std::string& session) {
    KVT_ASSIGN_OR_RETURN(Principal p, auth_->Authenticate(ctx));
    KVT_RETURN_IF_ERROR(Authenticator::RequireWrite(p));
    if (session.empty() || session.size() > 128) {
      return absl::InvalidArgumentError("session_id must have 1 to 128 characters");
    }
    for (char c : session) {
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == ':' ||
            c == '-')) {
        return absl::InvalidArgumentError(
            absl::StrCat("session_id '", session, "' has characters outside [A-Za-z0-9._:-]"));
      }
    }
    std::string key = absl::StrCat(p.tenant, ".", session);
    if (key.size() > 128) {
      return absl::InvalidArgumentError("tenant plus session_id exceed 128 characters");
    }
    return key;
  }

  void UpdateWorkingSet() {
    metrics_->WorkingSet(static_cast<double>(engine_->TotalWorkingSetBytes()));
  }

  grpc::Status Done(const char* method, const absl::Status& s) {
    metrics_->Request(method, s.ok());
    return ToGrpc(s);
  }

  worker::Engine* engine_;
  const Authenticator* auth_;
  WorkerMetrics* metrics_;
};

absl::StatusOr<std::unique_ptr<WorkerServer>> WorkerServer::Start(WorkerServerOptions options) {
  std::unique_ptr<WorkerServer> s(new WorkerServer());
  if (!options.tenants_file.empty()) {
    KVT_ASSIGN_OR_RETURN(s->auth_, Authenticator::FromFile(options.tenants_file));
  } else {
    LogWarn("no --tenants_file: authentication is off, every caller is tenant 'default'");
  }
  if (options.store.target.empty()) {
    return absl::InvalidArgumentError("kvtier-worker needs a store target (--store)");
  }
  KVT_ASSIGN_OR_RETURN(auto client, StoreClient::Connect(options.store));
  s->segments_ = std::make_unique<StoreSegments>(std::move(client));
  s->engine_ = std::make_unique<worker::Engine>(s->segments_.get(), options.engine);
  s->metrics_ = std::make_unique<WorkerMetrics>();
  if (!options.metrics_listen.empty()) {
    KVT_ASSIGN_OR_RETURN(s->metrics_port_, s->metrics_->Serve(options.metrics_listen));
  }
  s->service_ = std::make_unique<WorkerService>(s->engine_.get(), &s->auth_, s->metrics_.get());
  KVT_ASSIGN_OR_RETURN(auto creds, MakeServerCredentials(options.tls_cert, options.tls_key));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, creds, &s->port_);
  builder.RegisterService(s->service_.get());
  builder.SetMaxReceiveMessageSize(64 << 20);
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
  }
  s->server_->GetHealthCheckService()->SetServingStatus(true);
  LogInfo("kvtier-worker serving", {{"port", s->port_},
                                    {"metrics_port", s->metrics_port_},
                                    {"store", options.store.target},
                                    {"auth", s->auth_.enabled() ? "on" : "off"}});
  return s;
}

void WorkerServer::Shutdown() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
}

void WorkerServer::Wait() { stop_.WaitForNotification(); }

std::string WorkerServer::RenderMetrics() const { return metrics_->Render(); }

WorkerServer::~WorkerServer() {
  Shutdown();
  if (server_ != nullptr) {
    server_->GetHealthCheckService()->SetServingStatus(false);
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
  server_.reset();
}

}  // namespace kvtier
