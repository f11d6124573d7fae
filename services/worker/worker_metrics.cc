#include "services/worker/worker_metrics.h"

#include "prometheus/text_serializer.h"
#include "worker/device/attention.h"

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
  // The device block cache (worker/device/block_cache.h): where allocations came
  // from, and what it holds for reuse.
  const worker::BlockCache::Stats cache = worker::DeviceCacheState();
  prometheus::MetricFamily takes, held;
  takes.name = "kvtier_worker_device_blocks_total";
  takes.help =
      "Device blocks the worker's buffers took, by source: reused (from the cache of freed "
      "blocks) or allocated (cudaMalloc)";
  takes.type = prometheus::MetricType::Counter;
  for (const auto& [source, n] :
       {std::pair{"reused", cache.reused}, {"allocated", cache.allocated}}) {
    prometheus::ClientMetric c;
    c.label.push_back({"source", source});
    c.counter.value = static_cast<double>(n);
    takes.metric.push_back(std::move(c));
  }
  held.name = "kvtier_worker_device_cached_bytes";
  held.help = "Freed device memory held for reuse (at most --device_cache_mib)";
  held.type = prometheus::MetricType::Gauge;
  prometheus::ClientMetric h;
  h.gauge.value = static_cast<double>(cache.cached_bytes);
  held.metric.push_back(std::move(h));
  return {std::move(calls), std::move(seconds), std::move(takes), std::move(held)};
}

}  // namespace kvtier
