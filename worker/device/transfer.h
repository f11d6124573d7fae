// The CUDA IPC path of a hand-off (docs/transfer.md): the checks that decide
// whether a receiver may read a sender's device memory, and the receiver's
// own layout of a device round from what the sender described. Plain C++,
// built with or without CUDA and tested on every machine
// (worker/device_layout_test.cc); the device copies themselves are in
// device_attention_cuda.cc.
#ifndef KVTIER_WORKER_DEVICE_TRANSFER_H_
#define KVTIER_WORKER_DEVICE_TRANSFER_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/device/layout.h"

namespace kvtier::worker {

// A worker process and its GPU (proto DeviceIdentity).
struct DeviceIdentity {
  std::string boot_id;   // The node's boot (/proc/sys/kernel/random/boot_id).
  std::string gpu_uuid;  // 16 bytes, as cudaDeviceProp::uuid.
  uint64_t pid = 0;
  // An IPC handle of a device buffer holding `probe_nonce`.
  std::string probe_handle, probe_nonce;
  bool nccl = false;  // It can join an NCCL communicator.
};

// Names the process `id` describes (node boot, GPU, pid), e.g. as the key
// of what a receiver keeps for one sender.
std::string ProcessKey(const DeviceIdentity& id);

// This node's boot id; empty when it cannot be read.
std::string BootId();

// OK when a process with identity `local` can open `peer`'s CUDA IPC
// handles as far as their identities tell: the same boot of the same node,
// the same GPU, another process, and a probe to read. Otherwise
// FAILED_PRECONDITION saying which of these fails (the probe itself is read
// by ProbeIpcPeer, device_attention.h).
absl::Status IpcPeerCheck(const DeviceIdentity& local, const DeviceIdentity& peer);

// The device path a receiver with identity `local` takes from `peer`, as
// far as their identities tell: "cuda_ipc" for a peer on the same GPU
// (IpcPeerCheck passing; the caller then reads the probe), "nccl" for one
// on another GPU when both can join an NCCL communicator (NCCL refuses two
// ranks on one GPU); FAILED_PRECONDITION saying why neither.
absl::StatusOr<std::string> ChooseDevicePath(const DeviceIdentity& local,
                                             const DeviceIdentity& peer);

// The device paths that failed with a sender after it was accepted (an
// IPC open or copy, an NCCL join or receive): the next negotiation with
// that sender process refuses the path, so that its hand-offs go over gRPC
// instead of failing again. Thread-safe; bounded (forgets everything past
// 1024 peers).
class DevicePeerFailures {
 public:
  void Record(const DeviceIdentity& peer, const std::string& path, const absl::Status& why);
  // OK, or FAILED_PRECONDITION with the failure recorded for this path.
  absl::Status Check(const DeviceIdentity& peer, const std::string& path) const;

 private:
  static std::string Key(const DeviceIdentity& peer, const std::string& path);
  mutable absl::Mutex mu_;
  std::map<std::string, absl::Status> failed_ ABSL_GUARDED_BY(mu_);
};

// A device round as the receiver lays it out: per KV head the K and V
// staging descriptors (offsets into the staged array), their token counts,
// how each tensor is made again from the staged array, and its sizes.
struct DeviceRoundLayout {
  size_t staged_bytes = 0;
  std::vector<std::pair<StagedKv, StagedKv>> heads;  // Regions' `src` unset.
  std::vector<int64_t> lens;
  std::vector<Unstaging> unstaging;  // K, V per head.
  int64_t bytes = 0;                 // The serialized tensors' size.
};

// Checks a sender's description of one device round of a layer of a
// (kv_heads, head_dim) model before any device byte is read: it makes each
// serialized tensor again with zeros where the staged regions go, parses
// it as any received tensor (raw, KIVI or KCVT, [1, len, head_dim], K and V
// of one head the same length), lays the tensors out as the sender's upload
// did, and requires exactly the regions `tensors` names and a staged array
// of exactly `staged_bytes`. INVALID_ARGUMENT otherwise.
absl::StatusOr<DeviceRoundLayout> CheckDeviceRound(std::vector<Unstaging> tensors,
                                                   size_t staged_bytes, int kv_heads, int head_dim);

}  // namespace kvtier::worker

#endif  // KVTIER_WORKER_DEVICE_TRANSFER_H_
