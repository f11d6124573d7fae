// HandoffCache: what it keeps, for which incarnation, and what it drops
// for room (least recently used first, leased entries last).
#include "worker/handoff_cache.h"

#include "base/clock.h"
#include "gtest/gtest.h"
#include "worker/session.h"

namespace kvtier::worker {
namespace {

// `rounds` rounds of `layers` layers, each layer `bytes` bytes.
KeptRounds Rounds(uint64_t incarnation, int rounds, int layers, int64_t bytes) {
  KeptRounds k;
  k.incarnation = incarnation;
  for (int r = 0; r < rounds; ++r) {
    auto& v = k.rounds[static_cast<uint32_t>(r)];
    for (int l = 0; l < layers; ++l) {
      // Layer 1 of odd rounds is not resident.
      if (l == 1 && r % 2 == 1) {
        v.push_back(nullptr);
        continue;
      }
      auto rl = std::make_unique<RoundLayer>();
      rl->bytes = bytes;
      k.bytes += static_cast<uint64_t>(bytes);
      v.push_back(std::move(rl));
    }
  }
  return k;
}

TEST(HandoffCacheTest, HeldPerIncarnationAndTakenOnce) {
  HandoffCache c(1 << 20);
  c.Keep("a", Rounds(7, 2, 3, 100));
  EXPECT_EQ(c.totals().bytes, 500u);
  EXPECT_TRUE(c.Lookup("a", 8, absl::Now()).empty());
  EXPECT_TRUE(c.Lookup(SessionKey("t", "a"), 7, absl::Now()).empty());  // Another tenant's.
  auto held = c.Lookup("a", 7, absl::Now());
  ASSERT_EQ(held.size(), 2u);
  EXPECT_EQ(held[0].layers, (std::vector<uint32_t>{0, 1, 2}));
  EXPECT_EQ(held[1].layers, (std::vector<uint32_t>{0, 2}));
  auto k = c.Take("a", 7);
  ASSERT_TRUE(k.has_value());
  EXPECT_EQ(k->rounds.size(), 2u);
  EXPECT_EQ(c.totals().bytes, 0u);
  EXPECT_FALSE(c.Take("a", 7).has_value());
  // Another incarnation is dropped by Take.
  c.Keep("a", Rounds(7, 1, 1, 10));
  EXPECT_FALSE(c.Take("a", 9).has_value());
  EXPECT_EQ(c.totals().sessions, 0u);
  // Keep replaces; Erase drops.
  c.Keep("b", Rounds(1, 1, 1, 10));
  c.Keep("b", Rounds(2, 1, 1, 30));
  EXPECT_EQ(c.totals().bytes, 30u);
  c.Erase("b");
  EXPECT_EQ(c.totals().bytes, 0u);
}

TEST(HandoffCacheTest, DropsLeastRecentlyUsedAndLeasedLast) {
  HandoffCache c(1000);
  c.Keep("a", Rounds(1, 1, 1, 300));
  c.Keep("b", Rounds(1, 1, 1, 300));
  c.Keep("c", Rounds(1, 1, 1, 300));
  // "a" is used (and leased): "b" is now the least recently used.
  EXPECT_FALSE(c.Lookup("a", 1, absl::Now() + absl::Minutes(1)).empty());
  c.Keep("d", Rounds(1, 1, 1, 300));
  EXPECT_TRUE(c.Lookup("b", 1, absl::Now()).empty());
  EXPECT_EQ(c.totals().sessions, 3u);
  EXPECT_EQ(c.totals().evicted_sessions, 1u);
  // "c" is leased and "a" is too; "d" is not, though used more recently:
  // it goes first.
  EXPECT_FALSE(c.Lookup("c", 1, absl::Now() + absl::Minutes(1)).empty());
  c.Keep("e", Rounds(1, 1, 1, 300));
  EXPECT_TRUE(c.Lookup("d", 1, absl::Now()).empty());
  EXPECT_FALSE(c.Lookup("a", 1, absl::Now()).empty());
  // Past the capacity even leased entries go; one larger than the whole
  // capacity is not kept at all.
  c.Keep("f", Rounds(1, 3, 1, 300));
  EXPECT_LE(c.totals().bytes, 1000u);
  EXPECT_FALSE(c.Lookup("f", 1, absl::Now()).empty());
  c.Keep("g", Rounds(1, 1, 1, 2000));
  EXPECT_TRUE(c.Lookup("g", 1, absl::Now()).empty());
  HandoffCache off(0);
  off.Keep("a", Rounds(1, 1, 1, 1));
  EXPECT_EQ(off.totals().sessions, 0u);
}

// Leases end on the cache's clock: an entry leased until a moment goes
// after the unleased ones until that moment, and like any other after it.
TEST(HandoffCacheTest, LeasesEndOnTheInjectedClock) {
  FakeClock clock;
  auto now = [&] { return absl::FromUnixMillis(clock.NowUnixMs()); };
  HandoffCache c(600, &clock);
  c.Keep("a", Rounds(1, 1, 1, 300));
  c.Keep("b", Rounds(1, 1, 1, 300));
  EXPECT_FALSE(c.Lookup("a", 1, now() + absl::Seconds(10)).empty());  // Leased.
  EXPECT_FALSE(c.Lookup("b", 1, now()).empty());                      // Used last, not leased.
  c.Keep("c", Rounds(1, 1, 1, 300));
  EXPECT_TRUE(c.Lookup("b", 1, now()).empty());
  EXPECT_FALSE(c.Lookup("a", 1, now() + absl::Seconds(10)).empty());
  // Past a's lease: the least recently used goes, though a was leased.
  clock.AdvanceMs(20'000);
  EXPECT_FALSE(c.Lookup("c", 1, now()).empty());
  c.Keep("d", Rounds(1, 1, 1, 300));
  EXPECT_TRUE(c.Lookup("a", 1, now()).empty());
  EXPECT_FALSE(c.Lookup("c", 1, now()).empty());
}

}  // namespace
}  // namespace kvtier::worker
