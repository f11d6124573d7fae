// Whether a streaming reactor waits for its client's next message, and
// since when, shared between the reactor and a watchdog that ends streams
// whose client went silent (kvtier-store's uploads, kvtier-worker's
// PutSkew). Exactly one of the two acts on a silence: the watchdog takes
// the stream only while the reactor still waits for that same message, and
// the reactor's next OnReadDone learns that it was taken.
//
// Reactor: Waiting() before each StartRead; first in OnReadDone,
// `if (!idle_.ReadDone()) return;` (the watchdog failed the stream, and
// this read ended with it). Watchdog: since() and, past its timeout,
// Take(*since); true means the stream is the watchdog's to fail, once,
// off the watchdog's thread (the failure finishes the call, which ends the
// pending read).
//
// Thread-safe.
#ifndef KVTIER_SERVICES_COMMON_IDLE_READ_H_
#define KVTIER_SERVICES_COMMON_IDLE_READ_H_

#include <atomic>
#include <cstdint>
#include <optional>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvtier {

class IdleRead {
 public:
  // The reactor is about to wait for a message (now).
  void Waiting() { ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_release); }
  // A read completed: true when the reactor goes on as usual, false when the
  // watchdog took the stream first (the reactor must do nothing more).
  bool ReadDone() {
    if (ns_.exchange(0, std::memory_order_acq_rel) != kTaken) return true;
    ns_.store(kTaken, std::memory_order_release);
    return false;
  }
  // Since when the reactor waits; nullopt while it works, or once taken.
  std::optional<absl::Time> since() const {
    const int64_t ns = ns_.load(std::memory_order_acquire);
    if (ns <= 0) return std::nullopt;
    return absl::FromUnixNanos(ns);
  }
  // Takes the stream when it still waits since `since` (what since() said);
  // false when a message arrived meanwhile, or it was taken already.
  bool Take(absl::Time since) {
    int64_t expected = absl::ToUnixNanos(since);
    return ns_.compare_exchange_strong(expected, kTaken, std::memory_order_acq_rel);
  }

 private:
  static constexpr int64_t kTaken = -1;
  std::atomic<int64_t> ns_{0};  // Unix ns since waiting; 0: working.
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_COMMON_IDLE_READ_H_
