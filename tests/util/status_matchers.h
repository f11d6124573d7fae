// gMock matchers for absl::Status and StatusOr: tests name the exact code.
#ifndef KVTIER_TESTS_UTIL_STATUS_MATCHERS_H_
#define KVTIER_TESTS_UTIL_STATUS_MATCHERS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/status_macros.h"
#include "gmock/gmock.h"

namespace kvtier::testing {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

MATCHER_P(StatusIs, code, "has status code " + absl::StatusCodeToString(code)) {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "whose status is " << s.ToString();
  return s.code() == code;
}

// The code and a matcher on the message, e.g. HasSubstr("rank").
MATCHER_P2(StatusIs, code, message_matcher,
           "has status code " + absl::StatusCodeToString(code) + " and a matching message") {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "whose status is " << s.ToString();
  return s.code() == code &&
         ::testing::Matcher<std::string>(message_matcher).Matches(std::string(s.message()));
}

MATCHER(IsOk, "is OK") {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "whose status is " << s.ToString();
  return s.ok();
}

}  // namespace kvtier::testing

// The test stops unless `expr` (a Status or StatusOr) is OK, printing it.
#define KVT_ASSERT_OK(expr) ASSERT_THAT((expr), ::kvtier::testing::IsOk())
#define KVT_EXPECT_OK(expr) EXPECT_THAT((expr), ::kvtier::testing::IsOk())

#define KVT_ASSERT_OK_AND_ASSIGN(lhs, expr)                       \
  auto KVT_CONCAT_(kvt_test_so_, __LINE__) = (expr);              \
  ASSERT_TRUE(KVT_CONCAT_(kvt_test_so_, __LINE__).ok())           \
      << KVT_CONCAT_(kvt_test_so_, __LINE__).status().ToString(); \
  lhs = std::move(KVT_CONCAT_(kvt_test_so_, __LINE__)).value()

#endif  // KVTIER_TESTS_UTIL_STATUS_MATCHERS_H_
