// A reader for llama2.c checkpoints and a float32 forward pass, token by
// token, whose attention is pluggable: the full cache (ground truth), an
// encoded KvStream, or a remote worker. Used by the fidelity harness, the
// eviction evaluation and the reference engine. Format and forward pass:
// ../shared/models/README.md (llama2.c "legacy" checkpoint).
#ifndef KVTIER_MODEL_LLAMA_H_
#define KVTIER_MODEL_LLAMA_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/codec.h"

namespace kvtier::model {

struct LlamaConfig {
  int dim = 0;
  int hidden_dim = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int vocab_size = 0;
  int seq_len = 0;
  bool shared_classifier = true;
  float rope_theta = 10000.0f;

  int head_dim() const { return dim / n_heads; }
  int kv_dim() const { return head_dim() * n_kv_heads; }
};

class LlamaModel {
 public:
  // Reads a checkpoint. INVALID_ARGUMENT for a header out of range or a file
  // whose size does not match the header; NOT_FOUND when it does not exist.
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Load(const std::string& path);

  const LlamaConfig& config() const { return config_; }
  const std::string& path() const { return path_; }

 private:
  friend class Forward;
  LlamaModel() = default;

  LlamaConfig config_;
  std::string path_;
  std::vector<float> weights_;
  // Offsets into weights_.
  const float *embed_ = nullptr, *rms_att_ = nullptr, *wq_ = nullptr, *wk_ = nullptr,
              *wv_ = nullptr, *wo_ = nullptr, *rms_ffn_ = nullptr, *w1_ = nullptr, *w2_ = nullptr,
              *w3_ = nullptr, *rms_final_ = nullptr, *wcls_ = nullptr;
};

// Attention for one layer at one position. Implementations keep whatever
// cache they like; they receive the new token's post-RoPE k and v
// ([n_kv_heads * head_dim]) and must attend q ([n_heads * head_dim]) over
// positions [0, pos], writing out ([n_heads * head_dim]).
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  virtual absl::Status Attend(int layer, int pos, const float* q, const float* k, const float* v,
                              float* out) = 0;
};

// The full-precision fp32 cache: the ground truth every compressed run is
// compared with.
class FullCacheAttention : public AttentionBackend {
 public:
  explicit FullCacheAttention(const LlamaConfig& c, KernelLevel level = KernelLevel::kBest);
  absl::Status Attend(int layer, int pos, const float* q, const float* k, const float* v,
                      float* out) override;
  // Layer l's cache, token-major [tokens, n_kv_heads, head_dim].
  const std::vector<float>& keys(int layer) const { return k_[layer]; }
  const std::vector<float>& values(int layer) const { return v_[layer]; }

 private:
  LlamaConfig c_;
  KernelLevel level_;
  std::vector<std::vector<float>> k_, v_;
};

// Attention for one layer over n consecutive new tokens (positions pos0 ..
// pos0 + n - 1), each attending causally over everything before it: q
// [n, n_heads * head_dim], k and v [n, n_kv_heads * head_dim] (post-RoPE),
// out [n, n_heads * head_dim]. Layers arrive in order 0..L-1 for each batch:
// the shape of a round's prefill through a remote attention worker.
class LayerAttention {
 public:
  virtual ~LayerAttention() = default;
  virtual absl::Status AttendLayer(int layer, int pos0, int n, const float* q, const float* k,
                                   const float* v, float* out) = 0;
  // Speculation (kernels/speculation.h): when true, Forward::Run calls
  // NextLayerQuery(layer, ...) before AttendLayer(layer, ...) for every
  // layer but the last, with the approximate query of layer + 1 for the
  // same tokens: layer's attention input (the residual stream) through
  // layer + 1's attention norm, W_q and RoPE, [n, n_heads * head_dim].
  virtual bool WantsNextLayerQuery() const { return false; }
  virtual absl::Status NextLayerQuery(int layer, int pos0, int n, const float* q_next) {
    (void)layer, (void)pos0, (void)n, (void)q_next;
    return absl::OkStatus();
  }
};

// A LayerAttention over any per-token AttentionBackend (token by token).
class PerTokenLayerAttention : public LayerAttention {
 public:
  explicit PerTokenLayerAttention(const LlamaConfig& c, AttentionBackend* b) : c_(c), b_(b) {}
  absl::Status AttendLayer(int layer, int pos0, int n, const float* q, const float* k,
                           const float* v, float* out) override;

 private:
  LlamaConfig c_;
  AttentionBackend* b_;
};

// One sequence's activations; Step() runs one token through every layer.
class Forward {
 public:
  explicit Forward(const LlamaModel& m);
  // Runs `token` at position `pos` (0-based, < seq_len) and writes the
  // logits ([vocab_size]) when `logits` is not null. Positions must be fed in
  // order; the backend holds the cache.
  absl::Status Step(int token, int pos, AttentionBackend* attn, float* logits);
  // Runs tokens at positions pos0.. layer by layer (every token through
  // layer l before layer l + 1), so attention sees a whole layer at once.
  // Per token the arithmetic is exactly Step()'s. Writes the last token's
  // logits ([vocab_size]) when `logits` is not null.
  absl::Status Run(const std::vector<int>& tokens, int pos0, LayerAttention* attn, float* logits);

 private:
  const LlamaModel& m_;
  std::vector<float> x_, xb_, q_, k_, v_, att_, hb_, hb2_;
};

// Softmax of logits, in float64.
std::vector<double> Softmax(const float* logits, int n);

// Token ids sampled from the model itself from BOS (id 1), at temperature
// 1, seeded: realistic sequences for a model shipped without a tokenizer.
absl::StatusOr<std::vector<int>> SampleTokens(const LlamaModel& m, int n, uint64_t seed);

// KL(p || q) in nats and whether the argmaxes agree.
double KlDivergence(const std::vector<double>& p, const std::vector<double>& q);
int Argmax(const float* logits, int n);

}  // namespace kvtier::model

#endif  // KVTIER_MODEL_LLAMA_H_
