// The CUDA IPC path of a hand-off (docs/transfer.md; CUDA builds): a
// worker's device identity and probe, received layers, and the packs and
// sources that lend device memory across processes.
#include <unistd.h>

#include <map>
#include <memory>
#include <random>

#include "absl/synchronization/mutex.h"
#include "worker/device/cuda.h"
#include "worker/device/layout.h"
#include "worker/device/transfer.h"

namespace kvtier::worker {

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
  KVT_RETURN_IF_ERROR(CopyToDevice(*buffer, id.probe_nonce.data(), kNonceBytes, "write probe"));
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
  ~CudaIpcSource() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);  // Every copy was waited for.
  }
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
    if (stream_ == nullptr) {
      KVT_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    }
    {
      // A device-to-device cudaMemcpy returns before the copy is done, and
      // the legacy stream it runs on does not order the session's
      // non-blocking streams: wait for the copy here, before the layer is
      // attended and before the sender may reuse its memory.
      CallTimer timer(kCopy);
      KVT_CUDA(cudaMemcpyAsync(layer->buf.as<void>(),
                               static_cast<const uint8_t*>(src.handle.get()) + offset,
                               layout.staged_bytes, cudaMemcpyDeviceToDevice, stream_),
               "copy device round");
      KVT_CUDA(cudaStreamSynchronize(stream_), "copy device round");
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
  cudaStream_t stream_ = nullptr;  // The copies' own, made at the first.
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

}  // namespace kvtier::worker
