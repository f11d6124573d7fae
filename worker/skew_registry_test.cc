#include "worker/skew_registry.h"

#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/speculation.h"
#include "tests/util/status_matchers.h"

namespace kvtier::worker {
namespace {

using ::kvtier::testing::StatusIs;
using ::testing::HasSubstr;

// A distinct, valid skew file per `n` (its model name differs).
std::string SkewFile(int n) {
  spec::SkewModel m = spec::IdentitySkew(2, 4, 2, 8, 2);
  m.model = "skew-" + std::to_string(n);
  return spec::SerializeSkew(m);
}

TEST(SkewRegistryTest, TheSameBytesAreOneSkewNamedByTheirId) {
  SkewRegistry r;
  const std::string a = SkewFile(1);
  KVT_ASSERT_OK_AND_ASSIGN(const std::string id, r.Put(a, "alice"));
  EXPECT_EQ(id, SkewRegistry::Id(a));
  KVT_ASSERT_OK_AND_ASSIGN(const std::string again, r.Put(a, "bob"));
  EXPECT_EQ(again, id);
  std::shared_ptr<const spec::SkewModel> m = r.Find(id);
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->model, "skew-1");
  EXPECT_NE(SkewRegistry::Id(SkewFile(2)), id);
  EXPECT_EQ(r.Find("00000000-1"), nullptr);
  EXPECT_EQ(SkewRegistry::Id("abc"), "");
}

TEST(SkewRegistryTest, RefusesWhatDoesNotParse) {
  SkewRegistry r;
  EXPECT_THAT(r.Put("abc"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("too short")));
  EXPECT_THAT(r.Put("not a skew file"), StatusIs(absl::StatusCode::kInvalidArgument));
  std::string bad = SkewFile(1);
  bad[bad.size() / 2] ^= 1;
  EXPECT_THAT(r.Put(bad), StatusIs(absl::StatusCode::kDataLoss));
}

// A tenant holds at most kMaxPerTenant: past it, its least recently used
// skew that nobody holds goes; with every one held, RESOURCE_EXHAUSTED. The
// operator's skews (tenant "") and other tenants' stay.
TEST(SkewRegistryTest, ATenantsShareMakesRoomFromItsOwnUnheldSkews) {
  SkewRegistry r;
  KVT_ASSERT_OK_AND_ASSIGN(const std::string ops, r.Put(SkewFile(100)));
  KVT_ASSERT_OK_AND_ASSIGN(const std::string bobs, r.Put(SkewFile(200), "bob"));
  std::vector<std::string> ids;
  std::vector<std::shared_ptr<const spec::SkewModel>> held;
  for (int i = 0; i < SkewRegistry::kMaxPerTenant; ++i) {
    KVT_ASSERT_OK_AND_ASSIGN(std::string id, r.Put(SkewFile(i), "evil"));
    ids.push_back(id);
    held.push_back(r.Find(id));
  }
  EXPECT_THAT(r.Put(SkewFile(50), "evil"),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("its share")));
  held[1].reset();  // Its session closed.
  KVT_ASSERT_OK_AND_ASSIGN(const std::string fresh, r.Put(SkewFile(50), "evil"));
  EXPECT_EQ(r.Find(ids[1]), nullptr);
  for (const std::string& id : {fresh, ids[0], ids[2], ids[3], ops, bobs}) {
    EXPECT_NE(r.Find(id), nullptr) << id;
  }
}

// The whole table holds kMaxSkews: the least recently used unheld tenant
// skew makes room; the operator's never go.
TEST(SkewRegistryTest, AFullTableDropsTheLeastRecentlyUsedUnheldSkew) {
  SkewRegistry r;
  KVT_ASSERT_OK_AND_ASSIGN(const std::string ops, r.Put(SkewFile(1000)));
  std::vector<std::string> ids;
  for (int i = 0; i + 1 < SkewRegistry::kMaxSkews; ++i) {
    // One skew per tenant, so that no share fills first.
    KVT_ASSERT_OK_AND_ASSIGN(std::string id, r.Put(SkewFile(i), "t" + std::to_string(i)));
    ids.push_back(id);
  }
  ASSERT_NE(r.Find(ids[0]), nullptr);  // Used now: ids[1] is the oldest.
  KVT_ASSERT_OK_AND_ASSIGN(const std::string next, r.Put(SkewFile(999), "late"));
  EXPECT_EQ(r.Find(ids[1]), nullptr);
  EXPECT_NE(r.Find(ids[0]), nullptr);
  EXPECT_NE(r.Find(next), nullptr);
  EXPECT_NE(r.Find(ops), nullptr);
}

}  // namespace
}  // namespace kvtier::worker
