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
    // CivetServer says only "null context when constructing CivetServer"
    // when the port is taken (a second kvtier process on this host).
    return absl::UnavailableError(absl::StrCat(
        "cannot serve metrics on ", address, " (", ex.what(),
        "); is another process listening there? Pick a free port with --metrics_listen=HOST:PORT "
        "(port 0: any free one) or turn metrics off with --metrics_listen="));
  }
  for (const auto& c : collectables) e.exposer->RegisterCollectable(c);
  const std::vector<int> ports = e.exposer->GetListeningPorts();
  e.port = ports.empty() ? 0 : ports[0];
  return e;
}

}  // namespace kvtier
