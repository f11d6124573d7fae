// Prometheus metrics of kvtier-store. Tier bytes and counters are read from
// the Store on every scrape (no double bookkeeping); request latencies are
// histograms fed by the service.
#ifndef KVTIER_SERVICES_STORE_STORE_METRICS_H_
#define KVTIER_SERVICES_STORE_STORE_METRICS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cachestore/store.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "services/common/metrics_exposer.h"

namespace kvtier {

// Thread-safe.
class StoreMetrics {
 public:
  // `store` is not owned and must outlive this object.
  explicit StoreMetrics(const cachestore::Store* store);
  ~StoreMetrics();

  // Serves /metrics on `address` ("127.0.0.1:0" picks a port). Returns the
  // bound port, or UNAVAILABLE when the address cannot be bound.
  absl::StatusOr<int> Serve(const std::string& address);

  // Records one finished RPC, its outcome by RequestOutcome(s)
  // (services/common/request_outcome.h).
  void ObserveRequest(const std::string& method, absl::Duration latency, const absl::Status& s);
  // One segment's upload ended (`method`: PutSegment or PutSegments, whose
  // segments each have their own outcome).
  void CountSegmentPut(const std::string& method, const absl::Status& s);

  // The text exposition of every metric (what /metrics returns).
  std::string Render() const;

 private:
  class TierCollector;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<TierCollector> tiers_;
  prometheus::Family<prometheus::Histogram>* latency_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Counter>* segment_puts_;
  MetricsEndpoint endpoint_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_STORE_STORE_METRICS_H_
