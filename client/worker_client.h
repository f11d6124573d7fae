// The C++ client of kvtier-worker's streams that engines share: one Decode
// stream multiplexed over many sessions (continuous batching), and the skew
// upload. A session's own calls (OpenSession, Prefill, EndRound) are made by
// its engine (refengine/conversation.h).
#ifndef KVTIER_CLIENT_WORKER_CLIENT_H_
#define KVTIER_CLIENT_WORKER_CLIENT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "kvtier/v1/worker.grpc.pb.h"

namespace kvtier {

// One long-lived Decode stream shared by all of an engine's tier sessions:
// each session's decode layer joins the next DecodeRequest together with
// whatever the other sessions have pending (continuous batching), so N
// concurrent conversations cost one hop per round trip instead of N. One
// request is in flight at a time; a session waits for its own output, so its
// layers stay in order. Thread-safe. A broken stream fails the requests on it
// and is opened again for the next ones. Each stream lives at most
// `deadline`: once it is `rotate_after` old (default: half the deadline), new
// steps start on a fresh stream while the steps under way finish on the old
// one (the worker rolls back a session whose step's stream ends), which is
// closed once none is left on it, or at 9/10 of its deadline.
class DecodeMux {
 public:
  DecodeMux(std::shared_ptr<grpc::Channel> channel, std::string token,
            absl::Duration deadline = absl::Seconds(300),
            std::optional<absl::Duration> rotate_after = std::nullopt);
  ~DecodeMux();
  DecodeMux(const DecodeMux&) = delete;
  DecodeMux& operator=(const DecodeMux&) = delete;

  // Sends `item` in the next request and waits for its output (fp32, `out`
  // holds out_floats). `ends_step`: the item is its step's last layer. The
  // worker's status on failure.
  absl::Status Attend(v1::DecodeItem item, float* out, size_t out_floats, bool ends_step);

  // Requests sent and items carried so far (items / requests = mean batch).
  uint64_t requests() const;
  uint64_t items() const;

 private:
  struct Pending;
  struct Stream;
  void Loop();

  std::unique_ptr<v1::Worker::Stub> stub_;
  const std::string token_;
  const absl::Duration deadline_, rotate_after_;
  mutable absl::Mutex mu_;
  std::vector<Pending*> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t requests_ ABSL_GUARDED_BY(mu_) = 0, items_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

// Uploads a skew file (kvtier calibrate infinigen) to the worker behind
// `channel` in 1 MiB slices (Worker.PutSkew); its answer's skew_id goes in
// Policy.speculation_skew. A session whose effective policy names a skew
// sends each decode layer's next-layer query (DecodeItem.q_next).
absl::StatusOr<v1::PutSkewResponse> UploadSkew(std::shared_ptr<grpc::Channel> channel,
                                               const std::string& bytes,
                                               const std::string& token = "",
                                               absl::Duration deadline = absl::Seconds(30));

}  // namespace kvtier

#endif  // KVTIER_CLIENT_WORKER_CLIENT_H_
