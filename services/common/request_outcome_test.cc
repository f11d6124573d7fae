#include "services/common/request_outcome.h"

#include <string>

#include "gtest/gtest.h"

namespace kvtier {
namespace {

// Every status code has one outcome; what a caller did wrong never counts as
// the server's failure, and what the server failed at always does.
TEST(RequestOutcomeTest, EveryCodeIsOkAClientsOrTheServers) {
  EXPECT_STREQ(RequestOutcome(absl::OkStatus()), "ok");
  for (absl::Status s :
       {absl::InvalidArgumentError(""), absl::NotFoundError(""), absl::AlreadyExistsError(""),
        absl::PermissionDeniedError(""), absl::UnauthenticatedError(""),
        absl::ResourceExhaustedError(""), absl::FailedPreconditionError(""),
        absl::OutOfRangeError(""), absl::AbortedError(""), absl::CancelledError("")}) {
    EXPECT_STREQ(RequestOutcome(s), "client_error") << s;
  }
  for (absl::Status s :
       {absl::InternalError(""), absl::DataLossError(""), absl::UnavailableError(""),
        absl::DeadlineExceededError(""), absl::UnknownError(""), absl::UnimplementedError("")}) {
    EXPECT_STREQ(RequestOutcome(s), "server_error") << s;
  }
}

}  // namespace
}  // namespace kvtier
