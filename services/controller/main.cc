// kvtier-controller: cluster membership and session placement.
//
// Every flag can also come from a config file: --flagfile=FILE holds one
// "--flag=value" per line.
#include <algorithm>
#include <cstdio>
#include <optional>

#include "absl/flags/flag.h"
#include "absl/strings/str_split.h"
#include "base/command_line.h"
#include "base/log.h"
#include "services/common/serve_main.h"
#include "services/common/server_credentials.h"
#include "services/common/server_flags.h"
#include "services/controller/controller_server.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7072", "gRPC listen address (port 0 picks one).");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9472",
          "Prometheus /metrics address; empty disables it.");
ABSL_FLAG(int, heartbeat_interval_ms, 1000, "How often nodes must report.");
ABSL_FLAG(int, missed_heartbeats, 3, "Heartbeats a node may miss before it is declared dead.");
ABSL_FLAG(int, warmup_seconds, 30,
          "A (re)joined node's share of new placements grows from 10% to all of it over this.");
ABSL_FLAG(int, replicas, 1, "Store replicas per session (1 to 3).");
ABSL_FLAG(int, placement_idle_hours, 24, "Forget placements unused this long.");
ABSL_FLAG(std::string, store_token, "",
          "A node token for the stores, used by repair to copy rounds between them.");
ABSL_FLAG(std::string, store_tls_root_certs, "", "PEM file of the stores' CA; empty: plaintext.");
ABSL_FLAG(std::string, tls_client_cert, "",
          "PEM certificate chain the controller presents to stores that require client "
          "certificates (repairs); with --tls_client_key.");
ABSL_FLAG(std::string, tls_client_key, "", "PEM private key of --tls_client_cert.");
ABSL_FLAG(int, repair_parallelism, 2, "Sessions repaired at once.");
ABSL_FLAG(int, repair_mb_per_s, 64, "Bandwidth cap of all repairs together, MiB/s; 0: none.");
ABSL_FLAG(std::string, state_dir, "",
          "Directory for registered model policies (kept across restarts); empty: memory only.");
ABSL_FLAG(double, pressure_moderate, 0.80,
          "Used/capacity at which a node's pressure is MODERATE (cold sessions get tighter "
          "policies).");
ABSL_FLAG(double, pressure_high, 0.95,
          "Used/capacity at which a node's pressure is HIGH (stores also drop never-recalled "
          "rounds of cold sessions).");
ABSL_FLAG(int, cold_after_seconds, 60, "A session idle this long is cold.");
ABSL_FLAG(std::string, etcd, "",
          "etcd client URLs (http://host:2379,...): the etcd back end, for several controller "
          "replicas. Empty: the embedded back end.");
ABSL_FLAG(std::string, etcd_prefix, "/kvtier", "Key prefix of this cluster in etcd.");
ABSL_FLAG(std::string, replica_id, "",
          "This replica's name in the leader election; empty: its listen address.");

int main(int argc, char** argv) {
  kvtier::ParseKvtierCommandLine(
      argc, argv,
      "kvtier-controller [--listen=ADDR] [--replicas=R] [--tenants_file=FILE] ...\n"
      "Serves kvtier.v1.Controller: node membership with leases, and session placement on\n"
      "workers and store replicas (docs/cluster.md).");
  const std::optional<kvtier::ServerFlags> flags = kvtier::ReadServerFlags("kvtier-controller");
  if (!flags) return 2;
  kvtier::ControllerServerOptions o;
  o.listen = absl::GetFlag(FLAGS_listen);
  o.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  flags->ApplyTo(&o);
  o.controller.membership.heartbeat_interval =
      absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_interval_ms));
  o.controller.membership.missed_heartbeats = absl::GetFlag(FLAGS_missed_heartbeats);
  o.controller.membership.warmup = absl::Seconds(absl::GetFlag(FLAGS_warmup_seconds));
  o.controller.replicas = absl::GetFlag(FLAGS_replicas);
  o.controller.membership.pressure_moderate = absl::GetFlag(FLAGS_pressure_moderate);
  o.controller.membership.pressure_high = absl::GetFlag(FLAGS_pressure_high);
  o.state_dir = absl::GetFlag(FLAGS_state_dir);
  o.etcd_endpoints = absl::StrSplit(absl::GetFlag(FLAGS_etcd), ',', absl::SkipEmpty());
  o.etcd_prefix = absl::GetFlag(FLAGS_etcd_prefix);
  o.replica_id = absl::GetFlag(FLAGS_replica_id);
  o.policy.cold_after = absl::Seconds(absl::GetFlag(FLAGS_cold_after_seconds));
  o.controller.placement_idle = absl::Hours(absl::GetFlag(FLAGS_placement_idle_hours));
  o.repair.store_token = absl::GetFlag(FLAGS_store_token);
  if (const std::string roots = absl::GetFlag(FLAGS_store_tls_root_certs); !roots.empty()) {
    absl::StatusOr<std::string> pem = kvtier::ReadFileToString(roots);
    if (!pem.ok()) {
      std::fprintf(stderr, "kvtier-controller: --store_tls_root_certs: %s\n",
                   pem.status().ToString().c_str());
      return 2;
    }
    o.repair.store_tls_root_certs = *pem;
  }
  if (absl::GetFlag(FLAGS_tls_client_cert).empty() != absl::GetFlag(FLAGS_tls_client_key).empty()) {
    std::fprintf(stderr, "kvtier-controller: --tls_client_cert and --tls_client_key go together\n");
    return 2;
  }
  if (!absl::GetFlag(FLAGS_tls_client_cert).empty()) {
    absl::StatusOr<std::string> cert =
        kvtier::ReadFileToString(absl::GetFlag(FLAGS_tls_client_cert));
    absl::StatusOr<std::string> key = kvtier::ReadFileToString(absl::GetFlag(FLAGS_tls_client_key));
    if (!cert.ok() || !key.ok()) {
      std::fprintf(stderr, "kvtier-controller: %s\n",
                   (!cert.ok() ? cert.status() : key.status()).ToString().c_str());
      return 2;
    }
    o.repair.store_tls_cert_chain = *cert;
    o.repair.store_tls_private_key = *key;
  }
  o.repair.parallelism = absl::GetFlag(FLAGS_repair_parallelism);
  o.repair.max_bytes_per_second =
      static_cast<uint64_t>(std::max(0, absl::GetFlag(FLAGS_repair_mb_per_s))) << 20;
  return kvtier::ServeUntilSignal<kvtier::ControllerServer>(
      "kvtier-controller", [&o] { return kvtier::ControllerServer::Start(o); }, flags->port_file,
      flags->metrics_port_file);
}
