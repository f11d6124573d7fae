#include "services/store/store_metrics.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/text_serializer.h"
#include "services/common/request_outcome.h"

namespace kvtier {

// Reads the store's stats at scrape time.
class StoreMetrics::TierCollector : public prometheus::Collectable {
 public:
  explicit TierCollector(const cachestore::Store* store) : store_(store) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    cachestore::StoreStats s = store_->Stats();
    std::vector<prometheus::MetricFamily> out;
    auto family = [&](const char* name, const char* help, prometheus::MetricType type) {
      out.push_back({name, help, type, {}});
      return &out.back();
    };
    auto add = [](prometheus::MetricFamily* f, double v,
                  std::vector<prometheus::ClientMetric::Label> labels = {}) {
      prometheus::ClientMetric m;
      m.label = std::move(labels);
      if (f->type == prometheus::MetricType::Counter) {
        m.counter.value = v;
      } else {
        m.gauge.value = v;
      }
      f->metric.push_back(std::move(m));
    };
    using prometheus::MetricType;
    auto* bytes =
        family("kvtier_store_bytes", "Segment payload bytes held per tier.", MetricType::Gauge);
    add(bytes, s.ram_bytes, {{"tier", "ram"}});
    add(bytes, s.disk_bytes, {{"tier", "disk"}});
    auto* segs = family("kvtier_store_segments", "Segments held per tier.", MetricType::Gauge);
    add(segs, s.ram_segments, {{"tier", "ram"}});
    add(segs, s.disk_segments, {{"tier", "disk"}});
    auto* budget = family("kvtier_store_budget_bytes", "Byte budget per tier (0 = unlimited).",
                          MetricType::Gauge);
    add(budget, s.ram_budget_bytes, {{"tier", "ram"}});
    add(budget, s.disk_budget_bytes, {{"tier", "disk"}});
    add(family("kvtier_store_sessions", "Sessions in the index.", MetricType::Gauge), s.sessions);
    auto* hits =
        family("kvtier_store_hits_total", "Segment reads served, per tier.", MetricType::Counter);
    add(hits, s.hits_ram, {{"tier", "ram"}});
    add(hits, s.hits_disk, {{"tier", "disk"}});
    add(family("kvtier_store_spills_total", "Segments spilled from RAM to RocksDB only.",
               MetricType::Counter),
        s.spills);
    add(family("kvtier_store_promotions_total", "Spilled segments promoted back into RAM.",
               MetricType::Counter),
        s.promotions);
    auto* drops =
        family("kvtier_store_round_drops_total", "Rounds dropped, by reason.", MetricType::Counter);
    add(drops, s.drops - s.pressure_drops - s.cold_drops, {{"reason", "explicit"}});
    add(drops, s.pressure_drops, {{"reason", "disk_pressure"}});
    add(drops, s.cold_drops, {{"reason", "memory_pressure"}});
    add(family("kvtier_store_segment_drops_total",
               "Single segments dropped with their round kept (sliding-window layers).",
               MetricType::Counter),
        s.segment_drops);
    add(family("kvtier_store_expired_sessions_total", "Sessions expired by TTL.",
               MetricType::Counter),
        s.expired_sessions);
    add(family("kvtier_store_spare_payload_files",
               "Empty payload files ready for the next large puts.", MetricType::Gauge),
        s.spare_payload_files);
    add(family("kvtier_store_spare_misses_total",
               "Large puts that found no spare payload file and created their own.",
               MetricType::Counter),
        s.spare_misses);
    add(family("kvtier_store_recycled_payload_bytes",
               "Bytes of dropped segments' payload files kept to be overwritten by later puts.",
               MetricType::Gauge),
        s.recycled_payload_bytes);
    add(family("kvtier_store_recycle_hits_total",
               "Large puts that overwrote a recycled payload file.", MetricType::Counter),
        s.recycle_hits);
    return out;
  }

 private:
  const cachestore::Store* store_;
};

StoreMetrics::StoreMetrics(const cachestore::Store* store)
    : registry_(std::make_shared<prometheus::Registry>()),
      tiers_(std::make_shared<TierCollector>(store)) {
  latency_ = &prometheus::BuildHistogram()
                  .Name("kvtier_store_request_seconds")
                  .Help("Latency of finished store RPCs, by method.")
                  .Register(*registry_);
  requests_ = &prometheus::BuildCounter()
                   .Name("kvtier_store_requests_total")
                   .Help("Finished store RPCs, by method and outcome.")
                   .Register(*registry_);
  segment_puts_ = &prometheus::BuildCounter()
                       .Name("kvtier_store_segment_puts_total")
                       .Help(
                           "Segment uploads that ended, by method and outcome (a PutSegments "
                           "call counts each of its segments).")
                       .Register(*registry_);
}

StoreMetrics::~StoreMetrics() = default;

absl::StatusOr<int> StoreMetrics::Serve(const std::string& address) {
  KVT_ASSIGN_OR_RETURN(endpoint_, ServeMetrics(address, {registry_, tiers_}));
  return endpoint_.port;
}

void StoreMetrics::ObserveRequest(const std::string& method, absl::Duration latency,
                                  const absl::Status& s) {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
      0.05,   0.1,     0.25,   0.5,   1,      2.5,   5,    10};
  latency_->Add({{"method", method}}, kBuckets).Observe(absl::ToDoubleSeconds(latency));
  requests_->Add({{"method", method}, {"outcome", RequestOutcome(s)}}).Increment();
}

void StoreMetrics::CountSegmentPut(const std::string& method, const absl::Status& s) {
  segment_puts_->Add({{"method", method}, {"outcome", RequestOutcome(s)}}).Increment();
}

std::string StoreMetrics::Render() const {
  std::vector<prometheus::MetricFamily> all = registry_->Collect();
  for (auto& f : tiers_->Collect()) all.push_back(std::move(f));
  return prometheus::TextSerializer().Serialize(all);
}

}  // namespace kvtier
