// kvtier-worker: attention over each session's compressed, recalled working
// set; rounds go to kvtier-store.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/command_line.h"
#include "base/log.h"
#include "base/memory.h"
#include "services/common/cluster_flags.h"
#include "services/common/serve_main.h"
#include "services/common/server_flags.h"
#include "services/worker/worker_server.h"
#include "worker/device/attention.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7071", "gRPC listen address (port 0 picks one).");
ABSL_FLAG(std::string, store, "", "kvtier-store address host:port. Required.");
ABSL_FLAG(std::vector<std::string>, replica_stores, {},
          "Comma-separated HOST:PORT of other kvtier-stores that a session may name as its "
          "replicas (OpenSessionRequest.store_addresses) on a worker without --controller; "
          "with one, the stores the controller lists are allowed too. Any other address is "
          "refused (PERMISSION_DENIED) and never dialled (docs/security.md).");
ABSL_FLAG(std::vector<std::string>, peer_workers, {},
          "Comma-separated HOST:PORT of workers this one may hand sessions to (transfer_to, "
          "SendSession) besides the worker nodes --controller lists; others are refused "
          "(PERMISSION_DENIED). Without --controller and without this list, any target "
          "(hand-offs carry the caller's own token).");
ABSL_FLAG(std::string, store_token, "", "Bearer token for kvtier-store (empty: none).");
ABSL_FLAG(std::string, store_tls_root_certs, "", "PEM file of the store's CA; empty: plaintext.");
ABSL_FLAG(std::string, peer_tls_root_certs, "",
          "PEM file of the CA of the other workers' certificates, for hand-offs to them "
          "(SendSession, Prefill with transfer_to); empty: plaintext.");
ABSL_FLAG(std::string, peer_tls_server_name, "",
          "Name expected in the other workers' certificates instead of the target's host.");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9471",
          "Prometheus /metrics address; empty disables it.");
ABSL_FLAG(int64_t, store_probe_ms, 2000,
          "How often (and with what deadline) the worker asks --store whether it answers; "
          "while it does not, gRPC health and /readyz say not ready. 0: no probe.");
ABSL_FLAG(int64_t, store_deadline_ms, 10000,
          "Deadline (ms) of the store calls an RPC makes when its caller sent no deadline; a "
          "caller's own deadline is passed on to the store as is.");
ABSL_FLAG(int, compute_threads, 0, "Threads running attention; 0: one per CPU.");
ABSL_FLAG(int, max_sessions, 1024,
          "Sessions held at once; OpenSession past it is RESOURCE_EXHAUSTED. 0: no limit.");
ABSL_FLAG(int64_t, max_working_set_mb, 0,
          "Working-set MiB over all sessions (encoded past rounds plus open rounds at the "
          "model's dtype); a step that would pass it is RESOURCE_EXHAUSTED. 0: no limit.");
ABSL_FLAG(int, tenant_max_sessions, 256,
          "Sessions one tenant may hold at once, unless the tenants file gives it its own "
          "max_sessions; past it OpenSession is RESOURCE_EXHAUSTED naming the limit. Applies with "
          "--tenants_file (without one every caller is one tenant). 0: no per-tenant limit.");
ABSL_FLAG(int64_t, tenant_max_working_set_mb, 4096,
          "Working-set MiB one tenant's sessions (and hand-offs arriving for it) may hold, unless "
          "the tenants file gives it its own max_working_set_mb; a step past it is "
          "RESOURCE_EXHAUSTED. Applies with --tenants_file. 0: no per-tenant limit.");
ABSL_FLAG(int, skew_uploads_per_tenant, 4,
          "PutSkew streams one tenant may have open at once (RESOURCE_EXHAUSTED past it); "
          "applies with --tenants_file. 0: no limit.");
ABSL_FLAG(int64_t, skew_upload_mb_per_tenant, 256,
          "MiB one tenant's PutSkew streams may hold together while they arrive "
          "(RESOURCE_EXHAUSTED past it); applies with --tenants_file. 0: no limit.");
ABSL_FLAG(int64_t, skew_upload_idle_ms, 30000,
          "A PutSkew stream that waits this long for its client's next message is ended "
          "(DEADLINE_EXCEEDED). 0: never.");
ABSL_FLAG(int64_t, handoff_cache_mb, 512,
          "MiB of past rounds kept for sessions handed off to another worker, so that when one "
          "comes back only its new rounds travel (docs/transfer.md#incremental-hand-off); not "
          "part of the working set. 0: off.");
ABSL_FLAG(int, io_threads, 8, "Threads running the RPCs that reach the store.");
ABSL_FLAG(std::string, role, "both",
          "both, prefill or decode: a prefill worker refuses Decode, a decode worker refuses "
          "Prefill; sessions move between them by hand-off (docs/transfer.md).");
ABSL_FLAG(std::string, skew_dir, "",
          "Directory of skew files (kvtier calibrate infinigen) to load at start, every "
          "regular file in it; sessions whose policy names one speculate without an upload.");
ABSL_FLAG(std::string, device_transfer, "auto",
          "How hand-offs of sessions on the GPU move their past rounds: auto (device to device: "
          "CUDA IPC when sender and receiver share a GPU from two processes, NCCL between two "
          "GPUs when both builds have NCCL; gRPC otherwise) or grpc (always over the stream).");
ABSL_FLAG(std::string, placement, "auto",
          "Where working sets live: auto (the GPU when this build has CUDA and a device is "
          "visible, for raw/KIVI/KCVT sessions; host memory otherwise), host, or device "
          "(sessions that cannot be placed on the GPU are refused).");
ABSL_FLAG(int64_t, ipc_pack_mib, 256,
          "CUDA IPC hand-offs from this worker: MiB of a hand-off's round layers copied into a "
          "few shared allocations, so that the receiver opens one handle for many (0: off, a "
          "handle per round layer). Held on the GPU until the receiver answers "
          "(docs/transfer.md).");
ABSL_FLAG(int64_t, device_cache_mib, 512,
          "Freed GPU memory kept for reuse, MiB (0: every free goes back to CUDA). cudaMalloc and "
          "cudaFree cost more than most copies of a round's layer; the cache is emptied when an "
          "allocation finds the device full (docs/gpu.md, \"Device memory\").");

namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

int main(int argc, char** argv) {
  // Recalled segments, hand-offs and EndRound payloads are large buffers:
  // reuse freed heap for them instead of faulting in fresh mappings.
  kvtier::TuneAllocatorForLargeBuffers();
  kvtier::ParseKvtierCommandLine(
      argc, argv,
      "kvtier-worker --store=HOST:PORT [--listen=ADDR] ...\n"
      "Serves the kvtier.v1.Worker gRPC API: attention over compressed, recalled working sets.");
  const std::optional<kvtier::ServerFlags> flags = kvtier::ReadServerFlags("kvtier-worker");
  if (!flags) return 2;
  kvtier::WorkerServerOptions o;
  o.listen = absl::GetFlag(FLAGS_listen);
  o.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  flags->ApplyTo(&o);
  o.cluster = kvtier::ClusterOptionsFromFlags();
  if (absl::GetFlag(FLAGS_store_deadline_ms) < 1) {
    std::fprintf(stderr, "kvtier-worker: --store_deadline_ms must be at least 1\n");
    return 2;
  }
  o.service.store_deadline = absl::Milliseconds(absl::GetFlag(FLAGS_store_deadline_ms));
  if (absl::GetFlag(FLAGS_store_probe_ms) < 0) {
    std::fprintf(stderr, "kvtier-worker: --store_probe_ms must be 0 (off) or more\n");
    return 2;
  }
  o.store_probe_interval = absl::Milliseconds(absl::GetFlag(FLAGS_store_probe_ms));
  o.compute_threads = absl::GetFlag(FLAGS_compute_threads);
  if (absl::GetFlag(FLAGS_max_sessions) < 0 || absl::GetFlag(FLAGS_max_working_set_mb) < 0 ||
      absl::GetFlag(FLAGS_handoff_cache_mb) < 0) {
    std::fprintf(stderr,
                 "kvtier-worker: --max_sessions, --max_working_set_mb and --handoff_cache_mb must "
                 "be >= 0\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_tenant_max_sessions) < 0 ||
      absl::GetFlag(FLAGS_tenant_max_working_set_mb) < 0) {
    std::fprintf(stderr,
                 "kvtier-worker: --tenant_max_sessions and --tenant_max_working_set_mb must be "
                 ">= 0\n");
    return 2;
  }
  o.engine.default_tenant_limit.max_sessions = absl::GetFlag(FLAGS_tenant_max_sessions);
  o.engine.default_tenant_limit.max_working_set_bytes =
      static_cast<uint64_t>(absl::GetFlag(FLAGS_tenant_max_working_set_mb)) << 20;
  if (absl::GetFlag(FLAGS_skew_uploads_per_tenant) < 0 ||
      absl::GetFlag(FLAGS_skew_upload_mb_per_tenant) < 0 ||
      absl::GetFlag(FLAGS_skew_upload_idle_ms) < 0) {
    std::fprintf(stderr,
                 "kvtier-worker: --skew_uploads_per_tenant, --skew_upload_mb_per_tenant and "
                 "--skew_upload_idle_ms must be >= 0\n");
    return 2;
  }
  o.service.skew_uploads_per_tenant = absl::GetFlag(FLAGS_skew_uploads_per_tenant);
  o.service.skew_upload_bytes_per_tenant =
      static_cast<uint64_t>(absl::GetFlag(FLAGS_skew_upload_mb_per_tenant)) << 20;
  o.service.skew_upload_idle = absl::Milliseconds(absl::GetFlag(FLAGS_skew_upload_idle_ms));
  o.engine.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  o.engine.max_working_set_bytes = static_cast<uint64_t>(absl::GetFlag(FLAGS_max_working_set_mb))
                                   << 20;
  o.engine.handoff_cache_bytes = static_cast<uint64_t>(absl::GetFlag(FLAGS_handoff_cache_mb)) << 20;
  o.io_threads = absl::GetFlag(FLAGS_io_threads);
  o.store.target = absl::GetFlag(FLAGS_store);
  o.store.token = absl::GetFlag(FLAGS_store_token);
  o.replica_stores = absl::GetFlag(FLAGS_replica_stores);
  o.peer_workers = absl::GetFlag(FLAGS_peer_workers);
  o.store.tls_cert_chain = o.cluster.tls_cert_chain;  // --tls_client_cert: its identity.
  o.store.tls_private_key = o.cluster.tls_private_key;
  o.service.peer_tls_cert_chain = o.cluster.tls_cert_chain;
  o.service.peer_tls_private_key = o.cluster.tls_private_key;
  if (!absl::GetFlag(FLAGS_store_tls_root_certs).empty()) {
    o.store.tls_root_certs = ReadFile(absl::GetFlag(FLAGS_store_tls_root_certs));
  }
  if (const std::string f = absl::GetFlag(FLAGS_peer_tls_root_certs); !f.empty()) {
    o.service.peer_tls_root_certs = ReadFile(f);
    if (o.service.peer_tls_root_certs.empty()) {
      std::fprintf(stderr, "kvtier-worker: --peer_tls_root_certs=%s is missing or empty\n",
                   f.c_str());
      return 2;
    }
  }
  o.service.peer_tls_server_name = absl::GetFlag(FLAGS_peer_tls_server_name);
  const std::string role = absl::GetFlag(FLAGS_role);
  using Role = kvtier::WorkerServiceOptions::Role;
  if (role == "both") {
    o.service.role = Role::kBoth;
  } else if (role == "prefill") {
    o.service.role = Role::kPrefill;
  } else if (role == "decode") {
    o.service.role = Role::kDecode;
  } else {
    std::fprintf(stderr, "kvtier-worker: --role must be both, prefill or decode\n");
    return 2;
  }
  const std::string device_transfer = absl::GetFlag(FLAGS_device_transfer);
  if (device_transfer != "auto" && device_transfer != "grpc") {
    std::fprintf(stderr, "kvtier-worker: --device_transfer must be auto or grpc\n");
    return 2;
  }
  o.engine.device_transfer = device_transfer == "auto";
  const std::string placement = absl::GetFlag(FLAGS_placement);
  using Placement = kvtier::worker::EngineOptions::Placement;
  if (placement == "auto") {
    o.engine.placement = Placement::kAuto;
  } else if (placement == "host") {
    o.engine.placement = Placement::kHost;
  } else if (placement == "device") {
    o.engine.placement = Placement::kDevice;
    if (absl::Status s = kvtier::worker::DeviceStatus(); !s.ok()) {
      std::fprintf(stderr, "kvtier-worker: --placement=device, but %s\n",
                   std::string(s.message()).c_str());
      return 2;
    }
  } else {
    std::fprintf(stderr, "kvtier-worker: --placement must be auto, host or device\n");
    return 2;
  }
  const int64_t device_cache_mib = absl::GetFlag(FLAGS_device_cache_mib);
  if (device_cache_mib < 0) {
    std::fprintf(stderr, "kvtier-worker: --device_cache_mib must be 0 or more\n");
    return 2;
  }
  kvtier::worker::SetDeviceCacheBytes(static_cast<size_t>(device_cache_mib) << 20);
  const int64_t ipc_pack_mib = absl::GetFlag(FLAGS_ipc_pack_mib);
  if (ipc_pack_mib < 0) {
    std::fprintf(stderr, "kvtier-worker: --ipc_pack_mib must be 0 or more\n");
    return 2;
  }
  o.engine.ipc_pack_bytes = static_cast<uint64_t>(ipc_pack_mib) << 20;
  kvtier::LogInfo("working sets", {{"placement", placement},
                                   {"device", kvtier::worker::DeviceUsable() ? "cuda" : "none"}});
  if (o.engine.placement != Placement::kHost && kvtier::worker::DeviceUsable()) {
    // Now rather than in the first session's request (about 0.1 s).
    const absl::Time start = absl::Now();
    if (absl::Status s = kvtier::worker::WarmDevice(o.engine.device_transfer); s.ok()) {
      kvtier::LogInfo("device ready", {{"ms", absl::ToDoubleMilliseconds(absl::Now() - start)}});
    } else {
      kvtier::LogWarn("device not ready at start", {{"error", s.ToString()}});
    }
  }
  if (o.store.target.empty()) {
    std::fprintf(stderr, "kvtier-worker: --store is required\n");
    return 2;
  }
  if (const std::string dir = absl::GetFlag(FLAGS_skew_dir); !dir.empty()) {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      if (e.is_regular_file()) o.skew_files.push_back(e.path().string());
    }
    if (ec) {
      std::fprintf(stderr, "kvtier-worker: --skew_dir %s: %s\n", dir.c_str(), ec.message().c_str());
      return 2;
    }
    std::sort(o.skew_files.begin(), o.skew_files.end());
  }
  return kvtier::ServeUntilSignal<kvtier::WorkerServer>(
      "kvtier-worker", [&o] { return kvtier::WorkerServer::Start(o); }, flags->port_file,
      flags->metrics_port_file);
}
