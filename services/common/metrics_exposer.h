// Prometheus /metrics over HTTP for the kvtier servers.
#ifndef KVTIER_SERVICES_COMMON_METRICS_EXPOSER_H_
#define KVTIER_SERVICES_COMMON_METRICS_EXPOSER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"

namespace kvtier {

struct MetricsEndpoint {
  std::unique_ptr<prometheus::Exposer> exposer;
  int port = 0;  // The bound port (address "host:0" picks one).
};

// Serves `collectables` at `address` ("host:port"). UNAVAILABLE when the
// address cannot be bound.
absl::StatusOr<MetricsEndpoint> ServeMetrics(
    const std::string& address,
    const std::vector<std::shared_ptr<prometheus::Collectable>>& collectables);

}  // namespace kvtier

#endif  // KVTIER_SERVICES_COMMON_METRICS_EXPOSER_H_
