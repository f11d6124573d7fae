// Per-tenant byte quotas, charged in two phases: Reserve() before a write
// returns a move-only grant; Commit() turns it into usage, and a grant
// destroyed uncommitted refunds itself.
#ifndef KVTIER_CACHESTORE_QUOTA_H_
#define KVTIER_CACHESTORE_QUOTA_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvtier::cachestore {

class QuotaManager;

// A reservation of `bytes` for one tenant. Move-only.
class QuotaGrant {
 public:
  QuotaGrant() = default;
  QuotaGrant(QuotaGrant&& other) noexcept { *this = std::move(other); }
  QuotaGrant& operator=(QuotaGrant&& other) noexcept;
  ~QuotaGrant();

  // Turns the reservation into committed usage. REQUIRES: valid().
  void Commit();
  bool valid() const { return manager_ != nullptr; }
  uint64_t bytes() const { return bytes_; }

 private:
  friend class QuotaManager;
  QuotaGrant(QuotaManager* m, std::string tenant, uint64_t bytes)
      : manager_(m), tenant_(std::move(tenant)), bytes_(bytes) {}
  QuotaManager* manager_ = nullptr;
  std::string tenant_;
  uint64_t bytes_ = 0;
};

struct TenantUsage {
  uint64_t used_bytes = 0;      // Committed.
  uint64_t reserved_bytes = 0;  // Reserved, not yet committed.
  uint64_t quota_bytes = 0;     // 0 = unlimited.
};

// Thread-safe. Must outlive every grant it handed out.
class QuotaManager {
 public:
  // Sets the tenant's limit; 0 = unlimited. Usage above a lowered limit is
  // kept; only new reservations fail.
  void SetQuota(const std::string& tenant, uint64_t quota_bytes);

  // Returns a grant, or RESOURCE_EXHAUSTED when used + reserved + bytes would
  // exceed the tenant's quota.
  absl::StatusOr<QuotaGrant> Reserve(const std::string& tenant, uint64_t bytes);

  // Adds committed usage without a reservation (recovery at start-up).
  void Charge(const std::string& tenant, uint64_t bytes);
  // Returns committed usage (deletes, drops, expiry).
  void Release(const std::string& tenant, uint64_t bytes);

  TenantUsage Usage(const std::string& tenant) const;

 private:
  friend class QuotaGrant;
  void Settle(const std::string& tenant, uint64_t bytes, bool commit);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, TenantUsage> tenants_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier::cachestore

#endif  // KVTIER_CACHESTORE_QUOTA_H_
