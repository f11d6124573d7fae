// A session's hand-off between workers (docs/transfer.md): the sender
// exports it layer by layer while its prefill runs, the receiver prepares
// each layer as it lands and imports the session at the tail; the CUDA IPC
// and NCCL paths are negotiated here; the hand-off cache remembers what a
// departed session's rounds were, so that only what the receiver lacks
// travels back. The past rounds' tensors travel as the codec left them, the
// open round in the model's dtype.
#ifndef KVTIER_WORKER_TRANSFER_H_
#define KVTIER_WORKER_TRANSFER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/device/link_pool.h"
#include "worker/device/transfer.h"
#include "worker/engine.h"
#include "worker/handoff_cache.h"

namespace kvtier::worker {

// Works on an engine's sessions and budgets; a view: it holds no state of
// its own, so any number may exist for one engine. Thread-safe as the
// engine is; the engine must outlive it.
class SessionTransfer {
 public:
  explicit SessionTransfer(Engine* engine) : e_(*engine) {}

  // Export: the session's image, then each layer once the current step has
  // passed it (or at once between steps), then the tail once the step is
  // done. The session stays here; ForgetSession drops it once the receiver
  // has it. The caller must not step the session while it exports.
  // OK; NOT_FOUND; FAILED_PRECONDITION while EndRound runs, for a layer the
  // step has not reached, or for the tail in the middle of a step.
  // A layer living on the GPU only is read back into the pieces, byte for
  // byte, unless `device_rounds`: then it is lent as it is (LayerImage::
  // device_rounds), for the CUDA IPC path or a later ResolveDevice.
  absl::StatusOr<SessionImage> ExportSession(const SessionKey& id) const;
  absl::StatusOr<LayerImage> ExportLayer(const SessionKey& id, int layer,
                                         bool device_rounds = false) const;
  absl::Status ExportTail(const SessionKey& id, SessionImage* image) const;
  // What a receiver checks before and while it takes `bytes` of a session:
  // ALREADY_EXISTS when it holds the session, RESOURCE_EXHAUSTED past its
  // session or working-set limits (engine and tenant).
  absl::Status CheckImport(const SessionKey& id, uint64_t bytes) const;
  // Holds working-set bytes for a session arriving here (Engine::IncomingHold).
  std::unique_ptr<Engine::IncomingHold> HoldIncoming(const std::string& tenant);
  // Opens `id` from a transfer: `layers` holds every layer in order. The
  // session is as the sender had it: same past rounds, residency, recall
  // selection and open round, placed by this engine's placement (rounds a
  // layer carries as device_rounds stay on the GPU, or are read back for a
  // host session or layer L_w). The rounds a layer reuses come
  // out of the hand-off cache, which must still hold them. OK;
  // INVALID_ARGUMENT for an image that does not fit itself or the policy;
  // DATA_LOSS for malformed tensors; FAILED_PRECONDITION when a reused round
  // is no longer held here (the sender sends the step again, in full); the
  // statuses of CheckImport.
  // `reused_bytes`, when set, gets the encoded bytes taken from the cache.
  absl::Status ImportSession(const SessionKey& id, const SessionImage& image,
                             std::vector<LayerImage> layers, uint64_t* reused_bytes = nullptr);
  absl::Status ImportSession(const SessionKey& id, const SessionImage& image,
                             std::vector<LayerImage> layers, uint64_t* reused_bytes,
                             std::unique_ptr<PreparedImport> prepared);
  // A receiver does most of ImportSession while the layers arrive, not at
  // the tail: BeginImport (at the transfer's header; null for a shape or
  // watershed ImportSession would refuse) makes, when the session will live
  // on this worker's GPU, its device working set; PrepareLayer (as each
  // layer lands, checked) makes the layer's open round the session's open
  // layer and, on the GPU, uploads the layer's travelled rounds and loads the
  // open round into the device's mirror. ImportSession then adopts them. On
  // an H100 the device work, a few allocations and copies for every layer,
  // was nearly all of a hand-off's exposed time when it waited for the tail;
  // on the CPU, copying a 512-token prefill's open rounds (64 MiB) was.
  std::unique_ptr<PreparedImport> BeginImport(const ModelShape& shape,
                                              const SessionPolicy& policy) const;
  absl::Status PrepareLayer(PreparedImport& prep, LayerImage& li) const;
  // The device path this worker takes device rounds by from a sender with
  // identity `peer`: "cuda_ipc" (its GPU, IpcPeerCheck and ProbeIpcPeer
  // pass) or "nccl" (another GPU, NCCL on both sides); FAILED_PRECONDITION
  // saying why none (the paths are off, sessions here are placed in host
  // memory, no device, or the checks fail).
  absl::StatusOr<std::string> AcceptsDeviceRounds(const DeviceIdentity& peer) const;
  // A device path accepted from `peer` failed on a round (not for want of
  // memory): later negotiations with that sender refuse it.
  void DeviceRoundsFailed(const DeviceIdentity& peer, const std::string& path,
                          const absl::Status& why);
  // This worker's identity for offering the CUDA IPC path, or why it offers
  // none (FAILED_PRECONDITION).
  absl::StatusOr<DeviceIdentity> OffersDeviceRounds() const;
  // NCCL communicators kept between hand-offs: a sender's keyed by the
  // receiver's address, a receiver's by the sender's process (ProcessKey).
  LinkPool& device_links();
  uint64_t ipc_pack_bytes() const;
  // Drops a session that moved to another worker: no store call (its rounds
  // and recall counters are the receiver's now). With `keep_rounds` its past
  // rounds go to the hand-off cache. OK; NOT_FOUND.
  absl::Status ForgetSession(const SessionKey& id, bool keep_rounds = false);
  // What the hand-off cache holds of `id` at `incarnation`, per round its
  // resident layers, leased until `lease_until` (a sender asks before it
  // streams, and leaves these rounds out).
  std::vector<HandoffCache::Held> HeldRounds(const SessionKey& id, uint64_t incarnation,
                                             absl::Time lease_until);
  HandoffCache::Totals HandoffTotals() const;
  // Undoes the last step, a prefill of n tokens that committed (its
  // transfer failed): the session is as before the step. OK; NOT_FOUND;
  // FAILED_PRECONDITION when the open round has fewer than n tokens.
  absl::Status RevertPrefill(const SessionKey& id, int64_t n);

 private:
  using Session = Engine::Session;
  Engine& e_;
};

}  // namespace kvtier::worker

#endif  // KVTIER_WORKER_TRANSFER_H_
