// Prometheus /metrics over HTTP for the kvtier servers, with the health
// endpoints a load balancer or a kubelet probes beside it:
//   GET /healthz  200 "ok" while the process serves (liveness);
//   GET /readyz   200 "ok" when it can do its work, else 503 and the reason
//                 (readiness: a worker whose store does not answer is live
//                 but not ready).
#ifndef KVTIER_SERVICES_COMMON_METRICS_EXPOSER_H_
#define KVTIER_SERVICES_COMMON_METRICS_EXPOSER_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"

namespace kvtier {

// What /healthz and /readyz answer.
struct HealthReport {
  bool live = true;
  bool ready = true;
  std::string reason;  // Why not, when not.
};
using HealthFn = std::function<HealthReport()>;

class HealthRegistration;

struct MetricsEndpoint {
  MetricsEndpoint() = default;
  MetricsEndpoint(MetricsEndpoint&&) = default;
  MetricsEndpoint& operator=(MetricsEndpoint&&) = default;
  // Stop().
  ~MetricsEndpoint();
  // Stops serving. civetweb's stop waits for its listening thread, which
  // wakes only on a connection or after a 2 s poll; this connects to the
  // port while it waits, so a server exits in milliseconds.
  void Stop();

  std::unique_ptr<prometheus::Exposer> exposer;
  int port = 0;  // The bound port (address "host:0" picks one).
  // The IPv4 address to reach the port at (the bound one, 127.0.0.1 for a
  // wildcard); empty: none (Stop then waits for civetweb's poll).
  std::string wake_host;
  // Routes this port's /healthz and /readyz to its HealthFn; goes first.
  std::shared_ptr<HealthRegistration> health;
  // process_resident_memory_bytes, kvtier_process_* and kvtier_build_info
  // (every server has them).
  std::shared_ptr<prometheus::Collectable> process;
};

// Serves `collectables` and the process's memory at `address` ("host:port")
// under /metrics, and /healthz and /readyz from `health` (null: always live
// and ready; it runs on the HTTP server's threads and must be cheap and
// thread-safe).
// UNAVAILABLE when the address cannot be bound, naming --metrics_listen.
absl::StatusOr<MetricsEndpoint> ServeMetrics(
    const std::string& address,
    const std::vector<std::shared_ptr<prometheus::Collectable>>& collectables,
    HealthFn health = nullptr);

}  // namespace kvtier

#endif  // KVTIER_SERVICES_COMMON_METRICS_EXPOSER_H_
