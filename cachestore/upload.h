// One upload call (kvtier-store's PutSegment or PutSegments) as a state
// machine over Store, without gRPC: the transport delivers events (a
// header, a chunk, the half-close, a failure of its own) and the upload says
// through UploadCall what the transport must do (read the next message, tell
// the client its header was accepted, run a task on a thread that may block,
// finish). The store service's reactor only moves bytes and schedules.
//
// A segment: its header reserves room (Store::TryBeginWrite on the event's
// thread when the store can do it without waiting, else Store::BeginWrite on
// a scheduled task), its chunks accumulate (a memcpy and a CRC, never
// blocking), and it commits when complete (Store::TryCommitWrite inline, else
// Store::CommitWrite on a task). A payload that goes to a file of its own
// (larger than StoreOptions::inline_payload_max_bytes) is also written to its
// file as it arrives, by one writer task at a time, so the disk works while
// the rest is received; the commit, and a failure after the header, wait for
// that task. A small put thus costs no hand-off between threads.
//
// Batch (PutSegments): the same steps for each segment in turn. A segment
// commits when its last byte arrives, its outcome is recorded (UploadResult)
// and the next message is read once it has committed. A segment refused at
// its header (size, admission, BeginWrite's error) is recorded and its bytes
// are read and dropped. Errors of the stream itself (a malformed message, a
// truncated or oversize segment) end the call. With StoreOptions::
// sync_writes, the batch's commits are not synced one by one: one WAL sync at
// the half-close makes them all durable before the call finishes.
//
// Thread safety: events come one at a time (the transport holds one read
// outstanding; a scheduled task runs while no read is outstanding or after
// the last one), as gRPC's callback API delivers them. The writer task runs
// beside them and shares only what write_mu_ guards.
//
// Lifetime: UploadCall::Finish is called exactly once, as the upload's last
// act; the transport may destroy the Upload from inside it.
#ifndef KVTIER_CACHESTORE_UPLOAD_H_
#define KVTIER_CACHESTORE_UPLOAD_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cachestore/store.h"

namespace kvtier::cachestore {

// One segment's outcome.
struct UploadResult {
  SegmentId id;
  absl::Status status;
  std::optional<SegmentInfo> info;  // Committed: what the store holds.
  uint64_t charged_bytes = 0;       // Committed: the payload's bytes.
};

// What an upload needs from the call it serves. Implemented by the
// transport; every method is called from an event or a scheduled task.
class UploadCall {
 public:
  virtual ~UploadCall() = default;
  // Deliver the next event (a message or the half-close).
  virtual void Read() = 0;
  // PutSegment: the header's room is reserved; the client may stream.
  virtual void HeaderAccepted() = 0;
  // Run `task` on a thread that may block (I/O, fsync, a lock).
  virtual void Schedule(std::function<void()> task) = 0;
  // Reserve `bytes` of the caller's in-flight upload budget, or say why not
  // (the segment is then refused with that status).
  virtual absl::Status Admit(uint64_t bytes) = 0;
  virtual void Refund(uint64_t bytes) = 0;
  // A segment's outcome (for metrics and logs); `status` ok when committed.
  virtual void SegmentDone(const absl::Status& status) = 0;
  // The call's end: OK with every segment's result (PutSegment: its one),
  // or the error that ended the stream with the results recorded so far.
  // Called once, last; the Upload may be destroyed inside it.
  virtual void Finish(const absl::Status& status, std::vector<UploadResult> results) = 0;
};

class Upload {
 public:
  enum class State {
    kHeader,      // Waiting for a segment's header.
    kBeginning,   // Its room is being reserved on a task.
    kPayload,     // Receiving its chunks.
    kSkipping,    // Dropping a refused segment's bytes (batch).
    kCommitting,  // Its commit runs on a task.
    kSyncing,     // The batch's one WAL sync, at the half-close.
    kFailing,     // Ending with an error once the writer task is done.
    kDone,        // Finish was called.
  };

  struct Options {
    bool batch = false;             // PutSegments.
    std::string method;             // For messages: "PutSegment", "PutSegments".
    uint64_t max_chunk_bytes = 0;   // A larger chunk ends the call.
    int max_batch_segments = 4096;  // Segments a PutSegments call may carry.
  };

  // `store` and `call` must outlive the upload. Starts nothing: the caller
  // calls Start.
  Upload(Store* store, UploadCall* call, Options options);
  Upload(const Upload&) = delete;
  Upload& operator=(const Upload&) = delete;

  // Asks for the first message.
  void Start();

  // Events. A header (`spec`: its WriteSpec with the caller's tenant, or why
  // it does not parse), a chunk of `size` bytes that `append` appends to a
  // string, a message that is neither, the half-close, and a failure of the
  // transport's own (an idle client, say) that ends the call with `status`.
  void OnHeader(absl::StatusOr<WriteSpec> spec);
  void OnChunk(size_t size, absl::FunctionRef<void(std::string*)> append);
  void OnOtherMessage();
  void OnHalfClose();
  void Fail(const absl::Status& status);

  // For tests and the transport's checks.
  State state() const { return state_; }
  // Headers read so far.
  int segments() const { return segments_; }

 private:
  // The header's size checked and admitted; false when refused (done).
  bool Admit();
  void Started(absl::StatusOr<WriteTicket> t);
  void Refused(const absl::Status& s);
  void CommitSegment();
  bool TryCommitNow();
  void Commit();
  void Committed(const absl::StatusOr<SegmentInfo>& info, uint64_t bytes);
  void EndSegment(const absl::Status& s, const SegmentInfo* info = nullptr, uint64_t bytes = 0);
  void KickWriter();
  void WriteChunks();
  void RunAfterWrites(std::function<void()> fn);
  void Done(const absl::Status& s);
  void Read();

  Store* const store_;
  UploadCall* const call_;
  const Options options_;
  State state_ = State::kHeader;
  WriteSpec spec_;
  uint64_t inflight_bytes_ = 0;  // Admitted by call_->Admit.
  uint32_t crc_ = 0;             // CRC-32C of buffer_.
  WriteTicket ticket_;
  std::string buffer_;
  int segments_ = 0;
  std::vector<UploadResult> results_;
  uint64_t skip_ = 0;  // A refused segment's bytes still to drop.
  // Streaming to the payload file.
  static constexpr size_t kWriteBatch = size_t{1} << 20;
  bool streaming_ = false;
  const char* base_ = nullptr;  // buffer_.data(), stable once reserved.
  uint64_t payload_bytes_ = 0;
  std::atomic<size_t> received_{0};  // Bytes of buffer_ the writer may read.
  absl::Mutex write_mu_;
  bool writer_running_ ABSL_GUARDED_BY(write_mu_) = false;
  size_t streamed_ ABSL_GUARDED_BY(write_mu_) = 0;
  absl::Status write_status_ ABSL_GUARDED_BY(write_mu_);
  std::function<void()> after_writes_ ABSL_GUARDED_BY(write_mu_);
};

// "header", "payload", ... for messages and tests.
const char* UploadStateName(Upload::State s);

}  // namespace kvtier::cachestore

#endif  // KVTIER_CACHESTORE_UPLOAD_H_
