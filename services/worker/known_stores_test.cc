#include "services/worker/known_stores.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvtier {
namespace {

TEST(KnownStoresTest, WithoutAControllerOnlyTheConfiguredStoresPass) {
  KnownStores known({"10.0.0.1:7070", "10.0.0.2:7070"}, nullptr);
  EXPECT_TRUE(known.Check({"10.0.0.2:7070", "10.0.0.1:7070"}, {}).ok());
  EXPECT_TRUE(known.Check({}, {}).ok());
  const absl::Status s = known.Check({"10.0.0.1:7070", "10.6.6.6:7070"}, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("'10.6.6.6:7070'"), std::string::npos) << s.message();
  EXPECT_EQ(known.Check({"10.0.0.1:70 70"}, {}).code(), absl::StatusCode::kInvalidArgument);
}

// The controller is asked only for an address not yet known, once per miss;
// a store that joins later passes after the next lookup; an address it never
// lists is refused; when it cannot answer, nothing passes that it must vouch
// for, with its status.
TEST(KnownStoresTest, TheControllersStoresPassAndItIsAskedOnlyOnAMiss) {
  std::vector<std::string> cluster = {"s1:7070"};
  absl::Status down = absl::OkStatus();
  KnownStores known({"own:7070"},
                    [&](const CallOptions&) -> absl::StatusOr<std::vector<std::string>> {
                      if (!down.ok()) return down;
                      return cluster;
                    });
  EXPECT_TRUE(known.Check({"own:7070"}, {}).ok());
  EXPECT_EQ(known.lookups(), 0);
  EXPECT_TRUE(known.Check({"s1:7070", "own:7070"}, {}).ok());
  EXPECT_EQ(known.lookups(), 1);
  EXPECT_TRUE(known.Check({"s1:7070"}, {}).ok());
  EXPECT_EQ(known.lookups(), 1);
  EXPECT_EQ(known.Check({"s2:7070"}, {}).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(known.lookups(), 2);
  cluster.push_back("s2:7070");
  EXPECT_TRUE(known.Check({"s2:7070"}, {}).ok());
  EXPECT_EQ(known.lookups(), 3);
  down = absl::UnavailableError("controller gone");
  const absl::Status s = known.Check({"s3:7070"}, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("controller gone"), std::string::npos) << s.message();
  EXPECT_TRUE(known.Check({"s1:7070", "own:7070"}, {}).ok());
}

}  // namespace
}  // namespace kvtier
