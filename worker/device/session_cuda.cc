// A session's GPU working set (CUDA builds): attention over its past rounds
// and the open round's mirror, one SegmentedAttention call per layer; the
// device's status and the upload of a past round's layer.
#include <memory>
#include <vector>

#include "worker/device/cuda.h"
#include "worker/device/layout.h"

namespace kvtier::worker {

namespace {

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
    KVT_RETURN_IF_ERROR(CopyToDevice(k_[layer].as<uint8_t>(), k, bytes, "load open K"));
    KVT_RETURN_IF_ERROR(CopyToDevice(v_[layer].as<uint8_t>(), v, bytes, "load open V"));
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
  if (codec.codec == Codec::kRaw || codec.codec == Codec::kKivi || codec.codec == Codec::kKcvt) {
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
    KVT_RETURN_IF_ERROR(
        CopyToDevice(layer->buf.as<uint8_t>(), host.data(), host.size(), "upload layer"));
  }
  for (const auto& [pk, pv] : plans) {
    layer->heads.emplace_back(PlaceStaged(pk, layer->buf.as<uint8_t>()),
                              PlaceStaged(pv, layer->buf.as<uint8_t>()));
  }
  return std::unique_ptr<DeviceLayer>(std::move(layer));
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
