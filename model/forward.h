// The forward pass of the models in model/model.h, float32, token by token
// or layer by layer, with pluggable attention: the full cache (ground
// truth), an encoded KvStream, or a remote worker. Used by the fidelity
// harness, the evaluations and the reference engine. Per architecture
// (model/architecture.h):
//   llama   x = embed; per layer x += Wo attn(rope(Wq n(x)), rope(Wk n(x)),
//           Wv n(x)); x += down(silu(gate n(x)) * up n(x)); logits = out n(x)
//   gemma3  x = embed * sqrt(dim); per layer, q and k RMS-normed per head
//           before RoPE, the attention and FFN outputs RMS-normed again
//           (post-norms) before they join x; GeGLU (tanh GELU) in the FFN.
#ifndef KVTIER_MODEL_FORWARD_H_
#define KVTIER_MODEL_FORWARD_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/codec.h"
#include "model/model.h"

namespace kvtier::model {

// Attention for one layer at one position. Implementations keep whatever
// cache they like; they receive the new token's post-RoPE k and v
// ([n_kv_heads * head_dim]) and must attend q ([n_heads * head_dim]) over
// positions [0, pos] (a sliding layer: the last ModelConfig::layer_window
// of them), writing out ([n_heads * head_dim]).
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  virtual absl::Status Attend(int layer, int pos, const float* q, const float* k, const float* v,
                              float* out) = 0;
};

// The full-precision fp32 cache: the ground truth every compressed run is
// compared with. Sliding layers attend over their window only (their cache
// still keeps every position).
class FullCacheAttention : public AttentionBackend {
 public:
  explicit FullCacheAttention(const ModelConfig& c, KernelLevel level = KernelLevel::kBest);
  absl::Status Attend(int layer, int pos, const float* q, const float* k, const float* v,
                      float* out) override;
  // Layer l's cache, token-major [tokens, n_kv_heads, head_dim].
  const std::vector<float>& keys(int layer) const { return k_[layer]; }
  const std::vector<float>& values(int layer) const { return v_[layer]; }

 private:
  ModelConfig c_;
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
  explicit PerTokenLayerAttention(const ModelConfig& c, AttentionBackend* b) : c_(c), b_(b) {}
  absl::Status AttendLayer(int layer, int pos0, int n, const float* q, const float* k,
                           const float* v, float* out) override;

 private:
  ModelConfig c_;
  AttentionBackend* b_;
};

// One sequence's activations; Step() runs one token through every layer.
class Forward {
 public:
  // With a pool, the matrix products split their rows over its threads
  // (the logits do not change); the pool must outlive the Forward.
  explicit Forward(const Model& m, ThreadPool* pool = nullptr);
  // Runs `token` at position `pos` (0-based, < seq_len) and writes the
  // logits ([vocab_size]) when `logits` is not null. Positions must be fed in
  // order; the backend holds the cache.
  absl::Status Step(int token, int pos, AttentionBackend* attn, float* logits);
  // Runs tokens at positions pos0.. layer by layer (every token through
  // layer l before layer l + 1), so attention sees a whole layer at once.
  // Per token the arithmetic is exactly Step()'s. Writes the last token's
  // logits ([vocab_size]) when `logits` is not null.
  absl::Status Run(const std::vector<int>& tokens, int pos0, LayerAttention* attn, float* logits);
  // Run, writing every token's logits ([tokens.size(), vocab_size]): the
  // teacher-forced pass the cross-checks and evaluations score.
  absl::Status RunAllLogits(const std::vector<int>& tokens, int pos0, LayerAttention* attn,
                            float* logits);

 private:
  absl::Status RunTokens(const std::vector<int>& tokens, int pos0, LayerAttention* attn,
                         float* logits, bool all);
  // Layer l for the n tokens whose residual streams are x ([n, dim]).
  absl::Status Layer(int l, int pos0, int n, float* x, LayerAttention* attn);

  const Model& m_;
  ThreadPool* pool_;
};

// Softmax of logits, in float64.
std::vector<double> Softmax(const float* logits, int n);

// Token ids sampled from the model itself from BOS (the tokenizer's, else
// id 1), at temperature 1, seeded: realistic sequences for a model shipped
// without a tokenizer.
absl::StatusOr<std::vector<int>> SampleTokens(const Model& m, int n, uint64_t seed);

// KL(p || q) in nats and whether the argmaxes agree.
double KlDivergence(const std::vector<double>& p, const std::vector<double>& q);
int Argmax(const float* logits, int n);

}  // namespace kvtier::model

#endif  // KVTIER_MODEL_FORWARD_H_
