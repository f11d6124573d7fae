// The one place the project's status-propagation macros live (Abseil
// 20220623 ships none).
#ifndef KVTIER_BASE_STATUS_MACROS_H_
#define KVTIER_BASE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVT_CONCAT_INNER_(a, b) a##b
#define KVT_CONCAT_(a, b) KVT_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` is not OK.
#define KVT_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::absl::Status kvt_status_ = (expr);       \
    if (!kvt_status_.ok()) return kvt_status_; \
  } while (0)

// `lhs = value` of a StatusOr expression, or returns its error.
#define KVT_ASSIGN_OR_RETURN(lhs, expr) \
  KVT_ASSIGN_OR_RETURN_IMPL_(KVT_CONCAT_(kvt_statusor_, __LINE__), lhs, expr)
#define KVT_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()

#endif  // KVTIER_BASE_STATUS_MACROS_H_
