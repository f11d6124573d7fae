// Per-call options shared by kvtier's clients (the store client, the worker's
// SegmentStore): kept apart from each client's own options, as RocksDB keeps
// ReadOptions apart from Options.
#ifndef KVTIER_BASE_CALL_OPTIONS_H_
#define KVTIER_BASE_CALL_OPTIONS_H_

#include <algorithm>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvtier {

struct CallOptions {
  // When the call must be over; past it the call fails DEADLINE_EXCEEDED and
  // the callee's work is cancelled. A service fills it from its own caller's
  // deadline, so a chain of calls shares one budget.
  // Default: absl::InfiniteFuture(), meaning the client's own default (for
  // the store client, StoreClientOptions::deadline).
  absl::Time deadline = absl::InfiniteFuture();
  // The end tenant the call acts for, sent as "kvtier-tenant" metadata
  // (services/common/auth.h). The callee honours it only from a node token
  // (or with authentication off). Default: empty, the caller's own tenant.
  std::string tenant;

  static CallOptions Within(absl::Duration d) { return {absl::Now() + d, {}}; }

  // The earlier of this deadline and now + `fallback`: a caller's deadline
  // wins when it is set and sooner.
  absl::Time DeadlineOr(absl::Duration fallback) const {
    return std::min(deadline, absl::Now() + fallback);
  }
  bool has_deadline() const { return deadline != absl::InfiniteFuture(); }
};

}  // namespace kvtier

#endif  // KVTIER_BASE_CALL_OPTIONS_H_
