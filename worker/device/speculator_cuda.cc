// InfiniGen's speculation on the GPU (DeviceSpeculator; CUDA builds).
#include <cmath>
#include <deque>
#include <memory>
#include <vector>

#include "worker/device/cuda.h"

namespace kvtier::worker {

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
    KVT_RETURN_IF_ERROR(
        CopyToDevice(pk_[layer].as<void>(), host.data(), bytes, "upload partial keys"));
    KVT_RETURN_IF_ERROR(CopyToDevice(pk_meta_[layer].as<void>(), meta.data(),
                                     meta.size() * sizeof(int64_t), "upload partial key offsets"));
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

}  // namespace kvtier::worker
