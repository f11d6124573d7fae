#include "worker/handoff_cache.h"

#include "worker/session.h"

namespace kvtier::worker {

KeptRounds::KeptRounds() = default;
KeptRounds::~KeptRounds() = default;
KeptRounds::KeptRounds(KeptRounds&&) noexcept = default;
KeptRounds& KeptRounds::operator=(KeptRounds&&) noexcept = default;

HandoffCache::HandoffCache(uint64_t capacity_bytes, Clock* clock)
    : capacity_(capacity_bytes), time_(clock) {}
HandoffCache::~HandoffCache() = default;

void HandoffCache::Keep(const SessionKey& id, KeptRounds kept) {
  // The replaced entry and the evicted ones are freed after the lock.
  std::vector<KeptRounds> dropped;
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it != entries_.end()) dropped.push_back(ExtractLocked(it));
  if (kept.bytes > capacity_ || kept.rounds.empty()) {
    dropped.push_back(std::move(kept));
    return;
  }
  bytes_ += kept.bytes;
  Entry& e = entries_[id];
  e.kept = std::move(kept);
  e.last_use = ++clock_;
  EvictLocked(id, &dropped);
}

void HandoffCache::EvictLocked(const SessionKey& keep, std::vector<KeptRounds>* dropped) {
  const absl::Time now = absl::FromUnixMillis(time_->NowUnixMs());
  // Unleased before leased, then the least recently used.
  auto rank = [&](const Entry& x) { return std::make_pair(x.lease_until > now, x.last_use); };
  while (bytes_ > capacity_) {
    auto victim = entries_.end();
    for (auto i = entries_.begin(); i != entries_.end(); ++i) {
      if (i->first == keep) continue;
      if (victim == entries_.end() || rank(i->second) < rank(victim->second)) victim = i;
    }
    if (victim == entries_.end()) return;  // Only `keep`, which fits.
    dropped->push_back(ExtractLocked(victim));
    ++evicted_;
  }
}

std::vector<HandoffCache::Held> HandoffCache::Lookup(const SessionKey& id, uint64_t incarnation,
                                                     absl::Time lease_until) {
  std::vector<Held> out;
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end() || it->second.kept.incarnation != incarnation) return out;
  it->second.last_use = ++clock_;
  it->second.lease_until = std::max(it->second.lease_until, lease_until);
  for (const auto& [round, layers] : it->second.kept.rounds) {
    Held h;
    h.round = round;
    for (size_t l = 0; l < layers.size(); ++l) {
      if (layers[l] != nullptr) h.layers.push_back(static_cast<uint32_t>(l));
    }
    if (!h.layers.empty()) out.push_back(std::move(h));
  }
  return out;
}

std::optional<KeptRounds> HandoffCache::Take(const SessionKey& id, uint64_t incarnation) {
  std::optional<KeptRounds> out;
  KeptRounds stale;  // Freed after the lock.
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return out;
  KeptRounds k = ExtractLocked(it);
  if (k.incarnation == incarnation) {
    out = std::move(k);
  } else {
    stale = std::move(k);
  }
  return out;
}

void HandoffCache::Erase(const SessionKey& id) {
  KeptRounds gone;  // Freed after the lock.
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it != entries_.end()) gone = ExtractLocked(it);
}

KeptRounds HandoffCache::ExtractLocked(std::map<SessionKey, Entry>::iterator it) {
  KeptRounds k = std::move(it->second.kept);
  bytes_ -= std::min(bytes_, k.bytes);
  entries_.erase(it);
  return k;
}

HandoffCache::Totals HandoffCache::totals() const {
  absl::MutexLock lock(&mu_);
  return {bytes_, entries_.size(), evicted_};
}

}  // namespace kvtier::worker
