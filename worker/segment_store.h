// Where the worker engine keeps rounds: kvtier-store in production
// (client/store_segments.h), any implementation in tests of the
// layers above it. No gRPC here.
#ifndef KVTIER_WORKER_SEGMENT_STORE_H_
#define KVTIER_WORKER_SEGMENT_STORE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/call_options.h"

namespace kvtier::worker {

// Implementations are thread-safe: the engine calls them from several
// threads at once, never while holding a session's lock. Every method
// honours `call.deadline`: past it the call returns DEADLINE_EXCEEDED; a
// store that cannot be reached (or a call the transport broke) gives
// UNAVAILABLE, the only code a caller may retry as is. Every other failure is
// the store's answer with its own code: DATA_LOSS (a stored segment failed
// its checksum), INVALID_ARGUMENT, INTERNAL. `call.tenant` names the end
// tenant the call acts for; RESOURCE_EXHAUSTED (that tenant's quota) and
// PERMISSION_DENIED (the store does not let this worker act for it) come
// back as such from every method.
class SegmentStore {
 public:
  virtual ~SegmentStore() = default;
  struct Segment {
    uint32_t round = 0;
    uint32_t segment = 0;  // Its index in the round's layout (round_layout.h).
    // Put: the identity of the model whose K/V the segment holds, stored
    // with the round (ModelShape::model_digest); 0: none recorded.
    uint64_t model = 0;
  };
  // Stores one segment's serialized SegmentPayload. OK; ALREADY_EXISTS
  // (passed through as such) when the segment is stored already; the
  // failures above.
  virtual absl::Status Put(const std::string& session, const Segment& s, uint32_t layer_begin,
                           uint32_t layer_end, std::string_view payload,
                           const CallOptions& call) = 0;
  // One segment of PutMany.
  struct SegmentWrite {
    Segment s;
    uint32_t layer_begin = 0;
    uint32_t layer_end = 0;
    std::string_view payload;
  };
  // Stores several segments of the session, in order, in one call where the
  // store allows it (a round's two segments: one round trip instead of
  // two). One status per write, each as Put would give it. A write after a
  // failed one may not have been attempted: it then gets ABORTED. The
  // default calls Put for each in turn and stops at the first failure.
  virtual std::vector<absl::Status> PutMany(const std::string& session,
                                            const std::vector<SegmentWrite>& writes,
                                            const CallOptions& call) {
    std::vector<absl::Status> out;
    out.reserve(writes.size());
    for (const SegmentWrite& w : writes) {
      if (!out.empty() && !out.back().ok()) {
        out.push_back(absl::AbortedError("not attempted: an earlier segment's put failed"));
        continue;
      }
      out.push_back(Put(session, w.s, w.layer_begin, w.layer_end, w.payload, call));
    }
    return out;
  }
  // Fetches all `segments` in ONE call, in order. OK and one payload per
  // segment; NOT_FOUND when one of them (or the session) is not stored (a
  // round dropped under pressure); the failures above.
  virtual absl::StatusOr<std::vector<std::string>> Get(const std::string& session,
                                                       const std::vector<Segment>& segments,
                                                       const CallOptions& call) = 0;
  // Get, except that a segment the store does not hold (its round dropped
  // under pressure; or the whole session) comes back as nullopt in its
  // place instead of failing the call; the failures above. Stores that can answer it in one call
  // override it; the default calls Get, and after a NOT_FOUND Get for each segment alone.
  virtual absl::StatusOr<std::vector<std::optional<std::string>>> GetPresent(
      const std::string& session, const std::vector<Segment>& segments, const CallOptions& call) {
    absl::StatusOr<std::vector<std::string>> all = Get(session, segments, call);
    std::vector<std::optional<std::string>> out;
    out.reserve(segments.size());
    if (all.ok()) {
      if (all->size() != segments.size()) {
        return absl::DataLossError("GetSegments returned another count");
      }
      for (std::string& p : *all) out.emplace_back(std::move(p));
      return out;
    }
    if (!absl::IsNotFound(all.status())) return all.status();
    for (const Segment& s : segments) {
      absl::StatusOr<std::vector<std::string>> one = Get(session, {s}, call);
      if (one.ok() && one->size() == 1) {
        out.emplace_back(std::move(one->front()));
      } else if (absl::IsNotFound(one.status())) {
        out.emplace_back(std::nullopt);
      } else {
        return one.ok() ? absl::DataLossError("GetSegments returned another count") : one.status();
      }
    }
    return out;
  }
  // Deletes every stored round of the session. OK when it had none.
  virtual absl::Status Delete(const std::string& session, const CallOptions& call) = 0;
  // Drops one round (both segments). OK when it was not there.
  virtual absl::Status DropRound(const std::string& session, uint32_t round,
                                 const CallOptions& call) = 0;
  // Drops single segments of stored rounds, in one call, keeping the rest
  // of each round. OK when some were not there.
  virtual absl::Status DropSegments(const std::string& session,
                                    const std::vector<Segment>& segments,
                                    const CallOptions& call) = 0;
  // Counts recalls of rounds that were resident (no fetch), in one call.
  virtual absl::Status RecordRecalls(const std::string& session,
                                     const std::vector<uint32_t>& rounds,
                                     const CallOptions& call) = 0;
  // A stored round as resume needs it: its number, its segments (index and
  // layer range, ascending by index), and `model` the identity recorded
  // with it (0: none).
  struct StoredSegment {
    uint32_t segment = 0;
    uint32_t layer_begin = 0;
    uint32_t layer_end = 0;
    friend bool operator==(const StoredSegment&, const StoredSegment&) = default;
  };
  struct StoredRound {
    uint32_t round = 0;
    std::vector<StoredSegment> segments;
    uint64_t model = 0;
  };
  // The session's stored rounds, ascending. NOT_FOUND
  // (passed through) when the store has no such session.
  virtual absl::StatusOr<std::vector<StoredRound>> List(const std::string& session,
                                                        const CallOptions& call) = 0;
};

}  // namespace kvtier::worker

#endif  // KVTIER_WORKER_SEGMENT_STORE_H_
