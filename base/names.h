// The one naming rule for tenants and sessions, shared by every service and
// by the tenants file, so that a name means the same thing everywhere.
#ifndef KVTIER_BASE_NAMES_H_
#define KVTIER_BASE_NAMES_H_

#include <cstddef>
#include <string_view>

#include "absl/status/status.h"

namespace kvtier {

inline constexpr size_t kMaxNameLength = 128;

// OK when `name` matches [A-Za-z0-9._:-]{1,128}; INVALID_ARGUMENT naming
// `what` otherwise.
absl::Status ValidateName(std::string_view what, std::string_view name);

}  // namespace kvtier

#endif  // KVTIER_BASE_NAMES_H_
