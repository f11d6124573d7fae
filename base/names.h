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

inline constexpr size_t kMaxAddressLength = 255;

// The one rule for a network address that a request names (a node's
// advertised address, a store replica, a hand-off target): 1 to 255
// printable ASCII bytes with no whitespace or control character, either
// "unix:PATH" or "HOST:PORT" with a non-empty host (a name, an IPv4 address,
// or a bracketed IPv6 one) and a decimal port in 1..65535. INVALID_ARGUMENT
// naming `what` otherwise; the message quotes the address only when it is
// within the bound, so that errors never echo unbounded input.
absl::Status ValidateAddress(std::string_view what, std::string_view address);

}  // namespace kvtier

#endif  // KVTIER_BASE_NAMES_H_
