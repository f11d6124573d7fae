#include "worker/device/block_cache.h"

#include <algorithm>
#include <bit>
#include <utility>
#include <vector>

namespace kvtier::worker {

BlockCache::BlockCache(size_t cap_bytes, AllocFn alloc, FreeFn free)
    : alloc_(std::move(alloc)), free_(std::move(free)), cap_(cap_bytes) {
  stats_.cap_bytes = cap_bytes;
}

BlockCache::~BlockCache() { Trim(); }

size_t BlockCache::ClassOf(size_t bytes) {
  constexpr size_t kSmall = 4096, kSmallStep = 512;
  if (bytes <= kSmall)
    return std::max<size_t>(kSmallStep, (bytes + kSmallStep - 1) & ~(kSmallStep - 1));
  // Eight classes between 2^k and 2^(k+1): steps of 2^(k-3).
  const int k = std::bit_width(bytes) - 1;
  const size_t step = size_t{1} << (k - 3);
  return (bytes + step - 1) & ~(step - 1);
}

BlockCache::Block BlockCache::PopOldestLocked() {
  Block b = lru_.front();
  auto it = by_class_.find(b.size);
  it->second.pop_front();  // The class's oldest is the list's oldest of it.
  if (it->second.empty()) by_class_.erase(it);
  lru_.pop_front();
  stats_.cached_bytes -= b.size;
  --stats_.cached_blocks;
  return b;
}

absl::StatusOr<BlockCache::Block> BlockCache::Take(size_t bytes) {
  const size_t size = ClassOf(bytes);
  {
    absl::MutexLock lock(&mu_);
    auto it = by_class_.find(size);
    if (it != by_class_.end()) {
      const std::list<Block>::iterator node = it->second.back();
      it->second.pop_back();
      if (it->second.empty()) by_class_.erase(it);
      const Block b = *node;
      lru_.erase(node);
      stats_.cached_bytes -= b.size;
      --stats_.cached_blocks;
      ++stats_.reused;
      return b;
    }
  }
  absl::StatusOr<void*> p = alloc_(size);
  if (!p.ok() && absl::IsResourceExhausted(p.status())) {
    // Memory held here for reuse may be what the allocation lacks.
    Trim();
    p = alloc_(size);
  }
  if (!p.ok()) return p.status();
  absl::MutexLock lock(&mu_);
  ++stats_.allocated;
  return Block{*p, size};
}

void BlockCache::Give(Block b) {
  if (b.p == nullptr) return;
  std::vector<Block> out;
  {
    absl::MutexLock lock(&mu_);
    if (b.size > cap_) {
      out.push_back(b);
    } else {
      while (stats_.cached_bytes + b.size > cap_) out.push_back(PopOldestLocked());
      by_class_[b.size].push_back(lru_.insert(lru_.end(), b));
      stats_.cached_bytes += b.size;
      ++stats_.cached_blocks;
    }
    stats_.freed += out.size();
  }
  for (const Block& f : out) free_(f.p, f.size);
}

void BlockCache::Trim() {
  std::vector<Block> out;
  {
    absl::MutexLock lock(&mu_);
    while (!lru_.empty()) out.push_back(PopOldestLocked());
    stats_.freed += out.size();
  }
  for (const Block& f : out) free_(f.p, f.size);
}

void BlockCache::SetCap(size_t cap_bytes) {
  std::vector<Block> out;
  {
    absl::MutexLock lock(&mu_);
    cap_ = cap_bytes;
    stats_.cap_bytes = cap_bytes;
    while (stats_.cached_bytes > cap_) out.push_back(PopOldestLocked());
    stats_.freed += out.size();
  }
  for (const Block& f : out) free_(f.p, f.size);
}

BlockCache::Stats BlockCache::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace kvtier::worker
