// The CUDA build of worker/device_attention.h.
#include <cuda_runtime.h>
#ifdef KVTIER_HAVE_NCCL
#include <dlfcn.h>
#include <nccl.h>

#include <type_traits>
#endif
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <map>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "worker/block_cache.h"
#include "worker/device_attention.h"
#include "worker/device_layout.h"

namespace kvtier::worker {
namespace {

// DeviceCallTimes' table: calls and nanoseconds per kind, process-wide.
enum DeviceCall { kAlloc, kFree, kUpload, kDownload, kCopy, kIpcOpen, kIpcClose, kDeviceCalls };
constexpr const char* kDeviceCallNames[kDeviceCalls] = {"alloc", "free",     "upload",   "download",
                                                        "copy",  "ipc_open", "ipc_close"};
std::atomic<uint64_t> device_call_count[kDeviceCalls];
std::atomic<uint64_t> device_call_ns[kDeviceCalls];

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

absl::Status CudaError(cudaError_t e, const char* what) {
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

// Device blocks freed by DeviceBuffers, kept for reuse (worker/block_cache.h):
// cudaMalloc and cudaFree (which waits for the whole device) cost more than
// most copies they serve. Process-wide; kvtier-worker's --device_cache_mib
// sets its cap.
BlockCache& DeviceBlocks() {
  static BlockCache* cache = new BlockCache(
      kDefaultDeviceCacheBytes,
      [](size_t bytes) -> absl::StatusOr<void*> {
        void* p = nullptr;
        CallTimer timer(kAlloc);
        const cudaError_t e = cudaMalloc(&p, bytes);
        if (e != cudaSuccess) {
          cudaGetLastError();  // Not sticky: clear it.
          return CudaError(e, "cudaMalloc");
        }
        return p;
      },
      [](void* p, size_t) {
        CallTimer timer(kFree);
        cudaFree(p);
      });
  return *cache;
}

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
cuda::SegBlock OpenMirrorBlock(const float* k, const float* v, int64_t tokens, int kv_heads, int d,
                               int h) {
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

class CudaSession : public DeviceSession {
 public:
  CudaSession(int layers, int q_heads, int kv_heads, int d)
      : q_heads_(q_heads), kv_heads_(kv_heads), d_(d), k_(layers), v_(layers) {}
  ~CudaSession() override {
    if (stream_ != nullptr) {
      // Its buffers go back to the block cache next: nothing may be in
      // flight on them (an Attend that failed midway left its copies).
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }

  absl::Status Init() {
    KVT_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    return absl::OkStatus();
  }

  absl::Status Attend(int layer, const std::vector<const DeviceLayer*>& rounds, const float* cur_k,
                      const float* cur_v, int64_t base, int64_t n, const float* q,
                      float* out) override {
    absl::Status st = AttendOnStream(layer, rounds, cur_k, cur_v, base, n, q, out);
    // A call that failed midway may have left copies in flight: none may be
    // when its buffers grow or go back to the block cache.
    if (!st.ok()) cudaStreamSynchronize(stream_);
    return st;
  }

  absl::Status LoadOpen(int layer, const float* k, const float* v, int64_t rows) override {
    const size_t bytes = static_cast<size_t>(rows) * kv_heads_ * d_ * sizeof(float);
    if (bytes == 0) return absl::OkStatus();
    KVT_RETURN_IF_ERROR(k_[layer].Reserve(bytes));
    KVT_RETURN_IF_ERROR(v_[layer].Reserve(bytes));
    CallTimer timer(kUpload);
    KVT_CUDA(cudaMemcpy(k_[layer].as<uint8_t>(), k, bytes, cudaMemcpyHostToDevice), "load open K");
    KVT_CUDA(cudaMemcpy(v_[layer].as<uint8_t>(), v, bytes, cudaMemcpyHostToDevice), "load open V");
    return absl::OkStatus();
  }

 private:
  // Attend's work, launched on stream_ and waited for; an error may leave
  // some of it in flight.
  absl::Status AttendOnStream(int layer, const std::vector<const DeviceLayer*>& rounds,
                              const float* cur_k, const float* cur_v, int64_t base, int64_t n,
                              const float* q, float* out) {
    const size_t row = static_cast<size_t>(kv_heads_) * d_ * sizeof(float);
    const size_t rows = static_cast<size_t>(base + n);
    // The open round's new rows.
    KVT_RETURN_IF_ERROR(k_[layer].Reserve(rows * row, base * row));
    KVT_RETURN_IF_ERROR(v_[layer].Reserve(rows * row, base * row));
    KVT_CUDA(cudaMemcpyAsync(k_[layer].as<uint8_t>() + base * row, cur_k, n * row,
                             cudaMemcpyHostToDevice, stream_),
             "upload K");
    KVT_CUDA(cudaMemcpyAsync(v_[layer].as<uint8_t>() + base * row, cur_v, n * row,
                             cudaMemcpyHostToDevice, stream_),
             "upload V");
    // Blocks per KV head: every round's head h, then the open round.
    std::vector<cuda::SegBlock> blocks;
    std::vector<int> first(kv_heads_ + 1, 0);
    int64_t max_tokens = 0;
    for (int h = 0; h < kv_heads_; ++h) {
      first[h] = static_cast<int>(blocks.size());
      int64_t total = 0;
      for (const DeviceLayer* r : rounds) {
        const auto* cl = static_cast<const CudaLayer*>(r);
        if (cl->lens[h] == 0) continue;
        cuda::SegBlock b;
        b.tokens = cl->lens[h];
        b.k = cl->heads[h].first;
        b.v = cl->heads[h].second;
        blocks.push_back(b);
        total += b.tokens;
      }
      const cuda::SegBlock open =
          OpenMirrorBlock(k_[layer].as<float>(), v_[layer].as<float>(), base + n, kv_heads_, d_, h);
      blocks.push_back(open);
      total += open.tokens;
      max_tokens = std::max(max_tokens, total);
    }
    first[kv_heads_] = static_cast<int>(blocks.size());
    cuda::SegDims g;
    g.n = static_cast<int>(n);
    g.q_heads = q_heads_;
    g.kv_heads = kv_heads_;
    g.d = d_;
    g.base = base;
    g.max_tokens = max_tokens;
    KVT_RETURN_IF_ERROR(call_.Launch(blocks, first, q, g, stream_));
    return call_.Finish(out, stream_);
  }

  int q_heads_, kv_heads_, d_;
  cudaStream_t stream_ = nullptr;
  std::vector<DeviceBuffer> k_, v_;
  SegmentedCall call_;
};

}  // namespace

bool DeviceBuiltIn() { return true; }

std::vector<DeviceCallTime> DeviceCallTimes() {
  std::vector<DeviceCallTime> out;
  for (int c = 0; c < kDeviceCalls; ++c) {
    out.push_back({kDeviceCallNames[c], device_call_count[c].load(std::memory_order_relaxed),
                   1e-9 * static_cast<double>(device_call_ns[c].load(std::memory_order_relaxed))});
  }
  return out;
}

void SetDeviceCacheBytes(size_t bytes) { DeviceBlocks().SetCap(bytes); }
BlockCache::Stats DeviceCacheState() { return DeviceBlocks().stats(); }

bool DeviceUsable() { return cuda::DeviceAvailable(); }

absl::Status DeviceStatus() {
  if (DeviceUsable()) return absl::OkStatus();
  return absl::FailedPreconditionError("no CUDA device is visible");
}

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // Not sticky; cleared for later calls.
    return 0;
  }
  return n;
}

absl::Status UseDevice(int ordinal) {
  if (ordinal < 0 || ordinal >= DeviceCount()) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", ordinal, " of ", DeviceCount(), " visible"));
  }
  KVT_CUDA(cudaSetDevice(ordinal), "cudaSetDevice");
  return absl::OkStatus();
}

absl::Status DeviceSupportsCodec(const CodecConfig& codec) {
  if (codec.codec == v1::CODEC_RAW || codec.codec == v1::CODEC_KIVI ||
      codec.codec == v1::CODEC_KCVT) {
    return absl::OkStatus();
  }
  return absl::UnimplementedError(
      "the device working set reads raw, KIVI and KCVT tensors; GEAR sessions stay in host "
      "memory");
}

absl::StatusOr<std::unique_ptr<DeviceLayer>> UploadLayer(
    const std::vector<std::pair<EncodedView, EncodedView>>& heads, int head_dim,
    const std::vector<std::string_view>& tensors) {
  std::vector<uint8_t> host;
  std::vector<std::pair<StagedKv, StagedKv>> plans;
  std::vector<Unstaging> unstaging;
  bool readable = !tensors.empty() && tensors.size() == 2 * heads.size();
  auto layer = std::make_unique<CudaLayer>();
  for (size_t h = 0; h < heads.size(); ++h) {
    const auto& [k, v] = heads[h];
    KVT_ASSIGN_OR_RETURN(StagedKv pk, StageView(k, head_dim, &host));
    KVT_ASSIGN_OR_RETURN(StagedKv pv, StageView(v, head_dim, &host));
    if (readable) {
      // Without a plan the layer still attends; only reading it back (a
      // hand-off) is refused, by DeviceLayer::Serialized.
      absl::StatusOr<Unstaging> uk = PlanUnstaging(tensors[2 * h], pk);
      absl::StatusOr<Unstaging> uv = PlanUnstaging(tensors[2 * h + 1], pv);
      readable = uk.ok() && uv.ok();
      if (readable) {
        unstaging.push_back(*std::move(uk));
        unstaging.push_back(*std::move(uv));
      }
    }
    plans.emplace_back(std::move(pk), std::move(pv));
    layer->lens.push_back(k.tokens);
  }
  if (!readable) unstaging.clear();
  layer->SetUnstaging(std::move(unstaging));
  layer->staged_ = host.size();
  KVT_RETURN_IF_ERROR(layer->buf.Reserve(std::max<size_t>(host.size(), 1)));
  {
    CallTimer timer(kUpload);
    KVT_CUDA(cudaMemcpy(layer->buf.as<uint8_t>(), host.data(), host.size(), cudaMemcpyHostToDevice),
             "upload layer");
  }
  for (const auto& [pk, pv] : plans) {
    layer->heads.emplace_back(PlaceStaged(pk, layer->buf.as<uint8_t>()),
                              PlaceStaged(pv, layer->buf.as<uint8_t>()));
  }
  return std::unique_ptr<DeviceLayer>(std::move(layer));
}

// ---- The CUDA IPC path (docs/transfer.md) ----

namespace {

absl::StatusOr<cudaIpcMemHandle_t> HandleFrom(std::string_view bytes) {
  cudaIpcMemHandle_t h;
  if (bytes.size() != sizeof(h)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a CUDA IPC handle of ", bytes.size(), " bytes; it has ", sizeof(h)));
  }
  std::memcpy(&h, bytes.data(), sizeof(h));
  return h;
}

// Another process's allocation, open in this one while it lives.
class OpenedHandle {
 public:
  OpenedHandle() = default;
  OpenedHandle(const OpenedHandle&) = delete;
  OpenedHandle& operator=(const OpenedHandle&) = delete;
  ~OpenedHandle() {
    if (p_ != nullptr) {
      CallTimer timer(kIpcClose);
      cudaIpcCloseMemHandle(p_);
    }
  }
  absl::Status Open(std::string_view bytes) {
    KVT_ASSIGN_OR_RETURN(cudaIpcMemHandle_t h, HandleFrom(bytes));
    CallTimer timer(kIpcOpen);
    const cudaError_t e = cudaIpcOpenMemHandle(&p_, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      p_ = nullptr;
      cudaGetLastError();  // Not sticky: clear it.
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot open the sender's device memory (cudaIpcOpenMemHandle: ", cudaGetErrorString(e),
          ")"));
    }
    return absl::OkStatus();
  }
  const void* get() const { return p_; }

 private:
  void* p_ = nullptr;
};

// The size of the allocation `p` starts, through the driver's
// cuMemGetAddressRange (looked up at run time: kvtier does not link
// libcuda). FAILED_PRECONDITION when the driver does not say, or `p` is not
// an allocation's start.
absl::StatusOr<size_t> AllocationSize(const void* p) {
  using GetRange = int (*)(unsigned long long*, size_t*, unsigned long long);
  static const GetRange get_range = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      return static_cast<GetRange>(nullptr);
    }
    return reinterpret_cast<GetRange>(f);
  }();
  if (get_range == nullptr) {
    return absl::FailedPreconditionError(
        "the CUDA driver does not give cuMemGetAddressRange: an opened allocation's size cannot "
        "be checked");
  }
  unsigned long long base = 0;
  size_t size = 0;
  const auto at = static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(p));
  if (get_range(&base, &size, at) != 0 || base != at) {
    return absl::FailedPreconditionError("the opened device memory is not an allocation's start");
  }
  return size;
}

constexpr size_t kNonceBytes = 16;

struct Probe {
  absl::Mutex mu;
  bool made ABSL_GUARDED_BY(mu) = false;
  absl::StatusOr<DeviceIdentity> id ABSL_GUARDED_BY(mu) = absl::UnknownError("unset");
  void* buffer ABSL_GUARDED_BY(mu) = nullptr;  // Kept for the process's life.
  // Peers probed: (handle, nonce) -> what the probe found.
  std::map<std::string, absl::Status> peers ABSL_GUARDED_BY(mu);
};

Probe& TheProbe() {
  static Probe* p = new Probe;
  return *p;
}

absl::StatusOr<DeviceIdentity> MakeIdentity(void** buffer) {
  KVT_RETURN_IF_ERROR(DeviceStatus());
  DeviceIdentity id;
  int dev = 0;
  KVT_CUDA(cudaGetDevice(&dev), "cudaGetDevice");
  cudaDeviceProp prop;
  KVT_CUDA(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  id.gpu_uuid.assign(prop.uuid.bytes, sizeof(prop.uuid.bytes));
  id.boot_id = BootId();
  id.pid = static_cast<uint64_t>(getpid());
  id.nccl = NcclBuiltIn();
  std::random_device rd;
  id.probe_nonce.resize(kNonceBytes);
  for (char& c : id.probe_nonce) c = static_cast<char>(rd());
  KVT_CUDA(cudaMalloc(buffer, 256), "cudaMalloc probe");
  KVT_CUDA(cudaMemcpy(*buffer, id.probe_nonce.data(), kNonceBytes, cudaMemcpyHostToDevice),
           "write probe");
  cudaIpcMemHandle_t h;
  KVT_CUDA(cudaIpcGetMemHandle(&h, *buffer), "cudaIpcGetMemHandle probe");
  id.probe_handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  return id;
}

}  // namespace

absl::StatusOr<DeviceIdentity> LocalDeviceIdentity() {
  Probe& p = TheProbe();
  absl::MutexLock lock(&p.mu);
  if (!p.made) {
    p.made = true;
    p.id = MakeIdentity(&p.buffer);
  }
  return p.id;
}

absl::Status WarmDevice(bool identity) {
  if (!cuda::DeviceAvailable()) return absl::FailedPreconditionError("no CUDA device is visible");
  KVT_CUDA(cudaFree(nullptr), "creating the CUDA context");
  if (identity) KVT_RETURN_IF_ERROR(LocalDeviceIdentity().status());
  return absl::OkStatus();
}

absl::Status ProbeIpcPeer(const DeviceIdentity& peer) {
  const std::string key = peer.probe_handle + peer.probe_nonce;
  Probe& p = TheProbe();
  {
    absl::MutexLock lock(&p.mu);
    auto it = p.peers.find(key);
    if (it != p.peers.end()) return it->second;
  }
  absl::Status st = [&]() -> absl::Status {
    OpenedHandle opened;
    KVT_RETURN_IF_ERROR(opened.Open(peer.probe_handle));
    std::string seen(kNonceBytes, '\0');
    KVT_CUDA(cudaMemcpy(seen.data(), opened.get(), kNonceBytes, cudaMemcpyDeviceToHost),
             "read probe");
    if (seen != peer.probe_nonce) {
      return absl::FailedPreconditionError("the sender's probe does not hold its nonce");
    }
    // Every round's copy checks its allocation's size this way.
    KVT_ASSIGN_OR_RETURN(size_t size, AllocationSize(opened.get()));
    if (size < kNonceBytes) return absl::FailedPreconditionError("the probe's size is wrong");
    return absl::OkStatus();
  }();
  if (!st.ok()) st = absl::FailedPreconditionError(absl::StrCat("CUDA IPC probe: ", st.message()));
  absl::MutexLock lock(&p.mu);
  if (p.peers.size() >= 1024) p.peers.clear();
  p.peers.emplace(key, st);
  return st;
}

namespace {

// A layer for a received round: its allocation, not yet filled.
absl::StatusOr<std::unique_ptr<CudaLayer>> NewReceivedLayer(const DeviceRoundLayout& layout) {
  auto layer = std::make_unique<CudaLayer>();
  layer->staged_ = layout.staged_bytes;
  KVT_RETURN_IF_ERROR(layer->buf.Reserve(std::max<size_t>(layout.staged_bytes, 1)));
  return layer;
}

// Once its staged array is filled: the descriptors placed in it.
std::unique_ptr<DeviceLayer> FinishReceivedLayer(std::unique_ptr<CudaLayer> layer,
                                                 DeviceRoundLayout layout) {
  for (size_t h = 0; h < layout.heads.size(); ++h) {
    layer->heads.emplace_back(PlaceStaged(layout.heads[h].first, layer->buf.as<uint8_t>()),
                              PlaceStaged(layout.heads[h].second, layer->buf.as<uint8_t>()));
  }
  layer->lens = std::move(layout.lens);
  layer->SetUnstaging(std::move(layout.unstaging));
  return layer;
}

}  // namespace

namespace {

constexpr uint64_t kIpcAlign = 256;

class CudaIpcPack : public IpcPack {
 public:
  explicit CudaIpcPack(uint64_t cap_bytes) : cap_(cap_bytes) {}
  ~CudaIpcPack() override {
    if (stream_ != nullptr) {
      // No copy may still write a buffer as it goes back to the cache.
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }

  absl::Status Init() {
    KVT_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    return absl::OkStatus();
  }

  absl::StatusOr<IpcPlace> Place(const DeviceLayer& layer) override {
    const auto& cl = static_cast<const CudaLayer&>(layer);
    const size_t n = cl.staged_bytes();
    if (n > kIpcPackMaxLayerBytes || packed_ + n > cap_) {
      KVT_ASSIGN_OR_RETURN(std::string handle, cl.IpcHandle());
      return IpcPlace{std::move(handle), 0};
    }
    size_t at = (used_ + kIpcAlign - 1) / kIpcAlign * kIpcAlign;
    if (chunks_.empty() || at + n > chunks_.back().buf.size()) {
      Chunk& c = chunks_.emplace_back();
      cudaIpcMemHandle_t h;
      absl::Status made = c.buf.Reserve(kIpcPackBytes);
      if (made.ok())
        made = CudaError(cudaIpcGetMemHandle(&h, c.buf.as<void>()), "cudaIpcGetMemHandle");
      if (!made.ok()) {
        chunks_.pop_back();  // Never named: the next layer tries a new one.
        return made;
      }
      c.handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
      at = 0;
    }
    Chunk& c = chunks_.back();
    KVT_CUDA(cudaMemcpyAsync(c.buf.as<uint8_t>() + at, cl.buf.as<void>(), n,
                             cudaMemcpyDeviceToDevice, stream_),
             "pack device round");
    used_ = at + n;
    packed_ += n;
    return IpcPlace{c.handle, at};
  }

  absl::Status Sync() override {
    CallTimer timer(kCopy);
    KVT_CUDA(cudaStreamSynchronize(stream_), "pack device rounds");
    return absl::OkStatus();
  }

  int allocations() const override { return static_cast<int>(chunks_.size()); }
  uint64_t packed_bytes() const override { return packed_; }

 private:
  struct Chunk {
    DeviceBuffer buf;
    std::string handle;
  };
  const uint64_t cap_;
  cudaStream_t stream_ = nullptr;
  std::deque<Chunk> chunks_;  // A deque: a Chunk's buffer never moves.
  size_t used_ = 0;           // In the last chunk.
  uint64_t packed_ = 0;
};

class CudaIpcSource : public IpcSource {
 public:
  explicit CudaIpcSource(bool keep_open) : keep_open_(keep_open) {}
  absl::StatusOr<std::unique_ptr<DeviceLayer>> CopyLayer(std::string_view ipc_handle,
                                                         uint64_t offset,
                                                         DeviceRoundLayout layout) override {
    if (offset % kIpcAlign != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("a device round at offset ", offset, ", not a multiple of ", kIpcAlign));
    }
    auto it = open_.find(ipc_handle);
    if (it == open_.end()) {
      auto o = std::make_unique<Opened>();
      KVT_RETURN_IF_ERROR(o->handle.Open(ipc_handle));
      KVT_ASSIGN_OR_RETURN(o->size, AllocationSize(o->handle.get()));
      it = open_.emplace(std::string(ipc_handle), std::move(o)).first;
      ++opened_;
    }
    const Opened& src = *it->second;
    if (offset > src.size || layout.staged_bytes > src.size - offset) {
      return absl::InvalidArgumentError(absl::StrCat("the sender's device allocation holds ",
                                                     src.size, " bytes; its round says ",
                                                     layout.staged_bytes, " at offset ", offset));
    }
    KVT_ASSIGN_OR_RETURN(std::unique_ptr<CudaLayer> layer, NewReceivedLayer(layout));
    {
      CallTimer timer(kCopy);
      KVT_CUDA(
          cudaMemcpy(layer->buf.as<void>(), static_cast<const uint8_t*>(src.handle.get()) + offset,
                     layout.staged_bytes, cudaMemcpyDeviceToDevice),
          "copy device round");
    }
    // Closed before the sender may free it: now, unless the sender packs.
    if (!keep_open_) open_.erase(it);
    return FinishReceivedLayer(std::move(layer), std::move(layout));
  }

  int opened() const override { return opened_; }

 private:
  struct Opened {
    OpenedHandle handle;  // Closed with the source, before the sender may free it.
    size_t size = 0;
  };
  const bool keep_open_;
  std::map<std::string, std::unique_ptr<Opened>, std::less<>> open_;
  int opened_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<IpcPack>> NewIpcPack(uint64_t cap_bytes) {
  KVT_RETURN_IF_ERROR(DeviceStatus());
  auto p = std::make_unique<CudaIpcPack>(cap_bytes);
  KVT_RETURN_IF_ERROR(p->Init());
  return std::unique_ptr<IpcPack>(std::move(p));
}

std::unique_ptr<IpcSource> NewIpcSource(bool keep_open) {
  return std::make_unique<CudaIpcSource>(keep_open);
}

// ---- NCCL ----

#ifdef KVTIER_HAVE_NCCL

namespace {

// NCCL, loaded at first use (dlopen): kvtier-worker does not depend on it
// to start, and a node without it keeps to CUDA IPC and gRPC.
struct NcclApi {
  bool loaded = false;
  std::string error;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRankConfig) init_rank_config = nullptr;
  decltype(&ncclCommGetAsyncError) get_async_error = nullptr;
  decltype(&ncclCommAbort) abort = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
};

const NcclApi& Nccl() {
  static const NcclApi* api = [] {
    auto* a = new NcclApi;
    void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* e = dlerror();
      a->error = absl::StrCat("NCCL is not installed here (", e != nullptr ? e : "dlopen", ")");
      return a;
    }
    bool all = true;
    auto get = [&](auto* fn, const char* name) {
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(dlsym(h, name));
      all = all && *fn != nullptr;
    };
    get(&a->get_unique_id, "ncclGetUniqueId");
    get(&a->init_rank_config, "ncclCommInitRankConfig");
    get(&a->get_async_error, "ncclCommGetAsyncError");
    get(&a->abort, "ncclCommAbort");
    get(&a->send, "ncclSend");
    get(&a->recv, "ncclRecv");
    get(&a->error_string, "ncclGetErrorString");
    a->loaded = all;
    if (!all)
      a->error = "the NCCL installed here lacks the calls kvtier needs (NCCL 2.14 or later)";
    return a;
  }();
  return *api;
}

absl::Status NcclError(ncclResult_t r, const char* what) {
  if (r == ncclSuccess || r == ncclInProgress) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what, ": ", Nccl().error_string(r)));
}

class NcclLink : public DeviceLink {
 public:
  ~NcclLink() override {
    if (comm_ != nullptr) {
      // Finished cleanly or not, nothing is in flight that we still want.
      Nccl().abort(comm_);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Join(const ncclUniqueId& id, int rank, absl::Time deadline) {
    rank_ = rank;
    KVT_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // Every wait is ours, with a deadline.
    KVT_RETURN_IF_ERROR(
        NcclError(Nccl().init_rank_config(&comm_, 2, id, rank, &config), "ncclCommInitRank"));
    return WaitComm(deadline, "joining the NCCL communicator");
  }

  absl::Status Send(const DeviceLayer& layer, absl::Time deadline) override {
    if (rank_ != 0) return absl::InternalError("only rank 0 sends");
    const auto& cl = static_cast<const CudaLayer&>(layer);
    KVT_RETURN_IF_ERROR(
        NcclError(Nccl().send(cl.buf.as<void>(), cl.staged_bytes(), ncclUint8, 1, comm_, stream_),
                  "ncclSend"));
    return WaitStream(deadline, "sending a device round");
  }

  absl::StatusOr<std::unique_ptr<DeviceLayer>> Receive(DeviceRoundLayout layout,
                                                       absl::Time deadline) override {
    if (rank_ != 1) return absl::InternalError("only rank 1 receives");
    KVT_ASSIGN_OR_RETURN(std::unique_ptr<CudaLayer> layer, NewReceivedLayer(layout));
    KVT_RETURN_IF_ERROR(NcclError(
        Nccl().recv(layer->buf.as<void>(), layout.staged_bytes, ncclUint8, 0, comm_, stream_),
        "ncclRecv"));
    if (absl::Status st = WaitStream(deadline, "receiving a device round"); !st.ok()) {
      layer->buf.Discard();  // The receive may not have stopped writing it.
      return st;
    }
    return FinishReceivedLayer(std::move(layer), std::move(layout));
  }

 private:
  // The communicator's pending operation done, failed, or past the deadline.
  absl::Status WaitComm(absl::Time deadline, const char* what) {
    for (;;) {
      ncclResult_t state = ncclSuccess;
      KVT_RETURN_IF_ERROR(
          NcclError(Nccl().get_async_error(comm_, &state), "ncclCommGetAsyncError"));
      if (state == ncclSuccess) return absl::OkStatus();
      if (state != ncclInProgress) return NcclError(state, what);
      if (absl::Now() > deadline) return Expired(what);
      absl::SleepFor(absl::Microseconds(50));
    }
  }

  // The stream's work (one send or receive) done, the peer failed, or past
  // the deadline.
  absl::Status WaitStream(absl::Time deadline, const char* what) {
    KVT_RETURN_IF_ERROR(WaitComm(deadline, what));
    for (;;) {
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return CudaError(e, what);
      ncclResult_t state = ncclSuccess;
      KVT_RETURN_IF_ERROR(
          NcclError(Nccl().get_async_error(comm_, &state), "ncclCommGetAsyncError"));
      if (state != ncclSuccess && state != ncclInProgress) return NcclError(state, what);
      if (absl::Now() > deadline) return Expired(what);
      absl::SleepFor(absl::Microseconds(20));
    }
  }

  absl::Status Expired(const char* what) {
    Nccl().abort(comm_);
    comm_ = nullptr;
    return absl::DeadlineExceededError(
        absl::StrCat(what, ": the peer did not take part before the deadline"));
  }

  int rank_ = 0;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

bool NcclBuiltIn() { return Nccl().loaded; }

absl::StatusOr<std::string> NewLinkId() {
  KVT_RETURN_IF_ERROR(DeviceStatus());
  if (!Nccl().loaded) return absl::FailedPreconditionError(Nccl().error);
  ncclUniqueId id;
  KVT_RETURN_IF_ERROR(NcclError(Nccl().get_unique_id(&id), "ncclGetUniqueId"));
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<DeviceLink>> JoinLink(std::string_view id, int rank,
                                                     absl::Time deadline) {
  KVT_RETURN_IF_ERROR(DeviceStatus());
  if (!Nccl().loaded) return absl::FailedPreconditionError(Nccl().error);
  ncclUniqueId uid;
  if (id.size() != sizeof(uid.internal) || (rank != 0 && rank != 1)) {
    return absl::InvalidArgumentError(absl::StrCat("an NCCL id of ", id.size(), " bytes (",
                                                   sizeof(uid.internal), ") for rank ", rank));
  }
  std::memcpy(uid.internal, id.data(), id.size());
  auto link = std::make_unique<NcclLink>();
  KVT_RETURN_IF_ERROR(link->Join(uid, rank, deadline));
  return std::unique_ptr<DeviceLink>(std::move(link));
}

#else  // !KVTIER_HAVE_NCCL

bool NcclBuiltIn() { return false; }

absl::StatusOr<std::string> NewLinkId() {
  return absl::FailedPreconditionError("this kvtier was built without NCCL");
}

absl::StatusOr<std::unique_ptr<DeviceLink>> JoinLink(std::string_view, int, absl::Time) {
  return absl::FailedPreconditionError("this kvtier was built without NCCL");
}

#endif  // KVTIER_HAVE_NCCL

// ---- Speculation (DeviceSpeculator) ----

namespace {

class CudaSpeculator : public DeviceSpeculator {
 public:
  CudaSpeculator(int layers, int q_heads, int kv_heads, int d, int r)
      : q_heads_(q_heads),
        kv_heads_(kv_heads),
        d_(d),
        r_(r),
        pk_(layers),
        pk_meta_(layers),
        pk_key_(layers),
        pk_lens_(layers),
        mk_(layers),
        mv_(layers),
        mirrored_(layers, 0) {}
  ~CudaSpeculator() override {
    if (attn_ != nullptr) cudaStreamSynchronize(attn_);
    if (spec_ != nullptr) cudaStreamSynchronize(spec_);
    for (cudaEvent_t e : uploaded_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (attn_ != nullptr) cudaStreamDestroy(attn_);
    if (spec_ != nullptr) cudaStreamDestroy(spec_);
  }

  absl::Status Init() {
    KVT_CUDA(cudaStreamCreateWithFlags(&attn_, cudaStreamNonBlocking), "cudaStreamCreate");
    KVT_CUDA(cudaStreamCreateWithFlags(&spec_, cudaStreamNonBlocking), "cudaStreamCreate");
    for (cudaEvent_t& e : uploaded_) {
      KVT_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    }
    KVT_RETURN_IF_ERROR(sel_host_.Reserve((q_heads_ + 1) * sizeof(int)));
    return absl::OkStatus();
  }

  absl::Status SetPartialKeys(int layer, const std::string& key,
                              const std::vector<std::vector<std::string_view>>& parts) override {
    if (parts.size() != static_cast<size_t>(kv_heads_)) {
      return absl::InternalError("partial keys need one list per KV head");
    }
    if (pk_key_[layer] == key && !key.empty()) return absl::OkStatus();
    const size_t row = static_cast<size_t>(r_) * sizeof(uint16_t);
    std::vector<int64_t> meta(2 * kv_heads_, 0);  // Offsets, then lengths, in rows.
    size_t bytes = 0;
    for (int h = 0; h < kv_heads_; ++h) {
      meta[h] = static_cast<int64_t>(bytes / row);
      for (std::string_view p : parts[h]) bytes += p.size();
      meta[kv_heads_ + h] = static_cast<int64_t>(bytes / row) - meta[h];
    }
    std::string host;
    host.reserve(bytes);
    for (const auto& head : parts) {
      for (std::string_view p : head) host.append(p);
    }
    // Nothing in flight may read the layer's keys while they are replaced.
    KVT_CUDA(cudaStreamSynchronize(spec_), "speculation stream");
    pk_key_[layer].clear();
    KVT_RETURN_IF_ERROR(pk_[layer].Reserve(std::max<size_t>(bytes, 1)));
    KVT_RETURN_IF_ERROR(pk_meta_[layer].Reserve(meta.size() * sizeof(int64_t)));
    KVT_CUDA(cudaMemcpy(pk_[layer].as<void>(), host.data(), bytes, cudaMemcpyHostToDevice),
             "upload partial keys");
    KVT_CUDA(cudaMemcpy(pk_meta_[layer].as<void>(), meta.data(), meta.size() * sizeof(int64_t),
                        cudaMemcpyHostToDevice),
             "upload partial key offsets");
    pk_lens_[layer].assign(meta.begin() + kv_heads_, meta.end());
    pk_key_[layer] = key;
    return absl::OkStatus();
  }

  absl::Status LaunchSelect(int layer, const float* qp, float alpha, int budget) override {
    if (pk_key_[layer].empty()) return absl::InternalError("the layer's partial keys are not set");
    const int64_t most = *std::max_element(pk_lens_[layer].begin(), pk_lens_[layer].end());
    const size_t qbytes = static_cast<size_t>(q_heads_) * r_ * sizeof(float);
    const size_t cells = static_cast<size_t>(q_heads_) * std::max<int64_t>(most, 1);
    KVT_RETURN_IF_ERROR(qp_.Reserve(qbytes));
    KVT_RETURN_IF_ERROR(scores_.Reserve(cells * sizeof(float)));
    KVT_RETURN_IF_ERROR(idx_.Reserve(cells * sizeof(int32_t)));
    KVT_RETURN_IF_ERROR(counts_.Reserve((q_heads_ + 1) * sizeof(int)));
    KVT_CUDA(cudaMemcpyAsync(qp_.as<float>(), qp, qbytes, cudaMemcpyHostToDevice, spec_),
             "upload partial query");
    cuda::SpecDims sd;
    sd.q_heads = q_heads_;
    sd.kv_heads = kv_heads_;
    sd.r = r_;
    sd.max_tokens = most;
    sd.scale = 1.0f / std::sqrt(static_cast<float>(d_));
    sd.alpha = alpha;
    sd.budget = budget;
    const int64_t* meta = pk_meta_[layer].as<int64_t>();
    int* counts = counts_.as<int>();
    KVT_CUDA(static_cast<cudaError_t>(cuda::SpeculateSelect(
                 sd, qp_.as<float>(), pk_[layer].as<uint16_t>(), meta, meta + kv_heads_,
                 scores_.as<float>(), counts, counts + q_heads_, idx_.as<int32_t>(), spec_)),
             "SpeculateSelect");
    KVT_CUDA(cudaMemcpyAsync(sel_host_.as<int>(), counts, (q_heads_ + 1) * sizeof(int),
                             cudaMemcpyDeviceToHost, spec_),
             "download counts");
    select_layer_ = layer;
    select_most_ = most;
    return absl::OkStatus();
  }

  absl::StatusOr<spec::Speculated> FinishSelect() override {
    if (select_layer_ < 0) return absl::InternalError("no selection in flight");
    const int layer = select_layer_;
    select_layer_ = -1;
    KVT_CUDA(cudaStreamSynchronize(spec_), "speculation");
    spec::Speculated out;
    const int* c = sel_host_.as<int>();
    out.counts.assign(c, c + q_heads_);
    out.n = c[q_heads_];
    const size_t width = static_cast<size_t>(std::min<int64_t>(out.n, select_most_));
    KVT_RETURN_IF_ERROR(idx_host_.Reserve(std::max<size_t>(1, q_heads_ * width) * sizeof(int32_t)));
    if (width > 0) {
      KVT_CUDA(cudaMemcpy2DAsync(idx_host_.as<int32_t>(), width * sizeof(int32_t),
                                 idx_.as<int32_t>(), select_most_ * sizeof(int32_t),
                                 width * sizeof(int32_t), q_heads_, cudaMemcpyDeviceToHost, spec_),
               "download picks");
      KVT_CUDA(cudaStreamSynchronize(spec_), "speculation");
    }
    const int group = q_heads_ / kv_heads_;
    out.tokens.resize(q_heads_);
    for (int j = 0; j < q_heads_; ++j) {
      const int64_t take = std::min<int64_t>(out.n, pk_lens_[layer][j / group]);
      const int32_t* row = idx_host_.as<int32_t>() + j * width;
      out.tokens[j].assign(row, row + take);
    }
    return out;
  }

  absl::Status UploadGathered(int layer, const std::vector<std::vector<float>>& k,
                              const std::vector<std::vector<float>>& v) override {
    const int slot = layer % 2;
    size_t rows = 0;
    gathered_lens_[slot].assign(kv_heads_, 0);
    for (int h = 0; h < kv_heads_; ++h) {
      gathered_lens_[slot][h] = static_cast<int64_t>(k[h].size()) / d_;
      rows += k[h].size() / d_;
    }
    const size_t bytes = rows * d_ * sizeof(float);
    // The selection before this synchronized the stream: no copy from the
    // staging buffer is in flight.
    KVT_RETURN_IF_ERROR(stage_.Reserve(std::max<size_t>(2 * bytes, 1)));
    KVT_RETURN_IF_ERROR(gk_[slot].Reserve(std::max<size_t>(bytes, 1)));
    KVT_RETURN_IF_ERROR(gv_[slot].Reserve(std::max<size_t>(bytes, 1)));
    float* kst = stage_.as<float>();
    float* vst = kst + rows * d_;
    for (int h = 0; h < kv_heads_; ++h) {
      std::memcpy(kst, k[h].data(), k[h].size() * sizeof(float));
      std::memcpy(vst, v[h].data(), v[h].size() * sizeof(float));
      kst += k[h].size();
      vst += v[h].size();
    }
    if (bytes > 0) {
      KVT_CUDA(cudaMemcpyAsync(gk_[slot].as<void>(), stage_.as<float>(), bytes,
                               cudaMemcpyHostToDevice, spec_),
               "upload gathered K");
      KVT_CUDA(cudaMemcpyAsync(gv_[slot].as<void>(), stage_.as<float>() + rows * d_, bytes,
                               cudaMemcpyHostToDevice, spec_),
               "upload gathered V");
    }
    KVT_CUDA(cudaEventRecord(uploaded_[slot], spec_), "cudaEventRecord");
    gathered_layer_[slot] = layer;
    return absl::OkStatus();
  }

  absl::Status LaunchAttend(int layer, const float* q, const float* k, const float* v, int64_t from,
                            int64_t rows) override {
    const int slot = layer % 2;
    if (gathered_layer_[slot] != layer) {
      return absl::InternalError(absl::StrCat("layer ", layer, " has no gathered tokens"));
    }
    if (from > mirrored_[layer] || from > rows) {
      return absl::InternalError("the open round's mirror would have a gap");
    }
    const size_t row = static_cast<size_t>(kv_heads_) * d_ * sizeof(float);
    KVT_RETURN_IF_ERROR(mk_[layer].Reserve(rows * row, from * row));
    KVT_RETURN_IF_ERROR(mv_[layer].Reserve(rows * row, from * row));
    if (rows > from) {
      KVT_CUDA(cudaMemcpyAsync(mk_[layer].as<uint8_t>() + from * row, k, (rows - from) * row,
                               cudaMemcpyHostToDevice, attn_),
               "upload open K");
      KVT_CUDA(cudaMemcpyAsync(mv_[layer].as<uint8_t>() + from * row, v, (rows - from) * row,
                               cudaMemcpyHostToDevice, attn_),
               "upload open V");
    }
    mirrored_[layer] = rows;
    std::vector<cuda::SegBlock> blocks;
    std::vector<int> first(kv_heads_ + 1, 0);
    int64_t max_tokens = 0, at = 0;
    for (int h = 0; h < kv_heads_; ++h) {
      first[h] = static_cast<int>(blocks.size());
      const int64_t u = gathered_lens_[slot][h];
      if (u > 0) {
        cuda::SegBlock b;
        b.tokens = u;
        b.k.dtype = b.v.dtype = 0;
        b.k.token_stride = b.v.token_stride = d_;
        b.k.raw = gk_[slot].as<float>() + at * d_;
        b.v.raw = gv_[slot].as<float>() + at * d_;
        blocks.push_back(b);
      }
      at += u;
      const cuda::SegBlock open =
          OpenMirrorBlock(mk_[layer].as<float>(), mv_[layer].as<float>(), rows, kv_heads_, d_, h);
      blocks.push_back(open);
      max_tokens = std::max(max_tokens, u + rows);
    }
    first[kv_heads_] = static_cast<int>(blocks.size());
    cuda::SegDims g;
    g.n = 1;
    g.q_heads = q_heads_;
    g.kv_heads = kv_heads_;
    g.d = d_;
    g.base = rows - 1;
    g.max_tokens = max_tokens;
    // The gathered K/V come from the other stream.
    if (absl::Status st = call_.Launch(blocks, first, q, g, attn_, uploaded_[slot]); !st.ok()) {
      // The open rows' copies above may be in flight: none may be when a
      // buffer grows or goes back to the block cache.
      cudaStreamSynchronize(attn_);
      return st;
    }
    attending_ = true;
    return absl::OkStatus();
  }

  absl::Status FinishAttend(float* out) override {
    if (!attending_) return absl::InternalError("no attention in flight");
    attending_ = false;
    return call_.Finish(out, attn_);
  }

  int64_t MirroredRows(int layer) const override { return mirrored_[layer]; }
  void ResetMirror() override { std::fill(mirrored_.begin(), mirrored_.end(), 0); }

  int64_t bytes() const override {
    size_t b = qp_.size() + scores_.size() + idx_.size() + counts_.size() + call_.bytes();
    for (const auto* list : {&pk_, &pk_meta_, &mk_, &mv_}) {
      for (const DeviceBuffer& x : *list) b += x.size();
    }
    for (int i = 0; i < 2; ++i) b += gk_[i].size() + gv_[i].size();
    return static_cast<int64_t>(b);
  }

 private:
  const int q_heads_, kv_heads_, d_, r_;
  cudaStream_t attn_ = nullptr, spec_ = nullptr;
  // Per layer: partial keys, their offsets and lengths (rows) on the
  // device, the rounds they were made of, and the lengths on the host.
  std::vector<DeviceBuffer> pk_, pk_meta_;
  std::vector<std::string> pk_key_;
  std::vector<std::vector<int64_t>> pk_lens_;
  // The selection in flight.
  DeviceBuffer qp_, scores_, idx_, counts_;
  DeviceBuffer sel_host_{/*pinned=*/true}, idx_host_{/*pinned=*/true};
  int select_layer_ = -1;
  int64_t select_most_ = 0;
  // Gathered K/V, two slots (layer % 2): layer l + 1's upload runs while
  // layer l's attention reads the other slot.
  DeviceBuffer gk_[2], gv_[2];
  std::vector<int64_t> gathered_lens_[2];
  int gathered_layer_[2] = {-1, -1};
  cudaEvent_t uploaded_[2] = {nullptr, nullptr};
  DeviceBuffer stage_{/*pinned=*/true};
  // The open round's mirror per layer, fp32 token-major.
  std::vector<DeviceBuffer> mk_, mv_;
  std::vector<int64_t> mirrored_;
  SegmentedCall call_;
  bool attending_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceSpeculator>> NewDeviceSpeculator(int layers, int q_heads,
                                                                      int kv_heads, int head_dim,
                                                                      int partial_columns) {
  if (!cuda::DeviceAvailable()) {
    return absl::FailedPreconditionError("no CUDA device for speculation");
  }
  if (partial_columns < 1 || partial_columns > head_dim || head_dim > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "speculation on the device with ", partial_columns, " partial columns of ", head_dim));
  }
  auto s = std::make_unique<CudaSpeculator>(layers, q_heads, kv_heads, head_dim, partial_columns);
  KVT_RETURN_IF_ERROR(s->Init());
  return std::unique_ptr<DeviceSpeculator>(std::move(s));
}

absl::StatusOr<std::unique_ptr<DeviceSession>> NewDeviceSession(int layers, int q_heads,
                                                                int kv_heads, int head_dim) {
  if (!cuda::DeviceAvailable()) {
    return absl::FailedPreconditionError("no CUDA device for the device working set");
  }
  auto s = std::make_unique<CudaSession>(layers, q_heads, kv_heads, head_dim);
  KVT_RETURN_IF_ERROR(s->Init());
  return std::unique_ptr<DeviceSession>(std::move(s));
}

}  // namespace kvtier::worker
