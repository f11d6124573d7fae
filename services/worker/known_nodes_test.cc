#include "services/worker/known_nodes.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvtier {
namespace {

KnownNodesOptions Stores(std::vector<std::string> configured) {
  return {"store replica address", "--store", std::move(configured), false};
}

TEST(KnownNodesTest, WithoutAControllerOnlyTheConfiguredNodesPass) {
  KnownNodes known(Stores({"10.0.0.1:7070", "10.0.0.2:7070"}), nullptr);
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
TEST(KnownNodesTest, TheControllersNodesPassAndItIsAskedOnlyOnAMiss) {
  std::vector<std::string> cluster = {"s1:7070"};
  absl::Status down = absl::OkStatus();
  KnownNodes known(Stores({"own:7070"}),
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

// Hand-off targets of a standalone worker without --peer_workers: any
// well-formed address (the caller's own token goes there); with a list,
// only those.
TEST(KnownNodesTest, OpenWhenUnconfiguredTakesAnyWellFormedAddress) {
  KnownNodes open({"hand-off target", "--peer_workers", {}, true}, nullptr);
  EXPECT_TRUE(open.Check({"10.9.9.9:7071"}, {}).ok());
  EXPECT_EQ(open.Check({"10.9.9.9:70 71"}, {}).code(), absl::StatusCode::kInvalidArgument);
  KnownNodes listed({"hand-off target", "--peer_workers", {"10.0.0.5:7071"}, true}, nullptr);
  EXPECT_TRUE(listed.Check({"10.0.0.5:7071"}, {}).ok());
  EXPECT_EQ(listed.Check({"10.9.9.9:7071"}, {}).code(), absl::StatusCode::kPermissionDenied);
  // With a controller, only what it lists (and the list).
  KnownNodes clustered({"hand-off target", "worker nodes the controller lists", {}, true},
                       [](const CallOptions&) -> absl::StatusOr<std::vector<std::string>> {
                         return std::vector<std::string>{"w1:7071"};
                       });
  EXPECT_TRUE(clustered.Check({"w1:7071"}, {}).ok());
  EXPECT_EQ(clustered.Check({"10.9.9.9:7071"}, {}).code(), absl::StatusCode::kPermissionDenied);
}

}  // namespace
}  // namespace kvtier
