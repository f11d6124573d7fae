#include "rpc/policy_proto.h"

#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/eviction.h"
#include "testing/test_util.h"
#include "tests/util/status_matchers.h"

namespace kvtier {
namespace {

using ::kvtier::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// A layer profile reaches a worker (or the controller validating a policy)
// as its budgets; the name after "profile:" is a label, never a path. A
// client that names a file on the worker's host gets a refusal that carries
// nothing of the file.
TEST(PolicyProtoTest, ProfileTravelsAsBudgetsAndNoFileIsRead) {
  testing::TempDir dir;
  const std::string secret_path = dir.path() + "/token";
  {
    std::ofstream f(secret_path);
    f << "s3cr3t-node-credential\n";
  }
  const std::string profile_path = dir.path() + "/evolkv.profile";
  ASSERT_TRUE(evict::SaveLayerProfile(profile_path, "evolkv-x", {40, 24, 16}).ok());
  for (const std::string& path : {secret_path, profile_path}) {
    v1::Policy p;
    p.set_eviction("profile:" + path);
    absl::StatusOr<worker::SessionPolicy> s = PolicyFromProto(p, DType::kFp16);
    EXPECT_THAT(s.status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs layer_budgets")));
    EXPECT_THAT(std::string(s.status().message()), Not(HasSubstr("s3cr3t")));
    EXPECT_THAT(std::string(s.status().message()), Not(HasSubstr("budgets 40")));
  }
  v1::Policy p;
  p.set_eviction("profile:evolkv-x");
  for (uint32_t b : {40u, 24u, 16u}) p.add_layer_budgets(b);
  KVT_ASSERT_OK_AND_ASSIGN(worker::SessionPolicy s, PolicyFromProto(p, DType::kFp16));
  EXPECT_EQ(s.eviction.method, evict::Method::kProfile);
  EXPECT_THAT(s.eviction.layer_budgets, ElementsAre(40, 24, 16));
  EXPECT_EQ(s.eviction.profile_name, "evolkv-x");
  EXPECT_EQ(s.eviction.budget, 40);
  EXPECT_EQ(s.eviction.score.window, evict::DefaultWindow(16));
  p.set_window(20);  // A window at or above a layer's budget is refused.
  EXPECT_THAT(PolicyFromProto(p, DType::kFp16).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace kvtier
