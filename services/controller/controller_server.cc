#include "services/controller/controller_server.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "grpcpp/health_check_service_interface.h"
#include "prometheus/text_serializer.h"
#include "services/common/grpc_server.h"

namespace kvtier {

absl::StatusOr<std::unique_ptr<ControllerServer>> ControllerServer::Start(
    ControllerServerOptions options) {
  std::unique_ptr<ControllerServer> s(new ControllerServer());
  KVT_ASSIGN_OR_RETURN(s->auth_, ServerAuthenticator(options.listen, options.tenants_file,
                                                     options.allow_unauthenticated));
  if (const int unbound = s->auth_.UnboundNodeTokens(); unbound > 0) {
    LogWarn(
        "node tokens without node_id= in the tenants file: any holder of one may register or "
        "heartbeat as any node not bound to a token of its own (docs/security.md)",
        {{"unbound_node_tokens", unbound}});
  }
  const controller::MembershipOptions& m = options.controller.membership;
  if (m.heartbeat_interval < absl::Milliseconds(10) || m.missed_heartbeats < 1 ||
      options.controller.replicas < 1 || options.controller.replicas > 3) {
    return absl::InvalidArgumentError(
        "need heartbeat interval >= 10 ms, missed heartbeats >= 1, replicas in [1, 3]");
  }
  if (!(m.pressure_moderate > 0 && m.pressure_moderate <= m.pressure_high &&
        m.pressure_high <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("need 0 < --pressure_moderate <= --pressure_high <= 1, got ",
                     m.pressure_moderate, " and ", m.pressure_high));
  }
  if (options.policy.cold_after <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--cold_after_seconds must be > 0");
  }
  s->controller_ = std::make_unique<controller::Controller>(options.controller);
  s->metrics_registry_ = std::make_unique<ControllerMetrics>();
  s->metrics_registry_->Update(*s->controller_);
  if (!options.metrics_listen.empty()) {
    KVT_ASSIGN_OR_RETURN(s->metrics_,
                         ServeMetrics(options.metrics_listen, {s->metrics_registry_->registry()}));
  }
  KVT_ASSIGN_OR_RETURN(s->repairer_, Repairer::Start(s->controller_.get(), options.repair));
  std::string policy_file;
  if (!options.state_dir.empty() && options.etcd_endpoints.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(options.state_dir, ec);
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot create --state_dir ", options.state_dir, ": ", ec.message()));
    }
    policy_file = (std::filesystem::path(options.state_dir) / "policies").string();
  }
  if (!options.etcd_endpoints.empty()) {
    EtcdOptions eo;
    eo.endpoints = options.etcd_endpoints;
    KVT_ASSIGN_OR_RETURN(std::unique_ptr<EtcdClient> etcd, EtcdClient::Connect(eo));
    EtcdBackendOptions bo;
    bo.prefix = options.etcd_prefix;
    bo.replica_id = options.replica_id.empty() ? options.listen : options.replica_id;
    auto backend = std::make_unique<EtcdBackend>(std::move(etcd), bo, s->controller_.get());
    EtcdBackend* b = backend.get();
    s->coordination_ = std::move(backend);
    s->controller_->SetPlacementShare(b);
    s->policies_ = PolicyBook::OpenShared(
        {[b](const std::string& m, const std::string& v) { return b->PutPolicy(m, v); },
         [b](const std::string& m) { return b->GetPolicy(m); }});
    KVT_RETURN_IF_ERROR(b->Reconcile());
    b->Campaign();
    s->blocking_ = std::make_unique<Executor>(8);
  } else {
    s->coordination_ = std::make_unique<EmbeddedCoordination>(&s->controller_->membership());
    KVT_ASSIGN_OR_RETURN(s->policies_, PolicyBook::Open(policy_file));
  }
  s->service_ = std::make_unique<ControllerService>(
      s->controller_.get(), s->coordination_.get(), s->policies_.get(), &s->auth_,
      s->metrics_registry_.get(), options.policy, s->blocking_.get());
  KVT_ASSIGN_OR_RETURN(s->server_, StartGrpcServer({options.listen,
                                                    options.tls_cert,
                                                    options.tls_key,
                                                    {},
                                                    v1::Controller::service_full_name(),
                                                    options.tls_client_ca},
                                                   s->service_.get(), &s->port_));
  // Leases are checked twice per heartbeat interval.
  ControllerServer* raw = s.get();
  const absl::Duration tick = m.heartbeat_interval / 2;
  s->sweeper_ = std::thread([raw, tick] {
    bool led = false;
    int64_t ticks = 0;
    while (!raw->stop_.WaitForNotificationWithTimeout(tick)) {
      const bool leading = raw->coordination_->Sync();
      raw->metrics_registry_->Leader(leading);
      ++ticks;
      const std::vector<std::string> dead = raw->controller_->Tick();
      // The shared placements are scanned when a node died, when this
      // replica just took the lead, and every 20 ticks (a death another
      // leader saw but did not finish with).
      const bool scan = !dead.empty() || !led || ticks % 20 == 0;
      led = leading;
      if (leading && scan) {
        absl::StatusOr<int> moved = raw->controller_->ReplaceDeadStores();
        if (!moved.ok()) {
          LogWarn("replacing dead replicas failed", {{"error", moved.status().ToString()}});
        } else if (*moved > 0) {
          LogInfo("dead store replicas replaced", {{"placements", *moved}});
        }
      }
      if (!dead.empty()) raw->metrics_registry_->DeclaredDead(dead.size());
      raw->metrics_registry_->Update(*raw->controller_);
      raw->metrics_registry_->UpdateRepair(raw->repairer_->stats());
    }
  });
  LogInfo("kvtier-controller serving",
          {{"port", s->port_},
           {"metrics_port", s->metrics_.port},
           {"heartbeat_interval_ms", absl::ToInt64Milliseconds(m.heartbeat_interval)},
           {"missed_heartbeats", m.missed_heartbeats},
           {"replicas", options.controller.replicas},
           {"policies", s->policies_->size()},
           {"state_dir", options.state_dir.empty() ? "(memory only)" : options.state_dir},
           {"backend", options.etcd_endpoints.empty() ? "embedded" : "etcd"},
           {"repair_parallelism", options.repair.parallelism},
           {"repair_mb_per_s", options.repair.max_bytes_per_second >> 20},
           {"auth", s->auth_.enabled() ? "on" : "off"}});
  return s;
}

std::string ControllerServer::RenderMetrics() const {
  metrics_registry_->Update(*controller_);
  return prometheus::TextSerializer().Serialize(metrics_registry_->registry()->Collect());
}

ControllerServer::~ControllerServer() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (sweeper_.joinable()) sweeper_.join();
  repairer_.reset();
  if (server_ != nullptr) {
    server_->GetHealthCheckService()->SetServingStatus(false);
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
  // Calls still queued run and finish while the server object exists.
  blocking_.reset();
  server_.reset();
}

}  // namespace kvtier
