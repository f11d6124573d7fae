#include "services/common/metrics_exposer.h"

#include <exception>

#include "absl/strings/str_cat.h"

namespace kvtier {

absl::StatusOr<MetricsEndpoint> ServeMetrics(
    const std::string& address,
    const std::vector<std::shared_ptr<prometheus::Collectable>>& collectables) {
  MetricsEndpoint e;
  try {
    e.exposer = std::make_unique<prometheus::Exposer>(address);
  } catch (const std::exception& ex) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", ex.what()));
  }
  for (const auto& c : collectables) e.exposer->RegisterCollectable(c);
  const std::vector<int> ports = e.exposer->GetListeningPorts();
  e.port = ports.empty() ? 0 : ports[0];
  return e;
}

}  // namespace kvtier
