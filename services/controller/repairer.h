// Repair: copies a session's stored rounds from a surviving store replica
// to the one that replaced a dead store (controller::RepairTask), store to
// store through the controller, so the session is back at R replicas.
//
// Each task: ListRounds on a source (the next source if one cannot be
// reached) and on the target; every segment the target lacks is read from
// the source (GetSegments, uncounted: a copy is not a recall) one round at a
// time and written to the target with the same layer range, round summary
// and session TTL; a pinned session is pinned on the target. A segment that
// is already there (the session's worker wrote the round to the new replica
// meanwhile) is skipped. The tasks run on `parallelism` threads, and all of
// them together stay under `max_bytes_per_second`, so live traffic keeps
// the rest of the bandwidth.
#ifndef KVTIER_SERVICES_CONTROLLER_REPAIRER_H_
#define KVTIER_SERVICES_CONTROLLER_REPAIRER_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "client/store_client.h"
#include "controller/controller.h"

namespace kvtier {

struct RepairOptions {
  // Sessions repaired at once. Range [1, 64]. Default: 2.
  int parallelism = 2;
  // Payload bytes per second over all repairs; 0: no cap. Default: 64 MiB/s.
  uint64_t max_bytes_per_second = uint64_t{64} << 20;
  // A node token for the stores (it acts for each session's tenant), and
  // their CA; empty: none / plaintext.
  std::string store_token;
  std::string store_tls_root_certs;
  // PEM of the controller's certificate chain and key, for stores that
  // require client certificates (mutual TLS); empty: none presented.
  std::string store_tls_cert_chain, store_tls_private_key;
  // Deadline of each store call. Default: 30 s.
  absl::Duration call_deadline = absl::Seconds(30);
  // A failed task is retried this many times in all. Default: 5.
  int max_attempts = 5;
};

struct RepairStats {
  uint64_t sessions_repaired = 0;  // Copied to their new replica ("repair done").
  // Held by no replica yet (no round stored): nothing to copy ("repair
  // skipped"); the task is done all the same.
  uint64_t sessions_empty = 0;
  uint64_t sessions_failed = 0;  // Attempts that failed (each is retried).
  uint64_t segments_copied = 0;
  uint64_t bytes_copied = 0;
  uint64_t segments_present = 0;  // Already on the target: skipped.
  absl::Duration busy;            // Time spent in tasks, summed over threads.
};

// Runs the controller's repair tasks until destroyed. Thread-safe.
class Repairer {
 public:
  // `controller` is not owned and must outlive the Repairer. INVALID_ARGUMENT
  // for bad options.
  static absl::StatusOr<std::unique_ptr<Repairer>> Start(controller::Controller* controller,
                                                         RepairOptions options);
  ~Repairer();  // Finishes the segments in flight, then stops.

  RepairStats stats() const;

  // Copies one session now, on the calling thread (what each repair thread
  // runs). OK when the target holds every segment a source holds. The
  // missing segments go in batches of whole rounds, one GetSegments and one
  // PutSegments a batch, of at most kBatchBytes and kBatchSegments (a round
  // larger than that goes alone).
  // OK with *empty set when no replica holds the session yet.
  absl::Status Repair(const controller::RepairTask& task, bool* empty);
  static constexpr uint64_t kBatchBytes = uint64_t{8} << 20;
  static constexpr size_t kBatchSegments = 256;

 private:
  Repairer(controller::Controller* controller, RepairOptions options)
      : controller_(controller), options_(std::move(options)) {}
  void Loop();
  // Waits until `bytes` more fit under the bandwidth cap.
  void Throttle(uint64_t bytes);
  absl::StatusOr<StoreClient*> Client(const std::string& address);

  controller::Controller* const controller_;
  const RepairOptions options_;
  absl::Notification stop_;
  std::vector<std::thread> threads_;

  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<StoreClient>> clients_ ABSL_GUARDED_BY(mu_);
  RepairStats stats_ ABSL_GUARDED_BY(mu_);
  absl::Time next_send_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_CONTROLLER_REPAIRER_H_
