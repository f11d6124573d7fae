// Freed device allocations kept for reuse (docs/gpu.md, "Device memory").
//
// cudaMalloc and cudaFree are slow next to the copies they serve: on an
// H100 a decode worker taking four hand-offs at once spent 75 us a
// cudaMalloc and 16 us a cudaFree, about 6,600 of each in the PD demo, and
// cudaFree waits for the whole device. A BlockCache keeps freed blocks by
// size class and hands them out again; it is the device build's allocator
// for working sets, received rounds and kernel scratch
// (device_attention_cuda.cc). It holds no CUDA itself: what allocates and
// frees is given, so that it is tested on any machine.
//
// The caller's contract: a block is given back only when no device work
// that reads or writes it is in flight (every user synchronizes its stream
// before a buffer changes hands; see DeviceBuffer). Its next owner may
// write it at once.
#ifndef KVTIER_WORKER_DEVICE_BLOCK_CACHE_H_
#define KVTIER_WORKER_DEVICE_BLOCK_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvtier::worker {

class BlockCache {
 public:
  // Allocates `bytes` (RESOURCE_EXHAUSTED when out of memory), frees one.
  using AllocFn = std::function<absl::StatusOr<void*>(size_t bytes)>;
  using FreeFn = std::function<void(void* p, size_t bytes)>;

  struct Block {
    void* p = nullptr;
    size_t size = 0;  // Its class: at least what was asked for.
  };
  struct Stats {
    uint64_t reused = 0;     // Takes served from the cache.
    uint64_t allocated = 0;  // Takes that allocated.
    uint64_t freed = 0;      // Blocks freed (over the cap, trimmed, or on retry).
    size_t cached_bytes = 0;
    size_t cached_blocks = 0;
    size_t cap_bytes = 0;
  };

  BlockCache(size_t cap_bytes, AllocFn alloc, FreeFn free);
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;
  // Frees every cached block.
  ~BlockCache();

  // The class a request of `bytes` gets: multiples of 512 bytes up to
  // 4 KiB, then eight classes an octave (at most 12.5% over the request).
  static size_t ClassOf(size_t bytes);

  // A block of ClassOf(bytes): the most recently given back of that class,
  // else a new allocation. When that allocation is refused for memory, the
  // cache frees every block it holds and tries once more.
  absl::StatusOr<Block> Take(size_t bytes);
  // Keeps `b` for reuse, freeing the least recently given back blocks to
  // stay within the cap (a block over the cap on its own is freed at once).
  void Give(Block b);
  // Frees every cached block.
  void Trim();
  // A cap of 0 caches nothing; lowering it frees down to it.
  void SetCap(size_t cap_bytes);
  Stats stats() const;

 private:
  // Removes the least recently given back block; its node must exist.
  Block PopOldestLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const AllocFn alloc_;
  const FreeFn free_;
  mutable absl::Mutex mu_;
  size_t cap_ ABSL_GUARDED_BY(mu_);
  // Cached blocks, least recently given back first; per class, its blocks'
  // nodes in the same order (so a class's oldest is its deque's front).
  std::list<Block> lru_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<size_t, std::deque<std::list<Block>::iterator>> by_class_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier::worker

#endif  // KVTIER_WORKER_DEVICE_BLOCK_CACHE_H_
