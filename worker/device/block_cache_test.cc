// BlockCache: size classes, reuse, the cap's order of freeing, the retry
// after an allocation refused for memory, and many threads at once. The
// allocator here is a counted heap with a limit, standing in for the
// device's memory (the cache never reads its blocks).
#include "worker/device/block_cache.h"

#include <cstdlib>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvtier::worker {
namespace {

// malloc with a byte limit, remembering what is live.
class Heap {
 public:
  explicit Heap(size_t limit = SIZE_MAX) : limit_(limit) {}
  ~Heap() {
    for (const auto& [p, n] : live_) std::free(p);
  }
  BlockCache::AllocFn Alloc() {
    return [this](size_t n) -> absl::StatusOr<void*> {
      absl::MutexLock lock(&mu_);
      if (fail_next_) {
        fail_next_ = false;
        return absl::InternalError("the device failed");
      }
      if (used_ + n > limit_) return absl::ResourceExhaustedError("out of memory");
      void* p = std::malloc(n);
      used_ += n;
      live_[p] = n;
      ++allocs_;
      return p;
    };
  }
  BlockCache::FreeFn Free() {
    return [this](void* p, size_t n) {
      absl::MutexLock lock(&mu_);
      auto it = live_.find(p);
      ASSERT_NE(it, live_.end()) << "freed twice, or never allocated";
      EXPECT_EQ(it->second, n);
      used_ -= n;
      live_.erase(it);
      freed_.push_back(p);
      std::free(p);
    };
  }
  size_t used() {
    absl::MutexLock lock(&mu_);
    return used_;
  }
  size_t live() {
    absl::MutexLock lock(&mu_);
    return live_.size();
  }
  uint64_t allocs() {
    absl::MutexLock lock(&mu_);
    return allocs_;
  }
  std::vector<void*> freed() {
    absl::MutexLock lock(&mu_);
    return freed_;
  }
  void FailNext() {
    absl::MutexLock lock(&mu_);
    fail_next_ = true;
  }

 private:
  absl::Mutex mu_;
  const size_t limit_;
  size_t used_ = 0;
  uint64_t allocs_ = 0;
  bool fail_next_ = false;
  std::map<void*, size_t> live_;
  std::vector<void*> freed_;
};

TEST(BlockCacheTest, ClassesCoverTheRequestWithinAnEighth) {
  EXPECT_EQ(BlockCache::ClassOf(0), 512u);
  EXPECT_EQ(BlockCache::ClassOf(1), 512u);
  EXPECT_EQ(BlockCache::ClassOf(512), 512u);
  EXPECT_EQ(BlockCache::ClassOf(513), 1024u);
  EXPECT_EQ(BlockCache::ClassOf(4096), 4096u);
  EXPECT_EQ(BlockCache::ClassOf(4097), 4608u);
  EXPECT_EQ(BlockCache::ClassOf(1 << 20), size_t{1} << 20);
  EXPECT_EQ(BlockCache::ClassOf((1 << 20) + 1), (size_t{1} << 20) + (1 << 17));
  std::mt19937_64 rng(7);
  size_t last_bytes = 0, last_class = 0;
  for (int i = 0; i < 100000; ++i) {
    const size_t bytes = rng() % (size_t{1} << (1 + rng() % 36));
    const size_t c = BlockCache::ClassOf(bytes);
    ASSERT_GE(c, bytes);
    ASSERT_EQ(c % 512, 0u);
    if (bytes > 4096) {
      ASSERT_LE(c, bytes + bytes / 8) << bytes;
    }
    ASSERT_EQ(BlockCache::ClassOf(c), c) << "a class is its own class";
    if (bytes >= last_bytes) {
      ASSERT_GE(c, last_class);
    } else {
      ASSERT_LE(c, last_class);
    }
    last_bytes = bytes;
    last_class = c;
  }
}

TEST(BlockCacheTest, GivenBackBlocksAreTakenAgainNewestFirstWithinTheirClass) {
  Heap heap;
  BlockCache cache(1 << 20, heap.Alloc(), heap.Free());
  auto a = cache.Take(1000);
  auto b = cache.Take(1000);
  auto c = cache.Take(3000);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->size, 1024u);
  EXPECT_EQ(c->size, 3072u);
  EXPECT_EQ(heap.allocs(), 3u);
  cache.Give(*a);
  cache.Give(*b);
  cache.Give(*c);
  EXPECT_EQ(cache.stats().cached_bytes, 1024u + 1024 + 3072);
  EXPECT_EQ(cache.stats().cached_blocks, 3u);
  // Any request of the class takes a block of it; the newest first.
  auto d = cache.Take(600);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->p, b->p);
  auto e = cache.Take(1024);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->p, a->p);
  auto f = cache.Take(1024);  // None left of the class: allocated.
  ASSERT_TRUE(f.ok());
  EXPECT_NE(f->p, a->p);
  EXPECT_NE(f->p, b->p);
  EXPECT_EQ(heap.allocs(), 4u);
  const BlockCache::Stats s = cache.stats();
  EXPECT_EQ(s.reused, 2u);
  EXPECT_EQ(s.allocated, 4u);
  EXPECT_EQ(s.cached_bytes, 3072u);
  EXPECT_EQ(heap.live(), 4u);  // Nothing was freed.
  cache.Give(*d);
  cache.Give(*e);
  cache.Give(*f);
  cache.Trim();
  EXPECT_EQ(heap.live(), 0u);
  EXPECT_EQ(cache.stats().cached_bytes, 0u);
  EXPECT_EQ(cache.stats().freed, 4u);
}

TEST(BlockCacheTest, TheCapFreesTheLeastRecentlyGivenBackFirst) {
  Heap heap;
  BlockCache cache(4096, heap.Alloc(), heap.Free());
  std::vector<BlockCache::Block> held;
  for (size_t n : {1024, 1024, 2048, 512}) held.push_back(*cache.Take(n));
  for (const auto& b : held) cache.Give(b);  // 4608 bytes: the first goes.
  EXPECT_EQ(heap.freed(), std::vector<void*>{held[0].p});
  EXPECT_EQ(cache.stats().cached_bytes, 3584u);
  // A block over the cap on its own is freed at once, the cache untouched.
  auto big = cache.Take(8192);
  cache.Give(*big);
  EXPECT_EQ(heap.freed().back(), big->p);
  EXPECT_EQ(cache.stats().cached_blocks, 3u);
  // Lowering the cap frees down to it, oldest first.
  cache.SetCap(1024);
  EXPECT_EQ(heap.freed(), (std::vector<void*>{held[0].p, big->p, held[1].p, held[2].p}));
  EXPECT_EQ(cache.stats().cached_bytes, 512u);
  cache.SetCap(0);
  auto z = cache.Take(100);
  cache.Give(*z);
  EXPECT_EQ(cache.stats().cached_blocks, 0u);
  EXPECT_EQ(heap.live(), 0u);
}

TEST(BlockCacheTest, AnAllocationRefusedForMemoryIsRetriedAfterTheCacheIsEmptied) {
  Heap heap(8192);
  BlockCache cache(1 << 20, heap.Alloc(), heap.Free());
  auto a = cache.Take(4096);
  auto b = cache.Take(4096);
  ASSERT_TRUE(a.ok() && b.ok());
  cache.Give(*a);
  cache.Give(*b);
  // 8 KiB live, all of it cached: a request of another class gets it back.
  auto c = cache.Take(6000);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(cache.stats().cached_blocks, 0u);
  EXPECT_EQ(heap.used(), 6144u);
  // Still too much after emptying: the allocator's status comes back.
  auto d = cache.Take(4096);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
  // Other failures are not retried, and leave the cache alone.
  cache.Give(*c);
  heap.FailNext();
  auto e = cache.Take(512);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(cache.stats().cached_blocks, 1u);
}

// Against a longhand model: every block given back is appended to a list;
// a take removes the last of its class; the cap removes from the front.
TEST(BlockCacheTest, MatchesALonghandModelOnRandomWorkloads) {
  for (int seed = 0; seed < 20; ++seed) {
    Heap heap;
    const size_t cap = size_t{64} << 10;
    BlockCache cache(cap, heap.Alloc(), heap.Free());
    std::vector<BlockCache::Block> model;  // Cached, oldest first.
    std::vector<void*> model_freed;
    std::vector<BlockCache::Block> owned;
    std::mt19937 rng(seed);
    for (int step = 0; step < 5000; ++step) {
      if (owned.empty() || rng() % 2 == 0) {
        const size_t bytes = 1 + rng() % 20000;
        const size_t cls = BlockCache::ClassOf(bytes);
        auto b = cache.Take(bytes);
        ASSERT_TRUE(b.ok());
        ASSERT_EQ(b->size, cls);
        void* want = nullptr;
        for (size_t i = model.size(); i-- > 0;) {
          if (model[i].size == cls) {
            want = model[i].p;
            model.erase(model.begin() + static_cast<ptrdiff_t>(i));
            break;
          }
        }
        if (want != nullptr) {
          ASSERT_EQ(b->p, want) << "seed " << seed << " step " << step;
        }
        owned.push_back(*b);
      } else {
        const size_t i = rng() % owned.size();
        const BlockCache::Block b = owned[i];
        owned.erase(owned.begin() + static_cast<ptrdiff_t>(i));
        cache.Give(b);
        if (b.size > cap) {
          model_freed.push_back(b.p);
        } else {
          size_t sum = b.size;
          for (const auto& m : model) sum += m.size;
          while (sum > cap) {
            sum -= model.front().size;
            model_freed.push_back(model.front().p);
            model.erase(model.begin());
          }
          model.push_back(b);
        }
      }
      ASSERT_EQ(heap.freed(), model_freed) << "seed " << seed << " step " << step;
      size_t cached = 0;
      for (const auto& m : model) cached += m.size;
      ASSERT_EQ(cache.stats().cached_bytes, cached);
      ASSERT_LE(cached, cap);
    }
    for (const auto& b : owned) cache.Give(b);
  }
}

TEST(BlockCacheTest, ThreadsNeverShareABlockAndNothingLeaks) {
  Heap heap;
  absl::Mutex mu;
  std::set<void*> in_use;
  bool shared = false;
  {
    BlockCache cache(size_t{256} << 10, heap.Alloc(), heap.Free());
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937 rng(t);
        std::vector<BlockCache::Block> mine;
        for (int i = 0; i < 20000; ++i) {
          if (mine.size() < 8 && (mine.empty() || rng() % 2 == 0)) {
            auto b = cache.Take(1 + rng() % 40000);
            ASSERT_TRUE(b.ok());
            absl::MutexLock lock(&mu);
            if (!in_use.insert(b->p).second) shared = true;
            mine.push_back(*b);
          } else {
            const BlockCache::Block b = mine.back();
            mine.pop_back();
            {
              absl::MutexLock lock(&mu);
              in_use.erase(b.p);
            }
            cache.Give(b);
          }
        }
        for (const auto& b : mine) {
          {
            absl::MutexLock lock(&mu);
            in_use.erase(b.p);
          }
          cache.Give(b);
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_FALSE(shared) << "two owners held one block at once";
    const BlockCache::Stats s = cache.stats();
    EXPECT_GT(s.reused, 0u);
    EXPECT_LE(s.cached_bytes, s.cap_bytes);
    EXPECT_EQ(heap.live(), s.cached_blocks) << "every live block is cached once all are given";
  }
  EXPECT_EQ(heap.live(), 0u) << "the cache frees what it holds when it goes";
}

}  // namespace
}  // namespace kvtier::worker
