#include "services/common/auth.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/status_matchers.h"

namespace kvtier {
namespace {

using ::kvtier::testing::IsOk;
using ::kvtier::testing::StatusIs;
using Code = absl::StatusCode;

TEST(Authenticator, ParsesTenantsFile) {
  auto a = Authenticator::FromText(
      "# comment\n"
      "alice-secret-1  alice readwrite 1000  # trailing comment\n"
      "\n"
      "bob-reader-0001 bob   readonly\n");
  ASSERT_THAT(a, IsOk());
  ASSERT_EQ(a->entries().size(), 2u);
  EXPECT_EQ(a->entries()[0].principal.tenant, "alice");
  EXPECT_EQ(a->entries()[0].quota_bytes, 1000u);
  EXPECT_EQ(a->entries()[1].principal.role, Role::kReadOnly);
  EXPECT_TRUE(a->enabled());
}

TEST(Authenticator, RejectsBadLines) {
  EXPECT_THAT(Authenticator::FromText("tok-12345 alice admin\n"), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(Authenticator::FromText("short alice readwrite\n"), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(Authenticator::FromText("tok-12345 alice readwrite -5\n"),
              StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(Authenticator::FromText("tok-12345 a readwrite\ntok-12345 b readonly\n"),
              StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(Authenticator::FromText("# nothing\n"), StatusIs(Code::kInvalidArgument));
  // Tenant names follow the session-name rule.
  EXPECT_THAT(Authenticator::FromText("tok-12345 acme/eu readwrite\n"),
              StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(Authenticator::FromText("tok-12345 " + std::string(129, 'a') + " readwrite\n"),
              StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(Authenticator::FromFile("/nonexistent/tenants"), StatusIs(Code::kNotFound));
}

TEST(Authenticator, NodeRole) {
  auto a = Authenticator::FromText("node-token-1 worker7 node\n");
  ASSERT_THAT(a, IsOk());
  EXPECT_EQ(a->entries()[0].principal.role, Role::kNode);
  EXPECT_THAT(Authenticator::RequireWrite(a->entries()[0].principal), IsOk());
}

TEST(Authenticator, ReadOnlyMayNotWrite) {
  EXPECT_THAT(Authenticator::RequireWrite({"a", Role::kReadOnly}),
              StatusIs(Code::kPermissionDenied));
  EXPECT_THAT(Authenticator::RequireWrite({"a", Role::kReadWrite}), IsOk());
}

}  // namespace
}  // namespace kvtier
