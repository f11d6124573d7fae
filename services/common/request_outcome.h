// The `outcome` label of kvtier's request counters (kvtier_store_requests_total,
// kvtier_store_segment_puts_total, kvtier_worker_requests_total,
// kvtier_controller_requests_total), so that an alert can tell a server that
// fails from callers that are refused:
//   ok            the call succeeded;
//   client_error  the server refused the caller's request as it was asked: a bad
//                 argument, an unknown session or segment, one that exists
//                 already, no or a weak token, a quota or share, a conflict with
//                 the caller's own concurrent call (ABORTED), its cancellation;
//   server_error  the server could not do what it should have: INTERNAL,
//                 DATA_LOSS, UNAVAILABLE (a store or worker it needs is down),
//                 DEADLINE_EXCEEDED (it or what it waited on was too slow),
//                 UNKNOWN, UNIMPLEMENTED.
// Header-only; thread-safe.
#ifndef KVTIER_SERVICES_COMMON_REQUEST_OUTCOME_H_
#define KVTIER_SERVICES_COMMON_REQUEST_OUTCOME_H_

#include "absl/status/status.h"

namespace kvtier {

inline const char* RequestOutcome(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kOk:
      return "ok";
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kUnimplemented:
      return "server_error";
    default:
      return "client_error";
  }
}

}  // namespace kvtier

#endif  // KVTIER_SERVICES_COMMON_REQUEST_OUTCOME_H_
