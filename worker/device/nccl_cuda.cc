// NCCL between GPUs for hand-offs (docs/transfer.md, "The NCCL path"; CUDA
// builds): loaded at first use, so a node without it keeps to CUDA IPC and
// gRPC.
#ifdef KVTIER_HAVE_NCCL
#include <dlfcn.h>
#include <nccl.h>

#include <type_traits>
#endif

#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "worker/device/cuda.h"

namespace kvtier::worker {

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

}  // namespace kvtier::worker
