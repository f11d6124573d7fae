// The store's limits on names, rounds, segments and layers.
#ifndef KVTIER_CACHESTORE_NAMES_H_
#define KVTIER_CACHESTORE_NAMES_H_

#include <cstdint>

#include "base/names.h"

namespace kvtier::cachestore {

using ::kvtier::kMaxNameLength;
using ::kvtier::ValidateName;
inline constexpr uint32_t kMaxRound = (1u << 31) - 1;
inline constexpr uint32_t kMaxSegmentsPerRound = 64;
inline constexpr uint32_t kMaxLayers = 1024;

}  // namespace kvtier::cachestore

#endif  // KVTIER_CACHESTORE_NAMES_H_
