// The speculation skews a worker holds (InfiniGen's per-layer skewing
// matrices, kernels/speculation.h), by content: uploaded once, named by an id
// that sessions' policies give (SessionPolicy::speculation.skew).
#ifndef KVTIER_WORKER_SKEW_REGISTRY_H_
#define KVTIER_WORKER_SKEW_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/speculation.h"

namespace kvtier::worker {

// Thread-safe. A skew handed out by Find stays valid for as long as its
// holder keeps the pointer, whatever the registry drops meanwhile.
class SkewRegistry {
 public:
  // At most kMaxSkews skews, and at most kMaxPerTenant that one tenant
  // uploaded; skews of tenant "" (the operator's: --skew_dir) are kept for
  // the registry's life and count against no tenant.
  static constexpr int kMaxSkews = 16;
  static constexpr int kMaxPerTenant = 4;

  SkewRegistry() = default;
  SkewRegistry(const SkewRegistry&) = delete;
  SkewRegistry& operator=(const SkewRegistry&) = delete;

  // Takes a skew file's bytes (kvtier calibrate infinigen; spec::ParseSkew)
  // for `tenant` and returns its id. The same bytes give the same id (Id)
  // and are held once, whoever sent them. When the table or the tenant's
  // share is full, the least recently used skew that no session holds (the
  // tenant's own, when its share is full) is dropped to make room.
  // INVALID_ARGUMENT or DATA_LOSS from parsing; RESOURCE_EXHAUSTED naming
  // the limit when every skew that could go is in use.
  absl::StatusOr<std::string> Put(std::string_view bytes, const std::string& tenant = "");

  // The id Put gives these bytes, without parsing them (the CRC-32C of the
  // content and the size; empty for fewer than 4 bytes): what `kvtier
  // policy set --speculation_skew=FILE` names.
  static std::string Id(std::string_view bytes);

  // The skew Put returned `id` for; null when none is held.
  std::shared_ptr<const spec::SkewModel> Find(const std::string& id) const;

 private:
  struct Entry {
    std::shared_ptr<const spec::SkewModel> model;
    std::string owner;      // The tenant that uploaded it; "": kept.
    uint64_t last_use = 0;  // tick_ when last put or looked up.
  };
  // Drops the least recently used skew that nobody holds, of `owner` when
  // `only_owner`; false when none can go.
  bool EvictLocked(const std::string& owner, bool only_owner) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  mutable std::map<std::string, Entry> skews_ ABSL_GUARDED_BY(mu_);
  mutable uint64_t tick_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvtier::worker

#endif  // KVTIER_WORKER_SKEW_REGISTRY_H_
