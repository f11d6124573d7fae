// The GPU working set of a worker session (ARCHITECTURE.md §5): past rounds'
// encoded K/V live in device memory as the codec left them, the open round
// has a device mirror, and each layer's attention runs there
// (kvtier::cuda::SegmentedAttention dequantizes inside both products).
//
// Built only with CUDA (KVTIER_HAVE_CUDA); without it every function says so
// (DeviceBuiltIn() is false and uploads return FAILED_PRECONDITION), and the
// engine keeps its working sets in host memory.
//
// Codecs the device path reads: raw (fp32, fp16, bf16), KIVI and KCVT (with
// their residual rows). GEAR's low-rank and outlier parts are not implemented
// on the device: such sessions stay in host memory.
#ifndef KVTIER_WORKER_DEVICE_ATTENTION_H_
#define KVTIER_WORKER_DEVICE_ATTENTION_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/codec.h"
#include "kernels/speculation.h"
#include "worker/device/block_cache.h"
#include "worker/device/layout.h"
#include "worker/device/transfer.h"

namespace kvtier::worker {

// True when this build has the CUDA path.
bool DeviceBuiltIn();
// True when it is built in and the runtime sees a device.
bool DeviceUsable();
// OK when DeviceUsable(); otherwise FAILED_PRECONDITION saying why.
absl::Status DeviceStatus();
// OK when the device path can hold tensors of this codec; otherwise why not.
absl::Status DeviceSupportsCodec(const CodecConfig& codec);

// One layer of one past round on the device: per KV head an encoded K and V.
class DeviceLayer {
 public:
  virtual ~DeviceLayer() = default;
  // Device bytes held (the encoded buffers, aligned).
  virtual int64_t bytes() const = 0;
  // Copies the layer's staged array back into *staged (a hand-off of the
  // session reads its layers back this way).
  virtual absl::Status Download(std::string* staged) const = 0;
  // The layer's serialized tensors (K, V per KV head) made again from what
  // Download gives: INTERNAL for a layer uploaded without its serialized
  // tensors.
  absl::Status Serialized(std::vector<std::string>* tensors) const;
  // The staged array's size (what Download gives).
  virtual size_t staged_bytes() const = 0;
  // How each tensor is made again from the staged array (K, V per head;
  // empty when the layer cannot be read back).
  const std::vector<Unstaging>& unstaging() const { return unstaging_; }
  // The CUDA IPC handle of the staged array's allocation (64 bytes), for a
  // receiver in another process on this GPU (docs/transfer.md).
  virtual absl::StatusOr<std::string> IpcHandle() const = 0;

 protected:
  // Per KV head, K then V; empty when the upload had no serialized tensors.
  std::vector<Unstaging> unstaging_;
};

// Uploads one layer: heads[h] = (K view, V view) of KV head h, each
// [1, len_h, d]. `tensors` holds the serialized tensors the views were
// parsed from (K, V per head), or nothing: with them the layer can be read
// back (DeviceLayer::Serialized; without them, or when the views do not lie
// inside them, it attends all the same but cannot be read back). The views
// may be released afterwards.
absl::StatusOr<std::unique_ptr<DeviceLayer>> UploadLayer(
    const std::vector<std::pair<EncodedView, EncodedView>>& heads, int head_dim,
    const std::vector<std::string_view>& tensors = {});

// This process's identity for the CUDA IPC path, its probe buffer made on
// first use. FAILED_PRECONDITION without a usable device.
absl::StatusOr<DeviceIdentity> LocalDeviceIdentity();

// Makes the device ready before the first request needs it: creates this
// process's CUDA context and, with `identity`, its LocalDeviceIdentity. A
// worker that left this to its first session paid about 0.1 s there (on an
// H100: a decode worker's first hand-off took 104 ms longer than the rest).
absl::Status WarmDevice(bool identity);

// OK when this process reads `peer`'s probe through its IPC handle and finds
// its nonce (IpcPeerCheck having passed); FAILED_PRECONDITION saying why
// not. Remembered per peer handle.
absl::Status ProbeIpcPeer(const DeviceIdentity& peer);

// Where a packed round layer lies for the receiver: the CUDA IPC handle of
// an allocation (64 bytes) and the staged array's offset in it.
struct IpcPlace {
  std::string handle;
  uint64_t offset = 0;
};

// A hand-off's device rounds packed for a receiver on this GPU (the CUDA IPC
// path, docs/transfer.md): each round layer of at most kIpcPackMaxLayerBytes
// is copied after the last into an allocation of kIpcPackBytes (a new one
// when it is full), so that the receiver opens one handle for many round
// layers instead of one each (an open and a close cost 0.1-0.3 ms on an
// H100). Larger layers, and any past `cap_bytes` packed, are named as they
// are, at offset 0. The pack must live until the receiver has answered (it
// has then closed its handles).
class IpcPack {
 public:
  static constexpr size_t kIpcPackBytes = size_t{16} << 20;
  static constexpr size_t kIpcPackMaxLayerBytes = size_t{4} << 20;
  virtual ~IpcPack() = default;
  // Copies `layer`'s staged array in (on the pack's stream) and says where
  // it lies.
  virtual absl::StatusOr<IpcPlace> Place(const DeviceLayer& layer) = 0;
  // Waits for the copies placed so far: before their description is sent.
  virtual absl::Status Sync() = 0;
  // Allocations made for the pack, and bytes copied into them.
  virtual int allocations() const = 0;
  virtual uint64_t packed_bytes() const = 0;
};
// FAILED_PRECONDITION without a usable device.
absl::StatusOr<std::unique_ptr<IpcPack>> NewIpcPack(uint64_t cap_bytes);

// Another process's device memory as one transfer reads it. With
// `keep_open` (a sender that packs round layers, IpcPack), each allocation
// is opened once, at its first round layer, and every one is closed when the
// source goes (the receiver lets it go before it answers, after which the
// sender may free them); without, each is opened for its copy and closed
// right after it.
class IpcSource {
 public:
  virtual ~IpcSource() = default;
  // A round layer copied out of the allocation behind `ipc_handle`: its
  // staged array of layout.staged_bytes at `offset` (a multiple of 256),
  // which must lie inside the allocation (checked before the copy), copied
  // device to device into an allocation of this process; the copy is done
  // when this returns.
  virtual absl::StatusOr<std::unique_ptr<DeviceLayer>> CopyLayer(std::string_view ipc_handle,
                                                                 uint64_t offset,
                                                                 DeviceRoundLayout layout) = 0;
  // Allocations opened so far.
  virtual int opened() const = 0;
};
std::unique_ptr<IpcSource> NewIpcSource(bool keep_open);

// ---- NCCL between GPUs (docs/transfer.md, "The NCCL path") ----

// True when this build has NCCL (with CUDA) and its library loaded.
bool NcclBuiltIn();
// CUDA devices visible to this process (0 without CUDA or a driver).
int DeviceCount();

// How long this process has spent in the CUDA calls that move working sets
// on and off its GPU, by kind, since it started: "alloc" and "free"
// (cudaMalloc, cudaFree), "upload" (host to device), "download" (device to host), "copy" (device
// to device), "ipc_open" and "ipc_close" (another process's allocation).
// For /metrics (kvtier_worker_device_call_*); empty without CUDA.
struct DeviceCallTime {
  const char* call;
  uint64_t count = 0;
  double seconds = 0;
};
std::vector<DeviceCallTime> DeviceCallTimes();

// Device blocks freed by working sets, received rounds and kernel scratch
// are kept for reuse, up to a cap (worker/device/block_cache.h; docs/gpu.md,
// "Device memory"): cudaMalloc and cudaFree cost more than most copies they
// serve. kvtier-worker's --device_cache_mib sets the cap (0 turns reuse
// off); DeviceCacheState gives what is held, for /metrics. Without CUDA
// both do nothing.
inline constexpr size_t kDefaultDeviceCacheBytes = size_t{512} << 20;
void SetDeviceCacheBytes(size_t bytes);
BlockCache::Stats DeviceCacheState();
// Makes device `ordinal` the calling thread's. kvtier-worker uses the
// first visible device on every thread; the NCCL test puts its two ranks on
// two devices this way.
absl::Status UseDevice(int ordinal);

// A two-rank NCCL communicator between a hand-off's sender (rank 0) and its
// receiver (rank 1), for one transfer. Every wait ends by its deadline:
// past it the communicator is aborted and the call says DEADLINE_EXCEEDED.
class DeviceLink {
 public:
  virtual ~DeviceLink() = default;
  // Rank 0: sends the layer's staged array, and waits until it is sent.
  virtual absl::Status Send(const DeviceLayer& layer, absl::Time deadline) = 0;
  // Rank 1: receives a round laid out as `layout` (CheckDeviceRound) into a
  // new layer of this process.
  virtual absl::StatusOr<std::unique_ptr<DeviceLayer>> Receive(DeviceRoundLayout layout,
                                                               absl::Time deadline) = 0;
};

// A new communicator's id (ncclUniqueId, 128 bytes), made by rank 0 and
// handed to rank 1 on the stream.
absl::StatusOr<std::string> NewLinkId();
// Joins the communicator `id` as `rank`; both ranks must join by `deadline`.
absl::StatusOr<std::unique_ptr<DeviceLink>> JoinLink(std::string_view id, int rank,
                                                     absl::Time deadline);

// Per-session device state: the open round's K/V mirror per layer and the
// scratch buffers of the attention calls.
class DeviceSession {
 public:
  virtual ~DeviceSession() = default;
  // Attention of n new tokens at `layer` (positions base..base+n-1 of the open
  // round) over `rounds` plus the open round, causally. cur_k/cur_v hold the
  // step's n new rows token-major [n, kv_heads, d] on the host; they are
  // uploaded here as the mirror's rows [base, base + n) (earlier ones already
  // are, and a rolled-back step's rows are overwritten by the next). q and
  // out are [n, q_heads, d] on the host.
  virtual absl::Status Attend(int layer, const std::vector<const DeviceLayer*>& rounds,
                              const float* cur_k, const float* cur_v, int64_t base, int64_t n,
                              const float* q, float* out) = 0;
  // Sets the open round's mirror at `layer` to `rows` rows of k and v,
  // token-major [rows, kv_heads, d] on the host (a session arriving in a
  // hand-off with an open round).
  virtual absl::Status LoadOpen(int layer, const float* k, const float* v, int64_t rows) = 0;
};

absl::StatusOr<std::unique_ptr<DeviceSession>> NewDeviceSession(int layers, int q_heads,
                                                                int kv_heads, int head_dim);

// InfiniGen's GPU side (docs/speculation.md, "With a GPU"), for a session
// whose past rounds stay in the host pool: the device holds each layer's
// partial keys, the open round's mirror and the speculated tokens' K/V, no
// more. Two streams: while layer l attends on one (over its gathered tokens
// and the open round), the other scores and selects layer l + 1's tokens
// and uploads their K/V, gathered by the host from the pool meanwhile.
// Calls come from one thread at a time (the session's lock); each Launch is
// followed by its Finish before the next Launch of the same kind.
class DeviceSpeculator {
 public:
  virtual ~DeviceSpeculator() = default;
  // Layer `layer`'s partial keys: KV head h holds the fp16 rows [T_h, r]
  // made of parts[h] in order (each round's rows). Uploaded only when `key`
  // differs from what the layer holds (the rounds and their lengths).
  virtual absl::Status SetPartialKeys(int layer, const std::string& key,
                                      const std::vector<std::vector<std::string_view>>& parts) = 0;
  // Starts scoring and selecting `layer`'s tokens on the speculation stream
  // (cuda::SpeculateSelect): qp [q_heads, r] holds each query head's skewed
  // partial query. The layer's partial keys must be set.
  virtual absl::Status LaunchSelect(int layer, const float* qp, float alpha, int budget) = 0;
  // Waits for the selection: what spec::Speculate gives on the same inputs.
  virtual absl::StatusOr<spec::Speculated> FinishSelect() = 0;
  // Copies `layer`'s gathered K/V (per KV head fp32 [u_h, d]) to the device
  // on the speculation stream; the attention at `layer` waits for it.
  virtual absl::Status UploadGathered(int layer, const std::vector<std::vector<float>>& k,
                                      const std::vector<std::vector<float>>& v) = 0;
  // Starts the attention of one decode token (q [q_heads, d]) at `layer`
  // over its gathered K/V and the open round's rows [0, rows). The mirror
  // holds rows up to MirroredRows(layer); k/v give rows [from, rows) fp32
  // token-major [rows - from, kv_heads, d], from <= MirroredRows(layer).
  virtual absl::Status LaunchAttend(int layer, const float* q, const float* k, const float* v,
                                    int64_t from, int64_t rows) = 0;
  // Waits for it: out [q_heads, d].
  virtual absl::Status FinishAttend(float* out) = 0;
  virtual int64_t MirroredRows(int layer) const = 0;
  // Forgets the open round's mirror (the round ended or a hand-off replaced it).
  virtual void ResetMirror() = 0;
  // Device bytes held.
  virtual int64_t bytes() const = 0;
};

absl::StatusOr<std::unique_ptr<DeviceSpeculator>> NewDeviceSpeculator(int layers, int q_heads,
                                                                      int kv_heads, int head_dim,
                                                                      int partial_columns);

}  // namespace kvtier::worker

#endif  // KVTIER_WORKER_DEVICE_ATTENTION_H_
