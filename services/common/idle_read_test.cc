#include "services/common/idle_read.h"

#include <atomic>
#include <thread>

#include "gtest/gtest.h"

namespace kvtier {
namespace {

TEST(IdleReadTest, TheWatchdogTakesOnlyAStreamStillWaitingForTheSameMessage) {
  IdleRead r;
  EXPECT_FALSE(r.since().has_value());  // Working.
  r.Waiting();
  const std::optional<absl::Time> first = r.since();
  ASSERT_TRUE(first.has_value());
  EXPECT_TRUE(r.ReadDone());     // A message came: the reactor goes on.
  EXPECT_FALSE(r.Take(*first));  // The watchdog's look is stale.
  r.Waiting();
  const std::optional<absl::Time> second = r.since();
  ASSERT_TRUE(second.has_value());
  EXPECT_TRUE(r.Take(*second));
  EXPECT_FALSE(r.since().has_value());  // Taken: not offered again.
  EXPECT_FALSE(r.Take(*second));
  EXPECT_FALSE(r.ReadDone());  // The read that the failure ended.
  EXPECT_FALSE(r.ReadDone());
}

// A read completing while the watchdog takes the stream: exactly one of
// them wins, every time.
TEST(IdleReadTest, ReadAndTakeRaceExactlyOneWins) {
  for (int i = 0; i < 2000; ++i) {
    IdleRead r;
    r.Waiting();
    const absl::Time since = *r.since();
    std::atomic<bool> go{false};
    bool taken = false, read_on = false;
    std::thread watchdog([&] {
      while (!go.load()) {
      }
      taken = r.Take(since);
    });
    go.store(true);
    read_on = r.ReadDone();
    watchdog.join();
    ASSERT_NE(taken, read_on) << "iteration " << i;
  }
}

}  // namespace
}  // namespace kvtier
