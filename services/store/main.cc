// kvtier-store: the round-granular KV store service.
//
// Every flag can also come from a config file: --flagfile=FILE holds one
// "--flag=value" per line (deploy/kvtier-store.conf is the documented
// example).
#include <csignal>
#include <cstdio>
#include <fstream>
#include <optional>

#include "absl/flags/flag.h"
#include "base/command_line.h"
#include "base/log.h"
#include "base/memory.h"
#include "services/common/cluster_flags.h"
#include "services/common/serve_main.h"
#include "services/common/server_flags.h"
#include "services/store/store_server.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7070",
          "gRPC listen address; port 0 picks a free port (see --port_file).");
ABSL_FLAG(std::string, data_dir, "", "RocksDB directory (created if missing). Required.");
ABSL_FLAG(uint64_t, ram_budget_mb, 1024, "RAM tier budget in MiB.");
ABSL_FLAG(uint64_t, disk_budget_mb, 0, "RocksDB tier budget in MiB; 0 = unlimited.");
ABSL_FLAG(std::string, spill_policy, "counter",
          "Which RAM segments spill first: 'counter' (fewest recalls among the older half) "
          "or 'lru'.");
ABSL_FLAG(bool, sync_writes, true, "fsync the WAL before acknowledging a PutSegment.");
ABSL_FLAG(uint32_t, spare_payload_files, 32,
          "Empty payload files kept ready for large puts (0 = none): a put then does not wait "
          "for a new file's directory entry to become durable.");
ABSL_FLAG(uint64_t, recycle_payload_mb, 1024,
          "MiB of dropped segments' payload files kept to be overwritten in place by later "
          "puts (0 = none). Beyond --disk_budget_mb. Without --sync_writes, the first put "
          "that could reuse a released file syncs the WAL once for all released before it.");
ABSL_FLAG(uint32_t, promote_after_reads, 2,
          "Promote a spilled segment into RAM after this many disk reads; 0 = never.");
ABSL_FLAG(uint64_t, max_segment_mb, 256, "Largest accepted segment payload in MiB.");
ABSL_FLAG(uint64_t, max_inflight_upload_mb, 4096,
          "Payload MiB that PutSegment uploads in flight may declare together.");
ABSL_FLAG(uint64_t, tenant_inflight_upload_mb, 0,
          "Each tenant's share of --max_inflight_upload_mb (charged to the calling token's "
          "tenant); 0 = that budget divided by the tenants that may write, so no tenant's uploads "
          "can push another's into RESOURCE_EXHAUSTED.");
ABSL_FLAG(int, upload_idle_timeout_ms, 10000,
          "Cancel a PutSegment stream that sends nothing for this long and refund its share; "
          "0 = never.");
ABSL_FLAG(uint64_t, max_get_mb, 2048,
          "Most payload MiB one GetSegments call may stream (OUT_OF_RANGE above).");
ABSL_FLAG(uint32_t, default_ttl_seconds, 7 * 24 * 3600,
          "TTL (after the last access) of sessions that set none, so that sessions nobody closes "
          "do not stay forever; 0 = such sessions never expire. A session that sets 0 itself "
          "never expires.");
ABSL_FLAG(int, ttl_sweep_seconds, 10, "Seconds between TTL sweeps; 0 disables them.");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9470",
          "Prometheus /metrics address; empty disables it.");
ABSL_FLAG(int, executor_threads, 8, "Threads for blocking store work (RocksDB, fsync).");

int main(int argc, char** argv) {
  kvtier::TuneAllocatorForLargeBuffers();
  kvtier::ParseKvtierCommandLine(
      argc, argv,
      "kvtier-store --data_dir=DIR [--listen=ADDR] [--flagfile=FILE] ...\n"
      "Serves the kvtier.v1.Store gRPC API over a RAM tier backed by RocksDB.");

  const std::optional<kvtier::ServerFlags> flags = kvtier::ReadServerFlags("kvtier-store");
  if (!flags) return 2;

  kvtier::StoreServerOptions o;
  o.listen = absl::GetFlag(FLAGS_listen);
  o.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  flags->ApplyTo(&o);
  o.cluster = kvtier::ClusterOptionsFromFlags();
  o.executor_threads = absl::GetFlag(FLAGS_executor_threads);
  o.ttl_sweep_seconds = absl::GetFlag(FLAGS_ttl_sweep_seconds);
  o.store.path = absl::GetFlag(FLAGS_data_dir);
  o.store.ram_budget_bytes = absl::GetFlag(FLAGS_ram_budget_mb) << 20;
  o.store.disk_budget_bytes = absl::GetFlag(FLAGS_disk_budget_mb) << 20;
  o.store.sync_writes = absl::GetFlag(FLAGS_sync_writes);
  o.store.spare_payload_files = absl::GetFlag(FLAGS_spare_payload_files);
  o.store.recycle_payload_bytes = absl::GetFlag(FLAGS_recycle_payload_mb) << 20;
  o.store.promote_after_disk_reads = absl::GetFlag(FLAGS_promote_after_reads);
  o.store.max_segment_bytes = absl::GetFlag(FLAGS_max_segment_mb) << 20;
  o.store.default_ttl_seconds = absl::GetFlag(FLAGS_default_ttl_seconds);
  o.service.max_inflight_upload_bytes = absl::GetFlag(FLAGS_max_inflight_upload_mb) << 20;
  o.service.tenant_inflight_upload_bytes = absl::GetFlag(FLAGS_tenant_inflight_upload_mb) << 20;
  o.service.upload_idle_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_upload_idle_timeout_ms));
  o.service.max_get_bytes = absl::GetFlag(FLAGS_max_get_mb) << 20;
  const std::string policy = absl::GetFlag(FLAGS_spill_policy);
  if (policy == "counter") {
    o.store.spill_policy = kvtier::cachestore::SpillPolicy::kCounter;
  } else if (policy == "lru") {
    o.store.spill_policy = kvtier::cachestore::SpillPolicy::kLru;
  } else {
    std::fprintf(stderr, "kvtier-store: --spill_policy must be 'counter' or 'lru'\n");
    return 2;
  }
  if (o.store.path.empty()) {
    std::fprintf(stderr, "kvtier-store: --data_dir is required\n");
    return 2;
  }

  return kvtier::ServeUntilSignal<kvtier::StoreServer>(
      "kvtier-store", [&o] { return kvtier::StoreServer::Start(o); }, flags->port_file,
      flags->metrics_port_file);
}
