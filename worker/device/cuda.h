// What the CUDA files of worker/device/ share (CUDA builds only; private to
// worker/device/): the device-call timers, CUDA's errors as statuses, the
// process-wide block cache, device buffers, the device form of a past
// round's layer, and one SegmentedAttention call's buffers.
#ifndef KVTIER_WORKER_DEVICE_CUDA_H_
#define KVTIER_WORKER_DEVICE_CUDA_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "worker/device/attention.h"
#include "worker/device/block_cache.h"
#include "worker/device/layout.h"
#include "worker/device/transfer.h"

namespace kvtier::worker {

// DeviceCallTimes' table: calls and nanoseconds per kind, process-wide.
enum DeviceCall { kAlloc, kFree, kUpload, kDownload, kCopy, kIpcOpen, kIpcClose, kDeviceCalls };
inline constexpr const char* kDeviceCallNames[kDeviceCalls] = {
    "alloc", "free", "upload", "download", "copy", "ipc_open", "ipc_close"};
extern std::atomic<uint64_t> device_call_count[kDeviceCalls];
extern std::atomic<uint64_t> device_call_ns[kDeviceCalls];

// Counts the enclosing scope's time as one call of its kind.
class CallTimer {
 public:
  explicit CallTimer(DeviceCall c) : c_(c), start_(std::chrono::steady_clock::now()) {}
  CallTimer(const CallTimer&) = delete;
  CallTimer& operator=(const CallTimer&) = delete;
  ~CallTimer() {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - start_)
                        .count();
    device_call_count[c_].fetch_add(1, std::memory_order_relaxed);
    device_call_ns[c_].fetch_add(static_cast<uint64_t>(ns), std::memory_order_relaxed);
  }

 private:
  const DeviceCall c_;
  const std::chrono::steady_clock::time_point start_;
};

inline absl::Status CudaError(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  if (e == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
  }
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

#define KVT_CUDA(expr, what)                    \
  do {                                          \
    absl::Status st_ = CudaError((expr), what); \
    if (!st_.ok()) return st_;                  \
  } while (0)

// Copies host memory to the device and returns when the device holds it. A
// plain cudaMemcpy from pageable memory may return while its last piece is
// still on its way, on the legacy stream, which the workers' non-blocking
// streams do not wait for.
inline absl::Status CopyToDevice(void* dst, const void* src, size_t bytes, const char* what) {
  KVT_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), what);
  KVT_CUDA(cudaStreamSynchronize(cudaStreamLegacy), what);
  return absl::OkStatus();
}

// Device blocks freed by DeviceBuffers, kept for reuse (worker/device/block_cache.h):
// cudaMalloc and cudaFree (which waits for the whole device) cost more than
// most copies they serve. Process-wide; kvtier-worker's --device_cache_mib
// sets its cap.
BlockCache& DeviceBlocks();

// A device allocation given back with the object (to DeviceBlocks, for
// reuse); or, `pinned`, page-locked host memory, which copies to and from
// the device read and write asynchronously. Its owner's contract: no device
// work that reads or writes it is in flight when it grows or goes (every
// user synchronizes its stream first), since its next owner may write it
// at once.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(bool pinned = false) : pinned_(pinned) {}
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Free(p_, size_); }
  // Grows to at least `bytes`, keeping the first `keep` bytes. No copy may
  // be in flight from or to it.
  absl::Status Reserve(size_t bytes, size_t keep = 0) {
    if (bytes <= size_) return absl::OkStatus();
    size_t want = std::max(bytes, size_ * 2);
    void* p = nullptr;
    if (pinned_) {
      CallTimer timer(kAlloc);
      KVT_CUDA(cudaMallocHost(&p, want), "cudaMallocHost");
    } else {
      KVT_ASSIGN_OR_RETURN(BlockCache::Block b, DeviceBlocks().Take(want));
      p = b.p;
      want = b.size;
    }
    if (keep > 0 && p_ != nullptr) {
      const cudaError_t e = cudaMemcpy(p, p_, std::min(keep, size_), cudaMemcpyDefault);
      if (e != cudaSuccess) {
        Free(p, want);
        return CudaError(e, "cudaMemcpy");
      }
    }
    Free(p_, size_);
    p_ = p;
    size_ = want;
    return absl::OkStatus();
  }
  // Frees the allocation now, bypassing the cache: for a buffer that device
  // work may still touch (an NCCL receive aborted past its deadline), whose
  // cudaFree waits for the device as the cache would not.
  void Discard() {
    if (p_ == nullptr) return;
    if (pinned_) {
      cudaFreeHost(p_);
    } else {
      CallTimer timer(kFree);
      cudaFree(p_);
    }
    p_ = nullptr;
    size_ = 0;
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t size() const { return size_; }

 private:
  void Free(void* p, size_t size) const {
    if (p == nullptr) return;
    if (pinned_) {
      cudaFreeHost(p);
    } else {
      DeviceBlocks().Give({p, size});
    }
  }

  const bool pinned_;
  void* p_ = nullptr;
  size_t size_ = 0;
};

class CudaLayer : public DeviceLayer {
 public:
  int64_t bytes() const override { return static_cast<int64_t>(buf.size()); }
  absl::Status Download(std::string* staged) const override {
    staged->resize(staged_);
    CallTimer timer(kDownload);
    KVT_CUDA(cudaMemcpy(staged->data(), buf.as<uint8_t>(), staged_, cudaMemcpyDeviceToHost),
             "download layer");
    return absl::OkStatus();
  }
  size_t staged_bytes() const override { return staged_; }
  absl::StatusOr<std::string> IpcHandle() const override {
    cudaIpcMemHandle_t h;
    KVT_CUDA(cudaIpcGetMemHandle(&h, buf.as<void>()), "cudaIpcGetMemHandle");
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
  }
  void SetUnstaging(std::vector<Unstaging> u) { unstaging_ = std::move(u); }
  DeviceBuffer buf;
  size_t staged_ = 0;
  // Per KV head, K and V, pointers into buf.
  std::vector<std::pair<cuda::SegKv, cuda::SegKv>> heads;
  std::vector<int64_t> lens;
};

// KV head h's block of an open-round mirror: fp32 rows token-major
// [tokens, kv_heads, d] at k and v, attended causally.
inline cuda::SegBlock OpenMirrorBlock(const float* k, const float* v, int64_t tokens, int kv_heads,
                                      int d, int h) {
  cuda::SegBlock open;
  open.tokens = tokens;
  open.causal = 1;
  open.k.dtype = open.v.dtype = 0;
  open.k.token_stride = open.v.token_stride = static_cast<int64_t>(kv_heads) * d;
  open.k.raw = k + h * d;
  open.v.raw = v + h * d;
  return open;
}

// The device side of one cuda::SegmentedAttention call: its blocks, queries,
// output and scratch, reused from call to call.
class SegmentedCall {
 public:
  // Uploads blocks, first (kv_heads + 1 entries) and q [n, q_heads, d] on
  // `stream`, makes it wait for `wait` (when set), and launches the kernel.
  absl::Status Launch(const std::vector<cuda::SegBlock>& blocks, const std::vector<int>& first,
                      const float* q, const cuda::SegDims& g, cudaStream_t stream,
                      cudaEvent_t wait = nullptr) {
    const size_t bbytes = blocks.size() * sizeof(cuda::SegBlock);
    const size_t fbytes = first.size() * sizeof(int);
    qbytes_ = static_cast<size_t>(g.n) * g.q_heads * g.d * sizeof(float);
    KVT_RETURN_IF_ERROR(meta_.Reserve(bbytes + fbytes));
    KVT_RETURN_IF_ERROR(q_.Reserve(qbytes_));
    KVT_RETURN_IF_ERROR(out_.Reserve(qbytes_));
    KVT_RETURN_IF_ERROR(
        scratch_.Reserve(static_cast<size_t>(cuda::SegmentedScratchFloats(g)) * sizeof(float)));
    // Staged in one host buffer so that the async copies read stable memory.
    staging_.resize(bbytes + fbytes);
    std::memcpy(staging_.data(), blocks.data(), bbytes);
    std::memcpy(staging_.data() + bbytes, first.data(), fbytes);
    KVT_CUDA(cudaMemcpyAsync(meta_.as<uint8_t>(), staging_.data(), bbytes + fbytes,
                             cudaMemcpyHostToDevice, stream),
             "upload blocks");
    KVT_CUDA(cudaMemcpyAsync(q_.as<float>(), q, qbytes_, cudaMemcpyHostToDevice, stream),
             "upload q");
    if (wait != nullptr) KVT_CUDA(cudaStreamWaitEvent(stream, wait, 0), "cudaStreamWaitEvent");
    KVT_CUDA(static_cast<cudaError_t>(cuda::SegmentedAttention(
                 g, meta_.as<cuda::SegBlock>(),
                 reinterpret_cast<const int*>(meta_.as<uint8_t>() + bbytes), q_.as<float>(),
                 scratch_.as<float>(), out_.as<float>(), stream)),
             "SegmentedAttention");
    return absl::OkStatus();
  }
  // Copies the launched call's output to `out` and waits for it.
  absl::Status Finish(float* out, cudaStream_t stream) {
    KVT_CUDA(cudaMemcpyAsync(out, out_.as<float>(), qbytes_, cudaMemcpyDeviceToHost, stream),
             "download out");
    KVT_CUDA(cudaStreamSynchronize(stream), "attention");
    return absl::OkStatus();
  }
  size_t bytes() const { return meta_.size() + q_.size() + out_.size() + scratch_.size(); }

 private:
  DeviceBuffer meta_, q_, out_, scratch_;
  std::vector<uint8_t> staging_;
  size_t qbytes_ = 0;
};

// A layer for a round received over CUDA IPC or NCCL: its allocation, not yet filled.
inline absl::StatusOr<std::unique_ptr<CudaLayer>> NewReceivedLayer(
    const DeviceRoundLayout& layout) {
  auto layer = std::make_unique<CudaLayer>();
  layer->staged_ = layout.staged_bytes;
  KVT_RETURN_IF_ERROR(layer->buf.Reserve(std::max<size_t>(layout.staged_bytes, 1)));
  return layer;
}

// Once its staged array is filled: the descriptors placed in it.
inline std::unique_ptr<DeviceLayer> FinishReceivedLayer(std::unique_ptr<CudaLayer> layer,
                                                        DeviceRoundLayout layout) {
  for (size_t h = 0; h < layout.heads.size(); ++h) {
    layer->heads.emplace_back(PlaceStaged(layout.heads[h].first, layer->buf.as<uint8_t>()),
                              PlaceStaged(layout.heads[h].second, layer->buf.as<uint8_t>()));
  }
  layer->lens = std::move(layout.lens);
  layer->SetUnstaging(std::move(layout.unstaging));
  return layer;
}

}  // namespace kvtier::worker

#endif  // KVTIER_WORKER_DEVICE_CUDA_H_
