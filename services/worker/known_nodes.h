// The addresses of one kind of node that a worker may dial because a
// request named them, and so send its own credentials to or open a
// connection to on a caller's behalf: the store replicas of a session
// (OpenSessionRequest.store_addresses, a TransferSession header's), and the
// workers it hands sessions to (LayerRequest.transfer_to,
// SendSessionRequest.target). Known are the addresses the worker was
// configured with and the nodes of that kind its cluster's controller
// lists. A request naming any other address is refused before any
// connection is made, so that no caller can point the worker, and its
// credentials, at a listener of its choosing.
#ifndef KVTIER_SERVICES_WORKER_KNOWN_NODES_H_
#define KVTIER_SERVICES_WORKER_KNOWN_NODES_H_

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

struct KnownNodesOptions {
  // What a request's address is, for messages: "store replica address".
  std::string what;
  // Where known addresses come from, for messages: "the worker's --store,
  // --replica_stores, or a store node the controller lists".
  std::string known_from;
  // Addresses known from the worker's own flags.
  std::vector<std::string> configured;
  // With neither `configured` addresses nor a controller: every
  // well-formed address passes (a standalone worker's hand-off targets,
  // dialled with the caller's own token). Default: false, nothing passes.
  bool open_when_unconfigured = false;
};

// Thread-safe.
class KnownNodes {
 public:
  // The addresses of every node of the kind the controller knows, live or
  // dead.
  using Lister = std::function<absl::StatusOr<std::vector<std::string>>(const CallOptions&)>;

  // `controller`: the cluster's nodes of this kind; empty when the worker
  // runs without a controller.
  KnownNodes(KnownNodesOptions options, Lister controller);

  // OK when every address is known. An address not yet known asks the
  // controller once more (a node that joined since the last answer).
  // INVALID_ARGUMENT when an address is malformed (base/names.h);
  // PERMISSION_DENIED naming the first address that is not known; the
  // controller's error (UNAVAILABLE, DEADLINE_EXCEEDED) when it cannot say.
  // Never connects to any of the addresses.
  absl::Status Check(const std::vector<std::string>& addresses, const CallOptions& call);

  // Times the controller was asked (for tests and metrics).
  int lookups() const;

 private:
  const KnownNodesOptions options_;
  const std::set<std::string> configured_;
  const Lister controller_;
  mutable absl::Mutex mu_;
  std::set<std::string> listed_ ABSL_GUARDED_BY(mu_);
  int lookups_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_WORKER_KNOWN_NODES_H_
