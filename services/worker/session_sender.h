// The sending side of a hand-off: streams one session of this worker's
// engine to another kvtier-worker's TransferSession, layer by layer, on a
// thread of its own, so that the stream overlaps the layers still being
// computed (docs/transfer.md).
#ifndef KVTIER_SERVICES_WORKER_SESSION_SENDER_H_
#define KVTIER_SERVICES_WORKER_SESSION_SENDER_H_

#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "kvtier/v1/worker.grpc.pb.h"
#include "rpc/raw_call.h"
#include "worker/device/attention.h"
#include "worker/engine.h"
#include "worker/transfer.h"

namespace kvtier {

// Not thread-safe: one caller drives Begin, SendLayer (in layer order) and
// Finish. Destroying it before Finish cancels the transfer (the receiver
// then keeps nothing) and waits for its thread.
class SessionSender {
 public:
  // `channel` leads to the receiving worker; `authorization` (may be empty)
  // is the metadata the receiver authenticates the tenant by: the caller's
  // own, passed on.
  SessionSender(worker::Engine* engine, worker::SessionKey id,
                std::shared_ptr<grpc::Channel> channel, std::string target,
                std::string authorization, absl::Time deadline,
                size_t chunk_bytes = size_t{1} << 20);
  ~SessionSender();
  SessionSender(const SessionSender&) = delete;
  SessionSender& operator=(const SessionSender&) = delete;

  // The stores that keep the session's rounds, for the receiver (before
  // Begin; empty: the receiver's own --store).
  void SetStores(std::vector<std::string> stores) { stores_ = std::move(stores); }
  // Exports the session's image and opens the stream. The engine's
  // statuses (NOT_FOUND, FAILED_PRECONDITION).
  absl::Status Begin();
  // Exports `layer` (done in the current step, or any layer between steps)
  // and queues it.
  absl::Status SendLayer(int layer);
  // After the last layer: exports the tail, sends it and waits for the
  // receiver. OK and the report once the receiver holds the session (the
  // caller then forgets it); otherwise the transfer's status, annotated.
  absl::StatusOr<v1::TransferReport> Finish();
  // The path the transfer took so far: "grpc", or "cuda_ipc" once a device
  // round went device to device (for metrics, after Finish too).
  std::string path() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Item = std::variant<v1::TransferHeader, worker::LayerImage, v1::TransferTail>;
  void Run();
  // Cancels the call and lets the thread finish (REQUIRES mu_).
  void CancelLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Asks the receiver which past rounds it still holds (HeldRounds), so
  // that WriteLayer leaves them out, and, for a session on the GPU, whether
  // it takes the CUDA IPC or the NCCL path (offering an NCCL communicator
  // kept from an earlier hand-off to it, worker::LinkPool). Any failure (an
  // older receiver: UNIMPLEMENTED) leaves nothing out and keeps to gRPC.
  void AskHeld();
  // Names the layer's device rounds in `info` for the receiver to copy
  // (CUDA IPC, lending their layers until this sender is destroyed) or to
  // receive (NCCL: the layers to send after the start message go to
  // *sends), or reads them back into the layer's pieces (gRPC). False and
  // `failure_` when a layer cannot be read back.
  bool PlaceDeviceRounds(worker::LayerImage* li, v1::TransferLayer* info, uint64_t* device_bytes,
                         std::vector<std::shared_ptr<worker::DeviceLayer>>* sends);
  // Joins the NCCL communicator named in the header (rank 0); on failure
  // the transfer keeps to gRPC, and the receiver's join fails likewise.
  void JoinNccl();
  // Records our own failure and cancels the call.
  void Fail(absl::Status st);
  // Writes one layer: its start, its bytes in data-only messages that
  // reference the image's buffers (no copy), its end; false when the stream
  // broke. Rounds the receiver holds at this layer are named, not sent.
  bool WriteLayer(worker::LayerImage li);

  worker::SessionTransfer transfer_;  // Over the engine.
  const worker::SessionKey id_;
  const std::string target_;
  const std::string authorization_;
  const absl::Time deadline_;
  const size_t chunk_bytes_;
  grpc::ClientContext ctx_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<RawCall> call_;
  worker::SessionImage image_;
  std::vector<std::string> stores_;
  // Set by Begin, read by the thread: the session's incarnation and whether
  // it has past rounds; then, written by the thread only, the receiver's
  // held rounds (round -> its layers there).
  uint64_t incarnation_ = 0;
  bool has_past_ = false;
  std::vector<worker::HandoffCache::Held> held_;
  // The CUDA IPC path: set by Begin (the offer, or why there is none), then
  // by the thread only (the receiver's answer, the layers lent to it).
  bool on_device_ = false;
  std::optional<v1::DeviceIdentity> offer_;
  std::string device_path_;  // "cuda_ipc", "nccl", or empty (gRPC).
  std::string nccl_id_;
  std::unique_ptr<worker::DeviceLink> link_;
  bool link_reused_ = false;  // link_ came from the pool (LinkPool).
  std::string refusal_;
  // The CUDA IPC path to a receiver that reads packed round layers
  // (HeldRoundsResponse.ipc_offsets), with --ipc_pack_mib above 0: this
  // hand-off's are copied into pack_ (made at the first device round), so
  // that the receiver opens a handle for many.
  bool packs_ = false;
  std::shared_ptr<worker::IpcPack> pack_;
  bool pack_refused_ = false;  // NewIpcPack failed: each layer is named as it is.
  // What the receiver may read until it answers: device layers and the pack.
  std::vector<std::shared_ptr<void>> lent_;
  bool answered_ ABSL_GUARDED_BY(mu_) = false;  // The receiver took the session.
  std::thread thread_;

  absl::Mutex mu_;
  std::chrono::steady_clock::time_point first_layer_ ABSL_GUARDED_BY(mu_);
  bool sent_layer_ ABSL_GUARDED_BY(mu_) = false;
  // When the thread wrote the tail: the stream had caught up.
  std::chrono::steady_clock::time_point tail_written_ ABSL_GUARDED_BY(mu_);
  // The tail (or a cancel) is queued: nothing more comes.
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;  // The thread has finished the call.
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
  absl::Status failure_ ABSL_GUARDED_BY(mu_);  // Ours, when we broke the stream.
  v1::TransferReport report_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier

#endif  // KVTIER_SERVICES_WORKER_SESSION_SENDER_H_
