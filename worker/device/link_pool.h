// NCCL communicators kept between the hand-offs of one pair of workers
// (docs/transfer.md, "The NCCL path"). Forming a communicator takes both
// processes through NCCL's bootstrap (sockets, topology, buffers): far more
// than a round's bytes take to cross. So both sides keep the communicator
// of a transfer that succeeded, under its id, and the next hand-off between
// the same two processes uses it again:
//   - the sender takes an idle one for the receiver (Take) and offers its id
//     on HeldRounds;
//   - the receiver reserves it for that transfer when it holds it too
//     (Promise) and says so; the transfer's header then names it, and the
//     receiver takes it out (TakePromised);
//   - each side puts it back after the transfer succeeded (Put); a transfer
//     that failed destroys it on both sides.
// A communicator serves one transfer at a time (NCCL matches sends and
// receives by order), which taking it out of the pool guarantees. Plain
// C++, built with or without CUDA (worker/link_pool_test.cc).
#ifndef KVTIER_WORKER_DEVICE_LINK_POOL_H_
#define KVTIER_WORKER_DEVICE_LINK_POOL_H_

#include <cstddef>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/device/attention.h"

namespace kvtier::worker {

class LinkPool {
 public:
  struct Options {
    // Idle communicators kept per peer and in all; past either, the least
    // recently used goes (each holds device buffers on its GPU).
    size_t per_peer = 2;
    size_t total = 16;
    // An idle communicator unused this long is destroyed.
    absl::Duration idle_for = absl::Minutes(5);
    // A promised one waits this long for its transfer's header; then it is
    // destroyed (the sender's side may be gone).
    absl::Duration promised_for = absl::Seconds(60);
    std::function<absl::Time()> now = [] { return absl::Now(); };
  };
  struct Link {
    std::string id;  // The ncclUniqueId it was formed from.
    std::unique_ptr<DeviceLink> link;
  };

  LinkPool() : LinkPool(Options()) {}
  explicit LinkPool(Options options) : options_(std::move(options)) {}
  LinkPool(const LinkPool&) = delete;
  LinkPool& operator=(const LinkPool&) = delete;

  // Sender: the most recently used idle communicator with `peer`, taken out
  // of the pool; nullopt when there is none.
  std::optional<Link> Take(const std::string& peer) ABSL_LOCKS_EXCLUDED(mu_);
  // Receiver: when this pool holds `id` idle for `peer`, reserves it for
  // that peer's next transfer (TakePromised) and returns true.
  bool Promise(const std::string& peer, const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  // Receiver: the communicator promised to `peer` under `id`, taken out of
  // the pool. FAILED_PRECONDITION when there is none (never promised, or
  // its promise ran out).
  absl::StatusOr<std::unique_ptr<DeviceLink>> TakePromised(const std::string& peer,
                                                           const std::string& id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Both sides: keeps `link` idle for `peer` after a transfer that
  // succeeded. An id already held replaces the older entry.
  void Put(const std::string& peer, std::string id, std::unique_ptr<DeviceLink> link)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Communicators held (idle or promised), and how many of them are idle.
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t idle() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    std::string peer, id;
    std::unique_ptr<DeviceLink> link;
    absl::Time since;  // Put back, or promised.
    bool promised = false;
  };
  using Entries = std::list<Entry>;  // Oldest first.

  // Moves expired entries, and the oldest idle ones past the caps, to
  // `dead`, which the caller destroys after unlocking (an NCCL abort may
  // take a while).
  void TrimLocked(std::vector<std::unique_ptr<DeviceLink>>* dead)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  Entries entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier::worker

#endif  // KVTIER_WORKER_DEVICE_LINK_POOL_H_
