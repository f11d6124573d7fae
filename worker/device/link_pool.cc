#include "worker/device/link_pool.h"

#include <map>
#include <utility>

#include "absl/status/status.h"

namespace kvtier::worker {

void LinkPool::TrimLocked(std::vector<std::unique_ptr<DeviceLink>>* dead) {
  const absl::Time now = options_.now();
  std::map<std::string, size_t> per_peer;
  size_t kept = 0;
  // Newest first, so that the caps keep the most recently used.
  for (auto it = entries_.end(); it != entries_.begin();) {
    --it;
    const absl::Duration lasts = it->promised ? options_.promised_for : options_.idle_for;
    const bool expired = it->since + lasts < now;
    const bool over_cap =
        !it->promised && (per_peer[it->peer] >= options_.per_peer || kept >= options_.total);
    if (expired || over_cap) {
      dead->push_back(std::move(it->link));
      it = entries_.erase(it);
      continue;
    }
    ++kept;
    if (!it->promised) ++per_peer[it->peer];
  }
}

std::optional<LinkPool::Link> LinkPool::Take(const std::string& peer) {
  std::vector<std::unique_ptr<DeviceLink>> dead;
  std::optional<Link> out;
  {
    absl::MutexLock lock(&mu_);
    TrimLocked(&dead);
    for (auto it = entries_.end(); it != entries_.begin();) {
      --it;
      if (it->promised || it->peer != peer) continue;
      out = Link{std::move(it->id), std::move(it->link)};
      entries_.erase(it);
      break;
    }
  }
  return out;
}

bool LinkPool::Promise(const std::string& peer, const std::string& id) {
  // Declared before the lock, so destroyed after it is released.
  std::vector<std::unique_ptr<DeviceLink>> dead;
  absl::MutexLock lock(&mu_);
  TrimLocked(&dead);
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    if (it->promised || it->peer != peer || it->id != id) continue;
    it->promised = true;
    it->since = options_.now();
    entries_.splice(entries_.end(), entries_, it);  // Order stays by `since`.
    return true;
  }
  return false;
}

absl::StatusOr<std::unique_ptr<DeviceLink>> LinkPool::TakePromised(const std::string& peer,
                                                                   const std::string& id) {
  std::vector<std::unique_ptr<DeviceLink>> dead;
  std::unique_ptr<DeviceLink> out;
  {
    absl::MutexLock lock(&mu_);
    TrimLocked(&dead);
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (!it->promised || it->peer != peer || it->id != id) continue;
      out = std::move(it->link);
      entries_.erase(it);
      break;
    }
  }
  if (out == nullptr) {
    return absl::FailedPreconditionError(
        "the NCCL communicator this transfer names is not held here (its reservation from "
        "HeldRounds ran out, or this worker restarted)");
  }
  return out;
}

void LinkPool::Put(const std::string& peer, std::string id, std::unique_ptr<DeviceLink> link) {
  // Declared before the lock, so destroyed after it is released.
  std::vector<std::unique_ptr<DeviceLink>> dead;
  absl::MutexLock lock(&mu_);
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    if (it->id != id) continue;
    dead.push_back(std::move(it->link));
    entries_.erase(it);
    break;
  }
  entries_.push_back(Entry{peer, std::move(id), std::move(link), options_.now(), false});
  TrimLocked(&dead);
}

size_t LinkPool::size() const {
  absl::MutexLock lock(&mu_);
  return entries_.size();
}

size_t LinkPool::idle() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const Entry& e : entries_) n += e.promised ? 0 : 1;
  return n;
}

}  // namespace kvtier::worker
