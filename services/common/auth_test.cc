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
  EXPECT_THAT(Authenticator::FromText("cert: acme readwrite\n"), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(Authenticator::FromText("cert:s0 s0 node\n"), IsOk());  // A name, not a token.
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

TEST(Authenticator, NodeTokensBoundToOneNode) {
  auto a = Authenticator::FromText(
      "store-0-secret s0 node node_id=store-0 node_kind=store\n"
      "shared-secret1 nodes node\n");
  ASSERT_THAT(a, IsOk());
  const Principal bound = a->entries()[0].principal;
  const Principal shared = a->entries()[1].principal;
  EXPECT_EQ(bound.node_id, "store-0");
  EXPECT_EQ(bound.node_kind, "store");
  EXPECT_EQ(a->UnboundNodeTokens(), 1);
  EXPECT_THAT(a->RequireNodeIdentity(bound, "store-0", "store"), IsOk());
  EXPECT_THAT(a->RequireNodeIdentity(bound, "store-0", ""), IsOk());
  EXPECT_THAT(a->RequireNodeIdentity(bound, "store-0", "worker"),
              StatusIs(Code::kPermissionDenied));
  EXPECT_THAT(a->RequireNodeIdentity(bound, "store-1", "store"), StatusIs(Code::kPermissionDenied));
  EXPECT_THAT(a->RequireNodeIdentity(shared, "store-0", "store"),
              StatusIs(Code::kPermissionDenied));
  EXPECT_THAT(a->RequireNodeIdentity(shared, "worker-3", "worker"), IsOk());
  EXPECT_THAT(Authenticator().RequireNodeIdentity(shared, "store-0", "store"), IsOk());
  // Two tokens for one node, while one replaces the other.
  auto rotating = Authenticator::FromText(
      "store-0-secret s0 node node_id=store-0 node_kind=store\n"
      "store-0-newer1 s0 node node_id=store-0 node_kind=store\n");
  ASSERT_THAT(rotating, IsOk());
  EXPECT_THAT(rotating->RequireNodeIdentity(rotating->entries()[1].principal, "store-0", "store"),
              IsOk());
  // Bindings are for node tokens, come in pairs and are unique.
  for (const char* bad :
       {"tok-12345 acme readwrite node_id=x node_kind=store\n", "tok-12345 n node node_id=x\n",
        "tok-12345 n node node_id=x node_kind=gpu\n",
        "tok-12345 n node node_id=a/b node_kind=store\n",
        "tok-12345 n node node_id=x node_kind=store\n"
        "tok-67890 m node node_id=x node_kind=worker\n"}) {
    EXPECT_THAT(Authenticator::FromText(bad), StatusIs(Code::kInvalidArgument)) << bad;
  }
}

TEST(Authenticator, PerTenantLimits) {
  auto a = Authenticator::FromText(
      "acme-token-1 acme readwrite 1000 max_sessions=8 max_working_set_mb=64\n"
      "acme-token-2 acme readonly max_sessions=16\n"
      "bob-token-01 bob  readwrite\n");
  ASSERT_THAT(a, IsOk());
  EXPECT_EQ(a->entries()[0].quota_bytes, 1000u);
  auto limits = a->Limits();
  ASSERT_EQ(limits.size(), 1u);
  EXPECT_EQ(limits["acme"].max_sessions, 16);
  EXPECT_EQ(limits["acme"].max_working_set_bytes, uint64_t{64} << 20);
  EXPECT_EQ(a->WritingTenants(), 2);
  EXPECT_THAT(Authenticator::FromText("acme-token-1 acme readwrite max_sesions=8\n"),
              StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(Authenticator::FromText("acme-token-1 acme readwrite max_sessions=-1\n"),
              StatusIs(Code::kInvalidArgument));
}

TEST(CheckListenAuth, OnByDefaultOutsideLoopback) {
  EXPECT_THAT(CheckListenAuth("127.0.0.1:7070", false, false), IsOk());
  EXPECT_THAT(CheckListenAuth("localhost:0", false, false), IsOk());
  EXPECT_THAT(CheckListenAuth("[::1]:7070", false, false), IsOk());
  EXPECT_THAT(CheckListenAuth("unix:/run/kvtier.sock", false, false), IsOk());
  EXPECT_THAT(CheckListenAuth("0.0.0.0:7070", false, false), StatusIs(Code::kFailedPrecondition));
  EXPECT_THAT(CheckListenAuth("[::]:7070", false, false), StatusIs(Code::kFailedPrecondition));
  EXPECT_THAT(CheckListenAuth("10.1.2.3:7070", false, false), StatusIs(Code::kFailedPrecondition));
  EXPECT_THAT(CheckListenAuth("0.0.0.0:7070", true, false), IsOk());
  EXPECT_THAT(CheckListenAuth("0.0.0.0:7070", false, true), IsOk());
}

TEST(Authenticator, ReadOnlyMayNotWrite) {
  EXPECT_THAT(Authenticator::RequireWrite({"a", Role::kReadOnly}),
              StatusIs(Code::kPermissionDenied));
  EXPECT_THAT(Authenticator::RequireWrite({"a", Role::kReadWrite}), IsOk());
}

}  // namespace
}  // namespace kvtier
