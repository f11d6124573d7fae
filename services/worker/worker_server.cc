#include "services/worker/worker_server.h"

#include <chrono>
#include <fstream>
#include <iterator>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/names.h"
#include "base/status_macros.h"
#include "grpcpp/health_check_service_interface.h"
#include "rpc/transport_args.h"
#include "services/common/grpc_server.h"

namespace kvtier {

struct WorkerServer::StoreHealth {
  absl::Mutex mu;
  HealthReport report ABSL_GUARDED_BY(mu) = {true, false,
                                             "starting: the store has not answered yet"};
};

absl::StatusOr<std::unique_ptr<WorkerServer>> WorkerServer::Start(WorkerServerOptions options) {
  std::unique_ptr<WorkerServer> s(new WorkerServer());
  KVT_ASSIGN_OR_RETURN(s->auth_, ServerAuthenticator(options.listen, options.tenants_file,
                                                     options.allow_unauthenticated));
  if (options.store.target.empty()) {
    return absl::InvalidArgumentError("kvtier-worker needs a store target (--store)");
  }
  for (const std::string& a : options.replica_stores) {
    KVT_RETURN_IF_ERROR(ValidateAddress("--replica_stores", a));
  }
  KVT_ASSIGN_OR_RETURN(auto client, StoreClient::Connect(options.store));
  std::shared_ptr<ControllerClient> controller;
  if (!options.cluster.controller.empty()) {
    KVT_ASSIGN_OR_RETURN(controller,
                         ControllerClient::Connect(ControllerOptionsOf(options.cluster)));
  }
  for (const std::string& a : options.peer_workers) {
    KVT_RETURN_IF_ERROR(ValidateAddress("--peer_workers", a));
  }
  // The nodes of one kind the controller lists (none without one).
  auto nodes_of = [controller](v1::NodeKind kind) -> KnownNodes::Lister {
    if (controller == nullptr) return nullptr;
    return [controller, kind](const CallOptions& call) -> absl::StatusOr<std::vector<std::string>> {
      CallOptions c = call;
      c.tenant.clear();  // The worker's own question, under its node token.
      KVT_ASSIGN_OR_RETURN(v1::ListNodesResponse nodes, controller->ListNodes(c));
      std::vector<std::string> out;
      for (const v1::NodeStatus& n : nodes.nodes()) {
        if (n.kind() == kind) out.push_back(n.address());
      }
      return out;
    };
  };
  KnownNodesOptions stores{"store replica address",
                           "the worker's --store, its --replica_stores, and the store nodes its "
                           "controller lists",
                           options.replica_stores, /*open_when_unconfigured=*/false};
  stores.configured.push_back(options.store.target);
  s->segments_ = std::make_unique<ReplicatedSegments>(
      std::make_unique<StoreSegments>(std::move(client)), options.store,
      std::make_unique<KnownNodes>(std::move(stores), nodes_of(v1::NODE_KIND_STORE)));
  // Hand-off targets: the caller's own token goes there, never the
  // worker's; a standalone worker without --peer_workers takes any.
  s->peers_ = std::make_unique<KnownNodes>(
      KnownNodesOptions{"hand-off target",
                        "the worker's --peer_workers and the worker nodes its controller lists",
                        options.peer_workers, /*open_when_unconfigured=*/true},
      nodes_of(v1::NODE_KIND_WORKER));
  if (controller != nullptr) {
    // Dead replicas are replaced where the controller now places the session.
    s->segments_->SetRerouter(
        [controller](const std::string& tenant, const std::string& session,
                     const CallOptions& call) -> absl::StatusOr<std::vector<std::string>> {
          v1::RouteRequest req;
          req.set_session_id(session);
          CallOptions c = call;
          c.tenant = tenant;  // The end tenant's placement (a node token acts for it).
          KVT_ASSIGN_OR_RETURN(v1::RouteResponse r, controller->Route(req, c));
          return std::vector<std::string>(r.store_addresses().begin(), r.store_addresses().end());
        });
    // The agent starts after the server; until then the epoch reads 0.
    s->segments_->SetEpochSource([agent = s->agent_epoch_] { return agent->load(); });
  }
  options.engine.store_deadline = options.service.store_deadline;
  // Fair shares: without authentication every caller is one tenant, and
  // the worker's own limits are its only ones.
  worker::EngineOptions::TenantLimit& fair = options.engine.default_tenant_limit;
  if (!s->auth_.enabled()) fair = {};
  for (const auto& [tenant, l] : s->auth_.Limits()) {
    options.engine.tenant_limits[tenant] = {
        l.max_sessions > 0 ? l.max_sessions : fair.max_sessions,
        l.max_working_set_bytes > 0 ? l.max_working_set_bytes : fair.max_working_set_bytes};
  }
  s->skews_ = std::make_unique<worker::SkewRegistry>();
  options.engine.skews = s->skews_.get();
  s->engine_ = std::make_unique<worker::Engine>(s->segments_.get(), options.engine);
  for (const std::string& path : options.skew_files) {
    std::ifstream f(path, std::ios::binary);
    if (!f) return absl::NotFoundError(absl::StrCat("cannot read skew file ", path));
    const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    absl::StatusOr<std::string> id = s->skews_->Put(bytes);
    if (!id.ok()) {
      return absl::Status(id.status().code(), absl::StrCat(path, ": ", id.status().message()));
    }
    LogInfo("skew ready", {{"file", path}, {"skew", *id}});
  }
  s->metrics_ = std::make_unique<WorkerMetrics>();
  s->metrics_->Budget(static_cast<double>(options.engine.max_working_set_bytes));
  s->store_health_ = std::make_shared<StoreHealth>();
  if (options.store_probe_interval <= absl::ZeroDuration()) {
    absl::MutexLock lock(&s->store_health_->mu);
    s->store_health_->report = {};
  }
  if (!options.metrics_listen.empty()) {
    KVT_ASSIGN_OR_RETURN(s->metrics_port_,
                         s->metrics_->Serve(options.metrics_listen, [h = s->store_health_] {
                           absl::MutexLock lock(&h->mu);
                           return h->report;
                         }));
  }
  const int compute = options.compute_threads > 0
                          ? options.compute_threads
                          : std::max(2, static_cast<int>(std::thread::hardware_concurrency()));
  s->compute_ = std::make_unique<Executor>(compute);
  s->io_ = std::make_unique<Executor>(std::max(1, options.io_threads));
  if (controller != nullptr) {
    s->policies_ = std::make_unique<ControllerPolicies>(controller, s->engine_.get(), s->io_.get());
  }
  s->service_ = std::make_unique<WorkerService>(
      s->engine_.get(), &s->auth_, s->metrics_.get(), s->compute_.get(), s->io_.get(),
      options.service, s->segments_.get(), s->policies_.get(), s->peers_.get());
  // gRPC's default 4 MiB receive limit stays: layers travel in chunks. The
  // store's flow-control settings: a session handed here (TransferSession)
  // streams like a segment put.
  KVT_ASSIGN_OR_RETURN(s->server_,
                       StartGrpcServer({options.listen, options.tls_cert, options.tls_key,
                                        [](grpc::ServerBuilder& b) { ApplyBulkTransportArgs(&b); },
                                        v1::Worker::service_full_name(), options.tls_client_ca},
                                       s->service_.get(), &s->port_));
  {
    worker::Engine* engine = s->engine_.get();
    KVT_ASSIGN_OR_RETURN(
        s->agent_,
        JoinCluster(options.cluster, v1::NODE_KIND_WORKER, options.listen, s->port_,
                    options.engine.max_working_set_bytes,
                    {.usage =
                         [engine] {
                           const worker::Engine::Totals t = engine->totals();
                           return NodeUsage{t.working_set_bytes, static_cast<uint32_t>(t.sessions)};
                         },
                     .sessions = [segments = s->segments_.get()] { return segments->Held(); },
                     .epoch = s->agent_epoch_,
                     .on_heartbeat =
                         [policies = s->policies_.get()](const v1::HeartbeatResponse& hb) {
                           if (policies != nullptr) policies->OnHeartbeat(hb);
                         },
                     .role = options.service.role == WorkerServiceOptions::Role::kPrefill
                                 ? v1::WORKER_ROLE_PREFILL
                             : options.service.role == WorkerServiceOptions::Role::kDecode
                                 ? v1::WORKER_ROLE_DECODE
                                 : v1::WORKER_ROLE_BOTH}));
  }
  if (s->policies_ != nullptr && s->agent_ != nullptr)
    s->policies_->SetNodeId(s->agent_->node_id());
  if (options.store_probe_interval > absl::ZeroDuration()) {
    // A channel of its own, so that probes never queue behind payloads.
    KVT_ASSIGN_OR_RETURN(s->probe_client_, StoreClient::Connect(options.store));
    s->server_->GetHealthCheckService()->SetServingStatus("", false);
    s->server_->GetHealthCheckService()->SetServingStatus(v1::Worker::service_full_name(), false);
    s->prober_ =
        std::thread([raw = s.get(), interval = options.store_probe_interval,
                     target = options.store.target] { raw->ProbeStore(interval, target); });
  }
  LogInfo("kvtier-worker serving", {{"port", s->port_},
                                    {"metrics_port", s->metrics_port_},
                                    {"store", options.store.target},
                                    {"compute_threads", compute},
                                    {"max_sessions", options.engine.max_sessions},
                                    {"max_working_set_bytes", options.engine.max_working_set_bytes},
                                    {"tenant_max_sessions", fair.max_sessions},
                                    {"tenant_max_working_set_bytes", fair.max_working_set_bytes},
                                    {"auth", s->auth_.enabled() ? "on" : "off"}});
  return s;
}

void WorkerServer::ProbeStore(absl::Duration interval, const std::string& target) {
  bool was_ready = false, first = true;
  do {
    // Any answer counts, an error included (the store is there); only
    // silence does not.
    absl::Status st = probe_client_->Stats(CallOptions::Within(interval)).status();
    const bool ready = st.ok() || (st.code() != absl::StatusCode::kUnavailable &&
                                   st.code() != absl::StatusCode::kDeadlineExceeded);
    if (ready != was_ready || first) {
      HealthReport r;
      if (!ready) {
        r.ready = false;
        r.reason = absl::StrCat("kvtier-store ", target, " does not answer: ", st.ToString());
      }
      {
        absl::MutexLock lock(&store_health_->mu);
        store_health_->report = r;
      }
      server_->GetHealthCheckService()->SetServingStatus("", ready);
      server_->GetHealthCheckService()->SetServingStatus(v1::Worker::service_full_name(), ready);
      if (ready) {
        LogInfo("store answers: worker ready", {{"store", target}});
      } else {
        LogWarn("store does not answer: worker NOT_SERVING until it does",
                {{"store", target}, {"error", st.ToString()}});
      }
      was_ready = ready;
      first = false;
    }
  } while (!stop_.WaitForNotificationWithTimeout(interval));
}

void WorkerServer::Shutdown() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
}

void WorkerServer::Wait() { stop_.WaitForNotification(); }

std::string WorkerServer::RenderMetrics() const { return metrics_->Render(); }

WorkerServer::~WorkerServer() {
  Shutdown();
  if (prober_.joinable()) prober_.join();
  agent_.reset();  // Stop heartbeats first: the controller sees the node leave.
  if (server_ != nullptr) {
    server_->GetHealthCheckService()->SetServingStatus(false);
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
  server_.reset();
  // The executors drain before the service, engine and store they call go.
  compute_.reset();
  io_.reset();
}

}  // namespace kvtier
