#include "services/worker/worker_metrics.h"

#include "prometheus/text_serializer.h"
#include "worker/device_attention.h"

namespace kvtier {

std::string WorkerMetrics::Render() const {
  std::vector<prometheus::MetricFamily> all = registry_->Collect();
  for (prometheus::MetricFamily& f : device_calls_->Collect()) all.push_back(std::move(f));
  return prometheus::TextSerializer().Serialize(all);
}

std::vector<prometheus::MetricFamily> WorkerMetrics::DeviceCalls::Collect() const {
  prometheus::MetricFamily calls, seconds;
  calls.name = "kvtier_worker_device_calls_total";
  calls.help =
      "CUDA calls that move working sets on and off the GPU, by kind (alloc, free, upload, "
      "download, copy device to device, ipc_open, ipc_close)";
  seconds.name = "kvtier_worker_device_call_seconds_total";
  seconds.help = "Host time spent in those calls, by kind (they wait for the device)";
  calls.type = seconds.type = prometheus::MetricType::Counter;
  for (const worker::DeviceCallTime& t : worker::DeviceCallTimes()) {
    prometheus::ClientMetric c;
    c.label.push_back({"call", t.call});
    c.counter.value = static_cast<double>(t.count);
    calls.metric.push_back(c);
    c.counter.value = t.seconds;
    seconds.metric.push_back(std::move(c));
  }
  if (calls.metric.empty()) return {};
  return {std::move(calls), std::move(seconds)};
}

}  // namespace kvtier
