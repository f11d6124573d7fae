#include "services/store/store_server.h"

#include "absl/strings/str_cat.h"
#include "base/executor.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "grpcpp/health_check_service_interface.h"
#include "rpc/transport_args.h"
#include "services/common/grpc_server.h"
#include "services/store/store_metrics.h"
#include "services/store/store_service.h"

namespace kvtier {

absl::StatusOr<std::unique_ptr<StoreServer>> StoreServer::Start(StoreServerOptions options) {
  std::unique_ptr<StoreServer> s(new StoreServer());
  s->options_ = options;
  KVT_ASSIGN_OR_RETURN(s->auth_, ServerAuthenticator(options.listen, options.tenants_file,
                                                     options.allow_unauthenticated));
  s->quotas_ = std::make_unique<cachestore::QuotaManager>();
  for (const TenantEntry& e : s->auth_.entries()) {
    if (e.quota_bytes != 0) s->quotas_->SetQuota(e.principal.tenant, e.quota_bytes);
  }
  KVT_ASSIGN_OR_RETURN(s->store_, cachestore::Store::Open(options.store, s->quotas_.get()));
  s->executor_ = std::make_unique<Executor>(options.executor_threads);
  s->metrics_ = std::make_unique<StoreMetrics>(s->store_.get());
  if (!options.metrics_listen.empty()) {
    KVT_ASSIGN_OR_RETURN(s->metrics_port_, s->metrics_->Serve(options.metrics_listen));
  }
  s->service_ =
      std::make_unique<StoreService>(s->store_.get(), s->quotas_.get(), &s->auth_,
                                     s->executor_.get(), s->metrics_.get(), options.service);
  GrpcServerSpec spec{options.listen,
                      options.tls_cert,
                      options.tls_key,
                      [](grpc::ServerBuilder& b) {
                        // Payloads stream in ~1 MiB chunks; 8 MiB leaves room
                        // for framing without letting one message grow
                        // unbounded.
                        b.SetMaxReceiveMessageSize(8 << 20);
                        ApplyBulkTransportArgs(&b);
                      },
                      v1::Store::service_full_name(),
                      options.tls_client_ca};
  KVT_ASSIGN_OR_RETURN(s->server_, StartGrpcServer(spec, s->service_.get(), &s->port_));
  {
    cachestore::Store* store = s->store_.get();
    // Every stored byte counts against the disk budget (RAM caches a
    // part of them): that budget is the store's capacity, its use the usage.
    const uint64_t capacity = options.store.disk_budget_bytes;
    NodeHooks hooks;
    hooks.usage = [store] {
      const cachestore::StoreStats st = store->Stats();
      return NodeUsage{st.disk_bytes, static_cast<uint32_t>(st.sessions)};
    };
    // At HIGH pressure, never-recalled rounds of cold sessions go (one drop
    // at a time, off the agent's thread).
    hooks.on_heartbeat = [raw = s.get()](const v1::HeartbeatResponse& hb) {
      if (hb.pressure() != v1::PRESSURE_HIGH || raw->cold_drop_running_.exchange(true)) return;
      const int64_t idle = static_cast<int64_t>(hb.cold_idle_ms());
      raw->executor_->Schedule([raw, idle] {
        absl::StatusOr<cachestore::Store::ColdDropResult> r = raw->store_->DropColdRounds(idle);
        if (!r.ok()) {
          LogError("dropping cold rounds under memory pressure failed",
                   {{"error", r.status().ToString()}});
        }
        raw->cold_drop_running_.store(false);
      });
    };
    KVT_ASSIGN_OR_RETURN(s->agent_,
                         JoinCluster(options.cluster, v1::NODE_KIND_STORE, options.listen, s->port_,
                                     capacity, std::move(hooks)));
  }
  if (options.ttl_sweep_seconds > 0) {
    StoreServer* raw = s.get();
    s->sweeper_ = std::thread([raw] {
      while (!raw->stop_.WaitForNotificationWithTimeout(
          absl::Seconds(raw->options_.ttl_sweep_seconds))) {
        absl::StatusOr<int> n = raw->store_->ExpireSessions();
        if (!n.ok()) LogError("TTL sweep failed", {{"error", n.status().ToString()}});
      }
    });
  }
  LogInfo("kvtier-store serving", {{"port", s->port_},
                                   {"metrics_port", s->metrics_port_},
                                   {"data_dir", options.store.path},
                                   {"tls", options.tls_cert.empty() ? "off" : "on"},
                                   {"auth", s->auth_.enabled() ? "on" : "off"}});
  return s;
}

void StoreServer::Shutdown() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
}

void StoreServer::Wait() { stop_.WaitForNotification(); }

StoreServer::~StoreServer() {
  Shutdown();
  agent_.reset();  // Stop heartbeats first: the controller sees the node leave.
  if (sweeper_.joinable()) sweeper_.join();
  if (server_ != nullptr) {
    server_->GetHealthCheckService()->SetServingStatus(false);
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
  executor_.reset();  // Runs what was queued; reactors finish.
  server_.reset();
}

}  // namespace kvtier
