// The past rounds of sessions that left this worker by hand-off, kept so
// that when a session comes back only the rounds this worker lacks travel
// (docs/transfer.md#incremental-hand-off). A past round is immutable once
// EndRound has sealed it, so a session's incarnation (a random id drawn when
// it opens, carried by every hand-off) and a round number name its bytes.
#ifndef KVTIER_WORKER_HANDOFF_CACHE_H_
#define KVTIER_WORKER_HANDOFF_CACHE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/clock.h"
#include "worker/session_key.h"

namespace kvtier::worker {

struct RoundLayer;

// A session's past rounds as this worker last held them.
struct KeptRounds {
  KeptRounds();
  ~KeptRounds();
  KeptRounds(KeptRounds&&) noexcept;
  KeptRounds& operator=(KeptRounds&&) noexcept;

  uint64_t incarnation = 0;
  // Round number -> its layers (null: not resident here).
  std::map<uint32_t, std::vector<std::unique_ptr<RoundLayer>>> rounds;
  uint64_t bytes = 0;  // Encoded bytes of the resident layers.
};

// Thread-safe. Bounded by bytes: past the capacity it drops whole sessions,
// the least recently used first, and sessions leased by a pending hand-off
// only when nothing else is left.
class HandoffCache {
 public:
  // 0: keeps nothing.
  // `clock` (not owned, outlives the cache) tells leases from expired ones.
  explicit HandoffCache(uint64_t capacity_bytes, Clock* clock = Clock::Real());
  ~HandoffCache();
  HandoffCache(const HandoffCache&) = delete;
  HandoffCache& operator=(const HandoffCache&) = delete;

  // Keeps `kept` for `id` in place of anything held for it. Not kept when
  // it alone is larger than the capacity.
  void Keep(const SessionKey& id, KeptRounds kept);

  struct Held {
    uint32_t round = 0;
    std::vector<uint32_t> layers;  // Resident layers, ascending.
  };
  // What it holds of `id` at `incarnation` (empty when nothing, or another
  // incarnation), leasing the entry until `lease_until` for the hand-off
  // that asks.
  std::vector<Held> Lookup(const SessionKey& id, uint64_t incarnation, absl::Time lease_until);
  // Takes out what it holds of `id`: the rounds when they are of
  // `incarnation`; an entry of another incarnation is dropped.
  std::optional<KeptRounds> Take(const SessionKey& id, uint64_t incarnation);
  void Erase(const SessionKey& id);

  struct Totals {
    uint64_t bytes = 0;
    uint64_t sessions = 0;
    uint64_t evicted_sessions = 0;  // Since start, dropped for room.
  };
  Totals totals() const;

 private:
  struct Entry {
    KeptRounds kept;
    uint64_t last_use = 0;
    absl::Time lease_until = absl::InfinitePast();
  };
  // Removes the entry from the map and the byte count (REQUIRES mu_).
  KeptRounds ExtractLocked(std::map<SessionKey, Entry>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops sessions other than `keep` into `dropped` until the bytes fit the
  // capacity (REQUIRES mu_).
  void EvictLocked(const SessionKey& keep, std::vector<KeptRounds>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t capacity_;
  Clock* const time_;
  mutable absl::Mutex mu_;
  std::map<SessionKey, Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t evicted_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvtier::worker

#endif  // KVTIER_WORKER_HANDOFF_CACHE_H_
