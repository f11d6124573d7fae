// Per-tenant bearer tokens. A tenants file lists one token per line:
//
//   # token            tenant   role        quota_bytes (optional, 0 = none)
//   alice-secret-1     alice    readwrite   10737418240
//   alice-reader       alice    readonly
//   worker-7-secret    worker7  node
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
  std::string caller;
};

struct TenantEntry {
  std::string token;
  Principal principal;
  uint64_t quota_bytes = 0;
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
  // UNAUTHENTICATED when the metadata is missing or the token unknown (auth
  // on); PERMISSION_DENIED when a non-node token names a tenant;
  // INVALID_ARGUMENT when the named tenant breaks the naming rule.
  absl::StatusOr<Principal> Authenticate(const grpc::ServerContextBase& ctx) const;
  // PERMISSION_DENIED unless the principal may write.
  static absl::Status RequireWrite(const Principal& p);

  bool enabled() const { return enabled_; }
  // Distinct tenants whose tokens may write (readwrite or node); 1 when
  // authentication is off.
  int WritingTenants() const;
  const std::vector<TenantEntry>& entries() const { return entries_; }

 private:
  // The token's own principal, before delegation.
  absl::StatusOr<Principal> Caller(const grpc::ServerContextBase& ctx) const;

  bool enabled_ = false;
  std::vector<TenantEntry> entries_;
  absl::flat_hash_map<std::string, Principal> by_token_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_COMMON_AUTH_H_
