// Store::LookupChain: the prefix lookup of content-addressed blocks.
#include <string>
#include <vector>

#include "cachestore/store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/test_util.h"
#include "tests/util/status_matchers.h"
#include "tests/util/store_fixture.h"

namespace kvtier::cachestore {
namespace {

using ::kvtier::testing::IsOk;
using ::kvtier::testing::MakePayload;
using ::kvtier::testing::StatusIs;
using Code = absl::StatusCode;

TEST_F(StoreTest, LookupChainCountsLeadingBlocksAndStopsAtTheFirstHole) {
  Open();
  const std::string p = MakePayload(100, 1);
  for (const char* b : {"b.0", "b.1", "b.3"}) ASSERT_THAT(Put(b, 0, 0, p), IsOk());
  KVT_ASSERT_OK_AND_ASSIGN(auto r, store_->LookupChain("t1", {"b.0", "b.1", "b.2", "b.3"}));
  EXPECT_EQ(r.found, 2u);
  EXPECT_EQ(r.found_bytes, 2 * p.size());
  KVT_ASSERT_OK_AND_ASSIGN(r, store_->LookupChain("t1", {"b.9", "b.0"}));
  EXPECT_EQ(r.found, 0u);
  EXPECT_EQ(r.found_bytes, 0u);
  EXPECT_THAT(store_->LookupChain("t1", {"b.0", "bad name"}), StatusIs(Code::kInvalidArgument));
}

TEST_F(StoreTest, LookupChainSeesOnlyTheCallersTenant) {
  Open();
  ASSERT_THAT(Put("b.0", 0, 0, MakePayload(100, 1), "alice"), IsOk());
  ASSERT_THAT(Put("b.0", 0, 0, MakePayload(100, 2), "bob"), IsOk());
  KVT_ASSERT_OK_AND_ASSIGN(auto r, store_->LookupChain("carol", {"b.0"}));
  EXPECT_EQ(r.found, 0u);
  // One tenant's deletion leaves the other's block of the same name.
  ASSERT_THAT(store_->DeleteSession("alice", "b.0"), IsOk());
  KVT_ASSERT_OK_AND_ASSIGN(r, store_->LookupChain("alice", {"b.0"}));
  EXPECT_EQ(r.found, 0u);
  KVT_ASSERT_OK_AND_ASSIGN(r, store_->LookupChain("bob", {"b.0"}));
  EXPECT_EQ(r.found, 1u);
}

TEST_F(StoreTest, LookupChainKeepsAReadChainAliveSoTailsExpireFirst) {
  options_.default_ttl_seconds = 60;
  Open();
  for (const char* b : {"b.0", "b.1", "b.2"})
    ASSERT_THAT(Put(b, 0, 0, MakePayload(100, 1)), IsOk());
  clock_.AdvanceMs(40'000);
  // A later request matched only the first two blocks.
  KVT_ASSERT_OK_AND_ASSIGN(auto r, store_->LookupChain("t1", {"b.0", "b.1"}));
  EXPECT_EQ(r.found, 2u);
  clock_.AdvanceMs(40'000);
  KVT_ASSERT_OK_AND_ASSIGN(int expired, store_->ExpireSessions());
  EXPECT_EQ(expired, 1);
  KVT_ASSERT_OK_AND_ASSIGN(r, store_->LookupChain("t1", {"b.0", "b.1", "b.2"}));
  EXPECT_EQ(r.found, 2u);
}

}  // namespace
}  // namespace kvtier::cachestore
