// The flags every kvtier server shares, defined once: TLS (--tls_cert,
// --tls_key, --tls_client_ca), authentication (--tenants_file,
// --allow_unauthenticated), --log_level, and where the bound ports are
// written (--port_file, --metrics_port_file). --listen and --metrics_listen
// stay in each binary's main.cc: their defaults differ.
#ifndef KVTIER_SERVICES_COMMON_SERVER_FLAGS_H_
#define KVTIER_SERVICES_COMMON_SERVER_FLAGS_H_

#include <optional>
#include <string>

namespace kvtier {

struct ServerFlags {
  std::string tls_cert, tls_key, tls_client_ca;
  std::string tenants_file;
  bool allow_unauthenticated = false;
  std::string port_file, metrics_port_file;

  // Copies the TLS and authentication flags into a server's options (the
  // Store, Worker and ControllerServerOptions name them alike).
  template <typename Options>
  void ApplyTo(Options* o) const {
    o->tls_cert = tls_cert;
    o->tls_key = tls_key;
    o->tls_client_ca = tls_client_ca;
    o->tenants_file = tenants_file;
    o->allow_unauthenticated = allow_unauthenticated;
  }
};

// Reads the shared flags (after ParseKvtierCommandLine) and sets the log
// level from --log_level. nullopt, with "PROGRAM: --log_level must be ..."
// on stderr, when --log_level is not a level: the caller exits 2.
std::optional<ServerFlags> ReadServerFlags(const char* program);

}  // namespace kvtier

#endif  // KVTIER_SERVICES_COMMON_SERVER_FLAGS_H_
