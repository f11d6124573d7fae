// A SegmentStore in this process's memory: the worker engine's rounds kept
// without kvtier-store, with hooks that make calls fail or wait. Tests drive
// the engine over it as LevelDB's tests drive a database over an in-memory
// Env: no process to start, and a store failure is one call, not a kill.
#ifndef KVTIER_WORKER_MEMORY_STORE_H_
#define KVTIER_WORKER_MEMORY_STORE_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/segment_store.h"

namespace kvtier::worker {

// Thread-safe. Outcomes are SegmentStore's, as kvtier-store gives them:
// ALREADY_EXISTS for a segment stored already, NOT_FOUND from Get when a
// segment or the session is missing and from List for an unknown session,
// DEADLINE_EXCEEDED past `call.deadline`. `call.tenant` is not checked: one
// tenant's session ids are another's (a test that needs tenants apart uses
// distinct ids). Payloads are copied in and out.
class MemorySegmentStore : public SegmentStore {
 public:
  // The calls a hook applies to. A PutMany is one kPut per segment.
  enum class Op { kPut, kGet, kDelete, kDropRound, kDropSegments, kRecordRecalls, kList };

  MemorySegmentStore() = default;
  MemorySegmentStore(const MemorySegmentStore&) = delete;
  MemorySegmentStore& operator=(const MemorySegmentStore&) = delete;

  absl::Status Put(const std::string& session, const Segment& s, uint32_t layer_begin,
                   uint32_t layer_end, std::string_view payload, const CallOptions& call) override;
  // One call; each segment stored or refused on its own, as kvtier-store's
  // PutSegments does.
  std::vector<absl::Status> PutMany(const std::string& session,
                                    const std::vector<SegmentWrite>& writes,
                                    const CallOptions& call) override;
  absl::StatusOr<std::vector<std::string>> Get(const std::string& session,
                                               const std::vector<Segment>& segments,
                                               const CallOptions& call) override;
  // One call, as kvtier-store's GetSegments with missing_ok.
  absl::StatusOr<std::vector<std::optional<std::string>>> GetPresent(
      const std::string& session, const std::vector<Segment>& segments,
      const CallOptions& call) override;
  absl::Status Delete(const std::string& session, const CallOptions& call) override;
  absl::Status DropRound(const std::string& session, uint32_t round,
                         const CallOptions& call) override;
  absl::Status DropSegments(const std::string& session, const std::vector<Segment>& segments,
                            const CallOptions& call) override;
  absl::Status RecordRecalls(const std::string& session, const std::vector<uint32_t>& rounds,
                             const CallOptions& call) override;
  absl::StatusOr<std::vector<StoredRound>> List(const std::string& session,
                                                const CallOptions& call) override;

  // ---- Hooks ----
  // The next `times` calls of `op` fail with `status` (not OK), doing
  // nothing; with `segment` >= 0 only puts of that segment index count.
  void FailNext(Op op, absl::Status status, int times = 1, int segment = -1);
  // Every call fails with `status` (say UNAVAILABLE: the store is down)
  // until Restore(), which also clears what FailNext armed.
  void FailAll(absl::Status status);
  void Restore();
  // Gets wait, once they have counted themselves, until ReleaseGets (or
  // their deadline: DEADLINE_EXCEEDED). AwaitHeldGets blocks until `n`
  // gets wait.
  void HoldGets();
  void ReleaseGets();
  void AwaitHeldGets(int n);

  // ---- What it holds and saw ----
  struct Counts {
    uint64_t put_calls = 0;  // Put and PutMany calls, failed ones too.
    uint64_t get_calls = 0;
    uint64_t record_calls = 0;
    uint64_t stored_segments = 0;  // Now.
    uint64_t stored_bytes = 0;     // Now.
  };
  Counts counts() const;
  // The stored rounds of `session`, ascending (empty when none).
  std::vector<uint32_t> Rounds(const std::string& session) const;
  // Recalls RecordRecalls counted for `round` of `session`.
  uint64_t Recalls(const std::string& session, uint32_t round) const;

 private:
  // Get and GetPresent: one call, counted, held and failed as a get; a
  // segment not stored is nullopt (NOT_FOUND: the session is not).
  absl::StatusOr<std::vector<std::optional<std::string>>> GetCall(
      const std::string& session, const std::vector<Segment>& segments, const CallOptions& call);
  struct Stored {
    uint32_t layer_begin = 0, layer_end = 0;
    std::string payload;
  };
  struct Round {
    uint64_t model = 0;
    std::map<uint32_t, Stored> segments;
    uint64_t recalls = 0;
  };
  struct Armed {
    absl::Status status;
    int times = 0;
    int segment = -1;
  };
  using RoundMap = std::map<uint32_t, Round>;

  // The status a call of `op` must fail with now, consuming one armed
  // failure; OK to go on.
  absl::Status Check(Op op, const CallOptions& call, int segment = -1)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PutLocked(const std::string& session, const Segment& s, uint32_t layer_begin,
                         uint32_t layer_end, std::string_view payload, const CallOptions& call)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseRoundLocked(RoundMap& rounds, RoundMap::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, RoundMap> sessions_ ABSL_GUARDED_BY(mu_);
  std::map<Op, Armed> armed_ ABSL_GUARDED_BY(mu_);
  absl::Status down_ ABSL_GUARDED_BY(mu_);
  bool hold_gets_ ABSL_GUARDED_BY(mu_) = false;
  int held_gets_ ABSL_GUARDED_BY(mu_) = 0;
  Counts counts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier::worker

#endif  // KVTIER_WORKER_MEMORY_STORE_H_
