// Validation of tenant and session names.
#ifndef KVTIER_CACHESTORE_NAMES_H_
#define KVTIER_CACHESTORE_NAMES_H_

#include <string_view>

#include "absl/status/status.h"

namespace kvtier::cachestore {

inline constexpr size_t kMaxNameLength = 128;
inline constexpr uint32_t kMaxRound = (1u << 31) - 1;
inline constexpr uint32_t kMaxSegmentsPerRound = 64;
inline constexpr uint32_t kMaxLayers = 1024;

// OK when `name` matches [A-Za-z0-9._:-]{1,128}; INVALID_ARGUMENT naming
// `what` otherwise.
absl::Status ValidateName(std::string_view what, std::string_view name);

}  // namespace kvtier::cachestore

#endif  // KVTIER_CACHESTORE_NAMES_H_
