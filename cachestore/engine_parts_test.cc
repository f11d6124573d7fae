// Tests of the store's small parts: key layout, names, planner, quotas, the
// index's map.
#include <iterator>
#include <map>
#include <random>

#include "cachestore/keys.h"
#include "cachestore/names.h"
#include "cachestore/planner.h"
#include "cachestore/quota.h"
#include "cachestore/stable_map.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/status_matchers.h"

namespace kvtier::cachestore {
namespace {

// StableMap against std::map on random inserts, lookups and erases: the same
// contents in the same order, and every value stays at its address until it
// is erased (the store's orders hold pointers to them).
template <size_t N>
void CheckStableMapAgainstStdMap(uint32_t seed) {
  StableMap<uint64_t, N> m;
  std::map<uint32_t, uint64_t> ref;
  std::map<uint32_t, const uint64_t*> addr;
  std::mt19937 rng(seed);
  for (int step = 0; step < 4000; ++step) {
    const uint32_t k = rng() % 64;
    switch (rng() % 4) {
      case 0:
      case 1: {
        uint64_t& v = m[k];
        if (ref.count(k) == 0) {
          EXPECT_EQ(v, 0u);  // Value-initialized, as std::map's.
          addr[k] = &v;
        }
        EXPECT_EQ(&v, addr[k]);
        v = ref[k] = rng();
        break;
      }
      case 2:
        EXPECT_EQ(m.erase(k), ref.erase(k));
        addr.erase(k);
        break;
      default: {
        auto it = m.find(k);
        ASSERT_EQ(it == m.end(), ref.count(k) == 0);
        if (it != m.end()) {
          EXPECT_EQ(it->second, ref[k]);
          EXPECT_EQ(&it->second, addr[k]);
        }
      }
    }
    ASSERT_EQ(m.size(), ref.size());
    auto r = ref.begin();
    for (const auto& [key, value] : m) {
      ASSERT_EQ(key, r->first);
      ASSERT_EQ(value, r->second);
      ASSERT_EQ(&value, addr[key]);
      ++r;
    }
    if (!ref.empty()) EXPECT_EQ(m.rbegin()->first, ref.rbegin()->first);
  }
  // Erasing while walking, as RemoveRoundLocked does.
  for (auto it = m.begin(); it != m.end();) it = it->first % 2 == 0 ? m.erase(it) : std::next(it);
  for (const auto& [key, value] : m) EXPECT_EQ(key % 2, 1u);
}

TEST(StableMapTest, MatchesStdMapAndNeverMovesValues) {
  CheckStableMapAgainstStdMap<0>(1);
  CheckStableMapAgainstStdMap<2>(2);
}

using ::kvtier::testing::IsOk;
using ::kvtier::testing::StatusIs;
using ::testing::ElementsAre;
using Code = absl::StatusCode;

TEST(Keys, RoundTripAndOrdering) {
  std::string sk = SessionKey("tenant", "sess-1");
  auto p = ParseDbKey(SegmentDbKey(KeyKind::kPayload, sk, 258, 1));
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->kind, KeyKind::kPayload);
  EXPECT_EQ(p->tenant, "tenant");
  EXPECT_EQ(p->session, "sess-1");
  EXPECT_EQ(p->round, 258u);
  EXPECT_EQ(p->segment, 1u);
  auto m = ParseDbKey(SessionDbKey(sk));
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->session, "sess-1");
  // Rounds sort numerically, so a session's rounds are one contiguous range.
  EXPECT_LT(RoundDbKey(KeyKind::kRound, sk, 2), RoundDbKey(KeyKind::kRound, sk, 256));
  // A session whose name extends another's does not interleave with it.
  EXPECT_FALSE(ParseDbKey("d").has_value());
  EXPECT_FALSE(ParseDbKey(std::string("dtenant\0x", 9)).has_value());
  EXPECT_FALSE(ParseDbKey("z").has_value());
}

TEST(Names, Validation) {
  EXPECT_THAT(ValidateName("s", "chat-42_a.b:c"), IsOk());
  EXPECT_THAT(ValidateName("s", ""), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(ValidateName("s", std::string(129, 'a')), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(ValidateName("s", "a/b"), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(ValidateName("s", std::string("a\0b", 3)), StatusIs(Code::kInvalidArgument));
}

TEST(Planner, CounterPolicyTakesFewestRecallsFromOlderHalf) {
  // insert_seq = age order; the older half is {0,1,2}; index 1 has no recalls.
  std::vector<SpillCandidate> c = {
      {100, 1, 1, 5}, {100, 2, 2, 0}, {100, 3, 3, 1}, {100, 4, 4, 0}, {100, 5, 5, 0}};
  EXPECT_THAT(PlanSpill(c, 100, SpillPolicy::kCounter), ElementsAre(1u));
  EXPECT_THAT(PlanSpill(c, 250, SpillPolicy::kCounter), ElementsAre(1u, 2u, 0u));
  // Past the older half, the younger half follows by the same rule.
  EXPECT_THAT(PlanSpill(c, 450, SpillPolicy::kCounter), ElementsAre(1u, 2u, 0u, 3u, 4u));
  EXPECT_TRUE(PlanSpill(c, 0, SpillPolicy::kCounter).empty());
}

TEST(Planner, LruPolicy) {
  std::vector<SpillCandidate> c = {{100, 1, 9, 0}, {100, 2, 3, 0}, {100, 3, 5, 0}};
  EXPECT_THAT(PlanSpill(c, 150, SpillPolicy::kLru), ElementsAre(1u, 2u));
}

TEST(Planner, DropNeverRecalledFirstOrNothing) {
  std::vector<DropCandidate> c = {{100, 1, 3}, {100, 2, 0}, {100, 3, 0}, {100, 4, 1}};
  EXPECT_THAT(PlanDrop(c, 150).value(), ElementsAre(1u, 2u));
  EXPECT_THAT(PlanDrop(c, 250).value(), ElementsAre(1u, 2u, 3u));
  EXPECT_FALSE(PlanDrop(c, 401).has_value());
}

TEST(Quota, ReserveCommitRefund) {
  QuotaManager q;
  q.SetQuota("a", 1000);
  {
    auto g = q.Reserve("a", 600);
    ASSERT_THAT(g, IsOk());
    EXPECT_THAT(q.Reserve("a", 600), StatusIs(Code::kResourceExhausted));
    EXPECT_EQ(q.Usage("a").reserved_bytes, 600u);
  }  // Refunded.
  EXPECT_EQ(q.Usage("a").reserved_bytes, 0u);
  auto g = q.Reserve("a", 600);
  ASSERT_THAT(g, IsOk());
  g->Commit();
  EXPECT_EQ(q.Usage("a").used_bytes, 600u);
  EXPECT_THAT(q.Reserve("a", 500), StatusIs(Code::kResourceExhausted));
  EXPECT_THAT(q.Reserve("b", 1 << 30), IsOk());  // No quota set: unlimited.
  q.Release("a", 600);
  EXPECT_THAT(q.Reserve("a", 1000), IsOk());
}

TEST(Quota, MovedGrantRefundsOnce) {
  QuotaManager q;
  q.SetQuota("a", 100);
  {
    QuotaGrant outer;
    {
      auto g = q.Reserve("a", 70);
      ASSERT_THAT(g, IsOk());
      outer = std::move(g).value();
    }
    EXPECT_EQ(q.Usage("a").reserved_bytes, 70u);
  }
  EXPECT_EQ(q.Usage("a").reserved_bytes, 0u);
}

}  // namespace
}  // namespace kvtier::cachestore
