// Pure decision functions of the store: which RAM-resident segments to spill
// and which rounds to drop under disk pressure. They read candidates and
// return choices; the Store is the one place that applies them.
#ifndef KVTIER_CACHESTORE_PLANNER_H_
#define KVTIER_CACHESTORE_PLANNER_H_

#include <cstdint>
#include <optional>
#include <vector>

namespace kvtier::cachestore {

enum class SpillPolicy {
  // InfiniGen's pool policy: among the older half (by insertion), fewest
  // recalls first, oldest first on ties; then the younger half likewise.
  kCounter,
  // Least recently accessed first.
  kLru,
};

struct SpillCandidate {
  uint64_t bytes = 0;
  uint64_t insert_seq = 0;       // Smaller = older.
  uint64_t last_access_seq = 0;  // Smaller = less recent.
  uint64_t recall_count = 0;
};

// Indices into `candidates`, in spill order, whose bytes add up to at least
// `bytes_to_free`; all of them if the total falls short.
std::vector<size_t> PlanSpill(const std::vector<SpillCandidate>& candidates, uint64_t bytes_to_free,
                              SpillPolicy policy);

struct DropCandidate {
  uint64_t bytes = 0;
  uint64_t insert_seq = 0;
  uint64_t recall_count = 0;
};

// Indices of rounds to drop, never-recalled rounds first (oldest first),
// then fewest recalls, whose bytes add up to at least `bytes_to_free`.
// nullopt when even dropping every candidate would not free enough: then
// nothing must be dropped.
std::optional<std::vector<size_t>> PlanDrop(const std::vector<DropCandidate>& candidates,
                                            uint64_t bytes_to_free);

}  // namespace kvtier::cachestore

#endif  // KVTIER_CACHESTORE_PLANNER_H_
