#include "base/clock.h"

#include <chrono>

namespace kvtier {
namespace {

class RealClock : public Clock {
 public:
  int64_t NowUnixMs() override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
};

}  // namespace

Clock* Clock::Real() {
  static RealClock* clock = new RealClock();
  return clock;
}

}  // namespace kvtier
