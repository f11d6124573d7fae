#include "cachestore/quota.h"

#include <cassert>

#include "absl/strings/str_cat.h"

namespace kvtier::cachestore {

QuotaGrant& QuotaGrant::operator=(QuotaGrant&& other) noexcept {
  if (this != &other) {
    if (manager_ != nullptr) manager_->Settle(tenant_, bytes_, /*commit=*/false);
    manager_ = other.manager_;
    tenant_ = std::move(other.tenant_);
    bytes_ = other.bytes_;
    other.manager_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

QuotaGrant::~QuotaGrant() {
  if (manager_ != nullptr) manager_->Settle(tenant_, bytes_, /*commit=*/false);
}

void QuotaGrant::Commit() {
  assert(manager_ != nullptr);
  manager_->Settle(tenant_, bytes_, /*commit=*/true);
  manager_ = nullptr;
}

void QuotaManager::SetQuota(const std::string& tenant, uint64_t quota_bytes) {
  absl::MutexLock lock(&mu_);
  tenants_[tenant].quota_bytes = quota_bytes;
}

absl::StatusOr<QuotaGrant> QuotaManager::Reserve(const std::string& tenant, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  TenantUsage& u = tenants_[tenant];
  if (u.quota_bytes != 0 && u.used_bytes + u.reserved_bytes + bytes > u.quota_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("tenant quota exceeded: ", u.used_bytes, " used + ", u.reserved_bytes,
                     " reserved + ", bytes, " requested > ", u.quota_bytes, " bytes"));
  }
  u.reserved_bytes += bytes;
  return QuotaGrant(this, tenant, bytes);
}

void QuotaManager::Charge(const std::string& tenant, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  tenants_[tenant].used_bytes += bytes;
}

void QuotaManager::Release(const std::string& tenant, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  TenantUsage& u = tenants_[tenant];
  assert(u.used_bytes >= bytes);
  u.used_bytes -= std::min(u.used_bytes, bytes);
}

TenantUsage QuotaManager::Usage(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = tenants_.find(tenant);
  return it == tenants_.end() ? TenantUsage{} : it->second;
}

void QuotaManager::Settle(const std::string& tenant, uint64_t bytes, bool commit) {
  absl::MutexLock lock(&mu_);
  TenantUsage& u = tenants_[tenant];
  assert(u.reserved_bytes >= bytes);
  u.reserved_bytes -= bytes;
  if (commit) u.used_bytes += bytes;
}

}  // namespace kvtier::cachestore
