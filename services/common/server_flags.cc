#include "services/common/server_flags.h"

#include <cstdio>

#include "absl/flags/flag.h"
#include "base/log.h"

ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain; with --tls_key enables TLS.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM file of the CA that signs clients' certificates: with TLS, every client must "
          "present one (mutual TLS), and a tenants-file line cert:NAME names a client by its "
          "certificate (docs/security.md). Empty: no client certificates asked for.");
ABSL_FLAG(std::string, tenants_file, "",
          "Bearer tokens and certificate names per tenant (token tenant role [quota_bytes]; "
          "services/common/auth.h); empty turns authentication off.");
ABSL_FLAG(bool, allow_unauthenticated, false,
          "Listen on a non-loopback address without --tenants_file (every caller is tenant "
          "'default'); without it such a start is refused.");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warn or error.");
ABSL_FLAG(std::string, port_file, "",
          "If set, the bound gRPC port is written here (atomically) once serving.");
ABSL_FLAG(std::string, metrics_port_file, "", "If set, the bound metrics port is written here.");

namespace kvtier {

std::optional<ServerFlags> ReadServerFlags(const char* program) {
  LogLevel level;
  if (!ParseLogLevel(absl::GetFlag(FLAGS_log_level), &level)) {
    std::fprintf(stderr, "%s: --log_level must be debug, info, warn or error\n", program);
    return std::nullopt;
  }
  SetLogLevel(level);
  ServerFlags f;
  f.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  f.tls_key = absl::GetFlag(FLAGS_tls_key);
  f.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  f.tenants_file = absl::GetFlag(FLAGS_tenants_file);
  f.allow_unauthenticated = absl::GetFlag(FLAGS_allow_unauthenticated);
  f.port_file = absl::GetFlag(FLAGS_port_file);
  f.metrics_port_file = absl::GetFlag(FLAGS_metrics_port_file);
  return f;
}

}  // namespace kvtier
