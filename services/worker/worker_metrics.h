// Prometheus metrics of kvtier-worker: working-set bytes, recalls, bytes
// fetched and stored, per-layer latency, RPC outcomes.
#ifndef KVTIER_SERVICES_WORKER_WORKER_METRICS_H_
#define KVTIER_SERVICES_WORKER_WORKER_METRICS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/status_macros.h"
#include "kvtier/v1/worker.pb.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "services/common/metrics_exposer.h"
#include "services/common/request_outcome.h"
#include "worker/engine.h"

namespace kvtier {

// Thread-safe (prometheus-cpp metrics are).
class WorkerMetrics {
 public:
  WorkerMetrics()
      : registry_(std::make_shared<prometheus::Registry>()),
        working_set_(prometheus::BuildGauge()
                         .Name("kvtier_worker_working_set_bytes")
                         .Help("Working-set bytes over all sessions")
                         .Register(*registry_)
                         .Add({})),
        sessions_(prometheus::BuildGauge()
                      .Name("kvtier_worker_sessions")
                      .Help("Sessions held")
                      .Register(*registry_)
                      .Add({})),
        handoff_cache_(prometheus::BuildGauge()
                           .Name("kvtier_worker_handoff_cache_bytes")
                           .Help("Encoded bytes of past rounds kept for sessions handed off "
                                 "(the hand-off cache; not in the working set)")
                           .Register(*registry_)
                           .Add({})),
        budget_(prometheus::BuildGauge()
                    .Name("kvtier_worker_working_set_budget_bytes")
                    .Help("The working-set byte budget (0: none)")
                    .Register(*registry_)
                    .Add({})),
        recalls_(prometheus::BuildCounter()
                     .Name("kvtier_worker_recalls_total")
                     .Help("Round recalls at the watershed layer")
                     .Register(*registry_)
                     .Add({})),
        selected_(prometheus::BuildCounter()
                      .Name("kvtier_worker_recall_rounds_selected_total")
                      .Help("Past rounds selected by recall")
                      .Register(*registry_)
                      .Add({})),
        candidates_(prometheus::BuildCounter()
                        .Name("kvtier_worker_recall_rounds_candidate_total")
                        .Help("Past rounds recall chose from")
                        .Register(*registry_)
                        .Add({})),
        fetched_(prometheus::BuildCounter()
                     .Name("kvtier_worker_bytes_fetched_total")
                     .Help("Payload bytes fetched from kvtier-store by recall")
                     .Register(*registry_)
                     .Add({})),
        stored_(prometheus::BuildCounter()
                    .Name("kvtier_worker_bytes_stored_total")
                    .Help("Payload bytes written to kvtier-store at EndRound")
                    .Register(*registry_)
                    .Add({})),
        pool_evicted_(prometheus::BuildCounter()
                          .Name("kvtier_worker_speculation_pool_evicted_tokens_total")
                          .Help("Tokens the host pool evicted at EndRound (speculating sessions "
                                "with a pool cap), summed over layers and KV heads")
                          .Register(*registry_)
                          .Add({})),
        pool_reencoded_(prometheus::BuildCounter()
                            .Name("kvtier_worker_speculation_pool_reencoded_layers_total")
                            .Help("Round layers the host pool re-encoded without evicted tokens")
                            .Register(*registry_)
                            .Add({})),
        layer_latency_(&prometheus::BuildHistogram()
                            .Name("kvtier_worker_layer_seconds")
                            .Help("Per-layer attention latency")
                            .Register(*registry_)),
        requests_(&prometheus::BuildCounter()
                       .Name("kvtier_worker_requests_total")
                       .Help("RPCs by method and outcome")
                       .Register(*registry_)),
        transfers_(&prometheus::BuildCounter()
                        .Name("kvtier_worker_transfers_total")
                        .Help("Session hand-offs by direction (sent, received), path and outcome")
                        .Register(*registry_)),
        transfer_bytes_(&prometheus::BuildCounter()
                             .Name("kvtier_worker_transfer_bytes_total")
                             .Help("Payload bytes of completed session hand-offs by direction "
                                   "and path")
                             .Register(*registry_)),
        transfer_reused_(&prometheus::BuildCounter()
                              .Name("kvtier_worker_transfer_reused_bytes_total")
                              .Help("Past rounds' bytes a completed hand-off did not move because "
                                    "the receiver still held them, by direction")
                              .Register(*registry_)),
        nccl_links_(&prometheus::BuildCounter()
                         .Name("kvtier_worker_nccl_links_total")
                         .Help("Hand-offs this worker sent over NCCL that completed, by "
                               "whether they formed a communicator or reused one kept from an "
                               "earlier hand-off to the same receiver")
                         .Register(*registry_)),
        spec_steps_(&prometheus::BuildCounter()
                         .Name("kvtier_worker_speculation_steps_total")
                         .Help("Decode steps that speculated a layer, by layer")
                         .Register(*registry_)),
        spec_kept_(&prometheus::BuildCounter()
                        .Name("kvtier_worker_speculation_tokens_kept_total")
                        .Help("Tokens kept per query head by speculation, summed over steps, by "
                              "layer")
                        .Register(*registry_)),
        spec_bytes_(&prometheus::BuildCounter()
                         .Name("kvtier_worker_speculation_bytes_total")
                         .Help("K/V bytes read by speculating layers (kind=speculative) and what "
                               "dense attention would have read (kind=dense)")
                         .Register(*registry_)),
        spec_sampled_(&prometheus::BuildCounter()
                           .Name("kvtier_worker_speculation_hit_samples_total")
                           .Help("Decode steps whose speculation hit rate was measured, by layer")
                           .Register(*registry_)),
        spec_hit_(&prometheus::BuildCounter()
                       .Name("kvtier_worker_speculation_hit_rate_sum")
                       .Help("Sum of measured hit rates (divide by the samples), by layer")
                       .Register(*registry_)) {}

  // /metrics, and /healthz and /readyz from `health`.
  absl::StatusOr<int> Serve(const std::string& address, HealthFn health = nullptr) {
    KVT_ASSIGN_OR_RETURN(endpoint_,
                         ServeMetrics(address, {registry_, device_calls_}, std::move(health)));
    return endpoint_.port;
  }
  void Layer(const char* kind, double seconds) {
    static const prometheus::Histogram::BucketBoundaries kBuckets = {
        0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5};
    layer_latency_->Add({{"kind", kind}}, kBuckets).Observe(seconds);
  }
  // One finished RPC, its outcome by RequestOutcome(s).
  void Request(const char* method, const absl::Status& s) {
    requests_->Add({{"method", method}, {"outcome", RequestOutcome(s)}}).Increment();
  }
  void Recall(const worker::RecallReport& r, bool completed) {
    if (completed) {
      fetched_.Increment(static_cast<double>(r.bytes_fetched));
      return;
    }
    recalls_.Increment();
    selected_.Increment(static_cast<double>(r.selected.size()));
    candidates_.Increment(static_cast<double>(r.scores.size()));
  }
  // A hand-off ended: `direction` "sent" or "received", path "grpc",
  // "cuda_ipc" or "nccl"; `bytes` on the wire plus those copied device to device.
  // `reused`: past bytes left out because the receiver held them.
  void Transfer(const char* direction, const std::string& path, bool ok, uint64_t bytes,
                uint64_t reused = 0) {
    transfers_->Add({{"direction", direction}, {"path", path}, {"outcome", ok ? "ok" : "error"}})
        .Increment();
    if (ok) {
      transfer_bytes_->Add({{"direction", direction}, {"path", path}})
          .Increment(static_cast<double>(bytes));
      transfer_reused_->Add({{"direction", direction}}).Increment(static_cast<double>(reused));
    }
  }
  // A hand-off this worker sent ended, by the path it took and its report:
  // Transfer("sent", ...), and for one over NCCL whether it reused a kept
  // communicator (TransferReport.device_link_reused).
  void Sent(const std::string& path, const absl::StatusOr<v1::TransferReport>& report) {
    Transfer("sent", path, report.ok(),
             report.ok() ? report->wire_bytes() + report->device_bytes() : 0,
             report.ok() ? report->reused_bytes() : 0);
    if (report.ok() && report->path() == "nccl") {
      nccl_links_->Add({{"use", report->device_link_reused() ? "reused" : "formed"}}).Increment();
    }
  }
  void HandoffCache(double bytes) { handoff_cache_.Set(bytes); }
  void Stored(uint64_t bytes) { stored_.Increment(static_cast<double>(bytes)); }
  // A round's speculation figures (EndRound), per layer.
  void Speculation(const std::vector<worker::SpeculationLayerStats>& layers) {
    for (size_t l = 0; l < layers.size(); ++l) {
      const worker::SpeculationLayerStats& x = layers[l];
      if (x.steps == 0) continue;
      const std::string layer = std::to_string(l);
      spec_steps_->Add({{"layer", layer}}).Increment(static_cast<double>(x.steps));
      spec_kept_->Add({{"layer", layer}}).Increment(static_cast<double>(x.kept));
      spec_bytes_->Add({{"kind", "speculative"}})
          .Increment(static_cast<double>(x.bytes_speculative));
      spec_bytes_->Add({{"kind", "dense"}}).Increment(static_cast<double>(x.bytes_dense));
      if (x.sampled > 0) {
        spec_sampled_->Add({{"layer", layer}}).Increment(static_cast<double>(x.sampled));
        spec_hit_->Add({{"layer", layer}}).Increment(x.hit_sum);
      }
    }
  }
  // A round's host-pool trim (EndRound).
  void Pool(const worker::PoolTrim& t) {
    pool_evicted_.Increment(static_cast<double>(t.evicted_tokens));
    pool_reencoded_.Increment(static_cast<double>(t.reencoded_layers));
  }
  void WorkingSet(double bytes) { working_set_.Set(bytes); }
  void Sessions(double n) { sessions_.Set(n); }
  void Budget(double bytes) { budget_.Set(bytes); }
  std::string Render() const;

 private:
  // kvtier_worker_device_call*: the device calls' running totals
  // (worker::DeviceCallTimes), read at each scrape.
  class DeviceCalls : public prometheus::Collectable {
   public:
    std::vector<prometheus::MetricFamily> Collect() const override;
  };

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<DeviceCalls> device_calls_ = std::make_shared<DeviceCalls>();
  prometheus::Gauge& working_set_;
  prometheus::Gauge& sessions_;
  prometheus::Gauge& handoff_cache_;
  prometheus::Gauge& budget_;
  prometheus::Counter &recalls_, &selected_, &candidates_, &fetched_, &stored_, &pool_evicted_,
      &pool_reencoded_;
  prometheus::Family<prometheus::Histogram>* layer_latency_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Counter>*transfers_, *transfer_bytes_, *transfer_reused_;
  prometheus::Family<prometheus::Counter>* nccl_links_;
  prometheus::Family<prometheus::Counter>*spec_steps_, *spec_kept_, *spec_bytes_, *spec_sampled_,
      *spec_hit_;
  MetricsEndpoint endpoint_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_WORKER_WORKER_METRICS_H_
