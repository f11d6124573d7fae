// Injectable time source, so TTL and age-based policies can be tested with a
// fake clock instead of sleeps.
#ifndef KVTIER_BASE_CLOCK_H_
#define KVTIER_BASE_CLOCK_H_

#include <atomic>
#include <cstdint>

namespace kvtier {

// Thread-safe: every implementation may be called from any thread.
class Clock {
 public:
  virtual ~Clock() = default;
  // Wall-clock milliseconds since the Unix epoch.
  virtual int64_t NowUnixMs() = 0;
  // The process-wide real clock. Never null; never deleted.
  static Clock* Real();
};

// A clock that moves only when told. Thread-safe.
class FakeClock : public Clock {
 public:
  explicit FakeClock(int64_t start_ms = 1'700'000'000'000) : now_ms_(start_ms) {}
  int64_t NowUnixMs() override { return now_ms_.load(); }
  void AdvanceMs(int64_t ms) { now_ms_.fetch_add(ms); }

 private:
  std::atomic<int64_t> now_ms_;
};

}  // namespace kvtier

#endif  // KVTIER_BASE_CLOCK_H_
