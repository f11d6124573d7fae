#include "services/worker/known_nodes.h"

#include "absl/strings/str_cat.h"
#include "base/names.h"

namespace kvtier {

KnownNodes::KnownNodes(KnownNodesOptions options, Lister controller)
    : options_(std::move(options)),
      configured_(options_.configured.begin(), options_.configured.end()),
      controller_(std::move(controller)) {}

absl::Status KnownNodes::Check(const std::vector<std::string>& addresses, const CallOptions& call) {
  std::vector<const std::string*> unknown;
  for (const std::string& a : addresses) {
    if (absl::Status s = ValidateAddress(options_.what, a); !s.ok()) return s;
    if (configured_.count(a) != 0) continue;
    absl::MutexLock lock(&mu_);
    if (listed_.count(a) == 0) unknown.push_back(&a);
  }
  if (unknown.empty()) return absl::OkStatus();
  if (!controller_) {
    if (options_.open_when_unconfigured && configured_.empty()) return absl::OkStatus();
    return absl::PermissionDeniedError(
        absl::StrCat(options_.what, " '", *unknown.front(),
                     "' is not known to this worker (known: ", options_.known_from, ")"));
  }
  // One lookup at a time: concurrent misses wait for it and then read the
  // same answer.
  absl::MutexLock lock(&mu_);
  bool missing = false;
  for (const std::string* a : unknown) missing = missing || listed_.count(*a) == 0;
  if (missing) {
    ++lookups_;
    absl::StatusOr<std::vector<std::string>> now = controller_(call);
    if (!now.ok()) {
      return absl::Status(now.status().code(),
                          absl::StrCat("cannot check ", options_.what,
                                       " with the controller: ", now.status().message()));
    }
    listed_ = std::set<std::string>(now->begin(), now->end());
  }
  for (const std::string* a : unknown) {
    if (listed_.count(*a) == 0) {
      return absl::PermissionDeniedError(
          absl::StrCat(options_.what, " '", *a,
                       "' is not known to this worker (known: ", options_.known_from, ")"));
    }
  }
  return absl::OkStatus();
}

int KnownNodes::lookups() const {
  absl::MutexLock lock(&mu_);
  return lookups_;
}

}  // namespace kvtier
