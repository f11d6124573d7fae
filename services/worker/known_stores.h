// The store addresses a worker may dial for a session, and so send its own
// store credentials (the node token) to: its --store, the stores named by
// --replica_stores, and the stores its cluster's controller lists. A request
// that names any other address (OpenSessionRequest.store_addresses, a
// TransferSession header's store_addresses) is refused before any
// connection is made, so that no caller can point the worker, and its node
// token, at a listener of its choosing.
#ifndef KVTIER_SERVICES_WORKER_KNOWN_STORES_H_
#define KVTIER_SERVICES_WORKER_KNOWN_STORES_H_

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "base/call_options.h"

namespace kvtier {

// Thread-safe.
class KnownStores {
 public:
  // The addresses of every store node the controller knows, live or dead.
  using Lister = std::function<absl::StatusOr<std::vector<std::string>>(const CallOptions&)>;

  // `configured`: the worker's --store and --replica_stores. `controller`:
  // the cluster's stores; empty when the worker runs without a controller.
  KnownStores(std::vector<std::string> configured, Lister controller);

  // OK when every address is a known store. An address not yet known asks
  // the controller once more (a store that joined since the last answer).
  // INVALID_ARGUMENT when an address is malformed (base/names.h);
  // PERMISSION_DENIED naming the first address that is not a known store;
  // the controller's error (UNAVAILABLE, DEADLINE_EXCEEDED) when it cannot
  // say. Never connects to any of the addresses.
  absl::Status Check(const std::vector<std::string>& addresses, const CallOptions& call);

  // Times the controller was asked (for tests and metrics).
  int lookups() const;

 private:
  const std::set<std::string> configured_;
  const Lister controller_;
  mutable absl::Mutex mu_;
  std::set<std::string> listed_ ABSL_GUARDED_BY(mu_);
  int lookups_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_WORKER_KNOWN_STORES_H_
