// Per-tenant bearer tokens. A tenants file lists one token per line:
//
//   # token            tenant   role        quota_bytes (optional, 0 = none)
//   alice-secret-1     alice    readwrite   10737418240
//   alice-reader       alice    readonly
//   worker-7-secret    worker7  node
//   bob-secret-0001    bob      readwrite   0   max_sessions=64 max_working_set_mb=2048
//
// After the optional quota, `key=value` limits may follow; the same tenant's
// limits may sit on any of its lines (the largest value of each wins):
//   max_sessions=N        kvtier-worker: sessions the tenant may hold at once
//   max_working_set_mb=N  kvtier-worker: working-set MiB over its sessions
// quota_bytes binds kvtier-store (stored bytes); the worker limits bind
// kvtier-worker. 0 or absent: no per-tenant limit.
//
// A node token may be bound to the one node that holds it:
//   store-0-secret     store-0  node   node_id=store-0 node_kind=store
// kvtier-controller then takes Register and Heartbeat with that token only
// for that node id and kind, and no other token may Register or Heartbeat
// that id (PERMISSION_DENIED), so a node that leaks its token cannot be
// impersonated by the holder of another. Several tokens may be bound to one
// node (to rotate them), all as the same kind. An unbound node token may act for
// any node id that no token is bound to (one token shared by a whole
// cluster); the controller warns at start when it has any.
//
// A line whose token is "cert:NAME" names a client certificate instead of a
// token: on a server that requires client certificates (mutual TLS,
// --tls_client_ca), a caller without a bearer token whose verified
// certificate has NAME among its subject alternative names (or as its
// common name, when it has none) is that line's principal. So a node's
// certificate is its identity, bound with node_id= like a token:
//   cert:store-0.kvtier   store-0  node  node_id=store-0 node_kind=store
// A bearer token never matches a cert: line.
//
// Callers send "authorization: Bearer <token>" metadata. Tenant names follow
// the session-name rule (base/names.h). Without a tenants file authentication
// is off and every caller is tenant "default" with role readwrite (for a
// single-user box; the server logs a warning).
//
// Delegation: a kvtier service that acts for its own callers (a worker
// writing an end tenant's rounds to the store) names that end tenant in
// "kvtier-tenant" metadata. The callee honours it only from a `node` token,
// or when authentication is off; the call then runs as that tenant, with its
// quota and its keys. Any other token naming a tenant is PERMISSION_DENIED.
#ifndef KVTIER_SERVICES_COMMON_AUTH_H_
#define KVTIER_SERVICES_COMMON_AUTH_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "grpcpp/server_context.h"

namespace kvtier {

// kNode: readwrite for itself, and may act for any end tenant (delegation).
enum class Role { kReadOnly, kReadWrite, kNode };

// Metadata key naming the end tenant a node acts for.
inline constexpr char kTenantMetadata[] = "kvtier-tenant";

struct Principal {
  // Whose keys, quota and data the call uses: the token's tenant, or the end
  // tenant a node acts for.
  std::string tenant;
  Role role = Role::kReadWrite;
  // The tenant of the token that made the call (== tenant unless a node
  // delegates): the one that shares of the service's own resources, such as
  // upload buffers, are charged to.
  std::string caller{};
  // For a node token bound to one node (node_id=, node_kind=): that node's
  // id and kind ("worker" or "store"); empty otherwise.
  std::string node_id{};
  std::string node_kind{};
};

struct TenantLimits {
  int max_sessions = 0;                // 0: none.
  uint64_t max_working_set_bytes = 0;  // 0: none.
};

struct TenantEntry {
  std::string token;
  Principal principal;
  uint64_t quota_bytes = 0;
  TenantLimits limits;
};

// Immutable after construction; thread-safe.
class Authenticator {
 public:
  // Authentication off: everyone is tenant "default".
  Authenticator() = default;
  explicit Authenticator(std::vector<TenantEntry> entries);

  // Parses a tenants file. INVALID_ARGUMENT with the line number on a bad
  // line or a duplicate token; NOT_FOUND when the file cannot be read.
  static absl::StatusOr<Authenticator> FromFile(const std::string& path);
  static absl::StatusOr<Authenticator> FromText(const std::string& text);

  // The caller's principal: the token's tenant, or the delegated end tenant
  // (readwrite) when a node token or auth-off caller names one.
  // UNAUTHENTICATED when the metadata is missing (and no verified client
  // certificate names a cert: line) or the token unknown (auth on); PERMISSION_DENIED when a
  // non-node token names a tenant; INVALID_ARGUMENT when the named tenant breaks the naming rule.
  absl::StatusOr<Principal> Authenticate(const grpc::ServerContextBase& ctx) const;
  // PERMISSION_DENIED unless the principal may write.
  static absl::Status RequireWrite(const Principal& p);

  bool enabled() const { return enabled_; }
  // Per-tenant worker limits, merged over each tenant's lines.
  std::map<std::string, TenantLimits> Limits() const;
  // Distinct tenants whose tokens may write (readwrite or node); 1 when
  // authentication is off.
  int WritingTenants() const;
  // OK when `p` may Register or Heartbeat node `node_id` of `kind`
  // ("worker" or "store"; empty: any kind): authentication is off, or p is
  // a node whose token is bound to exactly that id and kind, or p's token
  // is unbound and
  // no token is bound to that id. PERMISSION_DENIED naming both otherwise.
  absl::Status RequireNodeIdentity(const Principal& p, const std::string& node_id,
                                   const std::string& kind) const;
  // Node tokens not bound to a node id (they may act as any unbound node).
  int UnboundNodeTokens() const;
  const std::vector<TenantEntry>& entries() const { return entries_; }

 private:
  // The token's own principal, before delegation.
  absl::StatusOr<Principal> Caller(const grpc::ServerContextBase& ctx) const;

  bool enabled_ = false;
  std::vector<TenantEntry> entries_;
  absl::flat_hash_map<std::string, Principal> by_token_;
  // cert: lines, by certificate name.
  absl::flat_hash_map<std::string, Principal> by_cert_;
  // node_id= bindings: node id -> its kind.
  absl::flat_hash_map<std::string, std::string> bound_nodes_;
};

// Authentication is on by default outside loopback: OK when `listen` is a
// loopback address (127.0.0.0/8, ::1, localhost, unix:), when a tenants file
// is set, or when the operator said --allow_unauthenticated; otherwise
// FAILED_PRECONDITION saying how to fix it.
absl::Status CheckListenAuth(const std::string& listen, bool has_tenants_file,
                             bool allow_unauthenticated);

// What a server starts with: CheckListenAuth, then the tenants file's
// authenticator, or authentication off (logged as a warning) without one.
absl::StatusOr<Authenticator> ServerAuthenticator(const std::string& listen,
                                                  const std::string& tenants_file,
                                                  bool allow_unauthenticated);

}  // namespace kvtier

#endif  // KVTIER_SERVICES_COMMON_AUTH_H_
