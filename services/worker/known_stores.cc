#include "services/worker/known_stores.h"

#include "absl/strings/str_cat.h"
#include "base/names.h"

namespace kvtier {

KnownStores::KnownStores(std::vector<std::string> configured, Lister controller)
    : configured_(configured.begin(), configured.end()), controller_(std::move(controller)) {}

absl::Status KnownStores::Check(const std::vector<std::string>& addresses,
                                const CallOptions& call) {
  std::vector<const std::string*> unknown;
  for (const std::string& a : addresses) {
    if (absl::Status s = ValidateAddress("store replica address", a); !s.ok()) return s;
    if (configured_.count(a) != 0) continue;
    absl::MutexLock lock(&mu_);
    if (listed_.count(a) == 0) unknown.push_back(&a);
  }
  if (unknown.empty()) return absl::OkStatus();
  if (controller_) {
    // One lookup at a time: concurrent misses wait for it and then read
    // the same answer.
    absl::MutexLock lock(&mu_);
    bool missing = false;
    for (const std::string* a : unknown) missing = missing || listed_.count(*a) == 0;
    if (missing) {
      ++lookups_;
      absl::StatusOr<std::vector<std::string>> now = controller_(call);
      if (!now.ok()) {
        return absl::Status(now.status().code(),
                            absl::StrCat("cannot check store replica addresses with the "
                                         "controller: ",
                                         now.status().message()));
      }
      listed_ = std::set<std::string>(now->begin(), now->end());
    }
    for (const std::string* a : unknown) {
      if (listed_.count(*a) == 0) {
        return absl::PermissionDeniedError(
            absl::StrCat("store replica address '", *a,
                         "' is not a store of this cluster (neither the worker's --store, "
                         "--replica_stores, nor a store node the controller lists)"));
      }
    }
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(
      absl::StrCat("store replica address '", *unknown.front(),
                   "' is neither the worker's --store nor one of its --replica_stores (a "
                   "worker without a controller dials no other store)"));
}

int KnownStores::lookups() const {
  absl::MutexLock lock(&mu_);
  return lookups_;
}

}  // namespace kvtier
