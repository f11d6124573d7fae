#include "services/worker/worker_metrics.h"

#include "prometheus/text_serializer.h"

namespace kvtier {

std::string WorkerMetrics::Render() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

}  // namespace kvtier
