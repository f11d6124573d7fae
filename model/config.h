// A decoder-only transformer's shape and the choices that differ between
// the architectures kvtier runs (model/architecture.h): what the forward pass,
// the attention backends and the tier need to know about a model.
#ifndef KVTIER_MODEL_CONFIG_H_
#define KVTIER_MODEL_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

namespace kvtier::model {

enum class Arch {
  kLlama,   // llama2.c checkpoints and llama GGUF files: SiLU-gated FFN, RoPE on
            // adjacent pairs, separate or tied output.
  kGemma3,  // Gemma 3: GeGLU, QK-norm, post-norms, sqrt(dim) embedding
            // scale, RoPE on half-split pairs, sliding-window layers.
};

struct ModelConfig {
  Arch arch = Arch::kLlama;
  int dim = 0;         // Residual stream width.
  int hidden_dim = 0;  // FFN width.
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int key_length = 0;  // Per-head width; 0: dim / n_heads (llama2.c).

  int vocab_size = 0;
  int seq_len = 0;                // Context length.
  bool shared_classifier = true;  // Output head tied to the embedding.
  float rope_theta = 10000.0f;    // RoPE base of the global layers.
  float rms_eps = 1e-5f;
  // Per layer: the sliding window in tokens (a query attends to itself and
  // the window - 1 positions before it), or 0 for a global layer; and its
  // RoPE base. Empty: every layer global with base rope_theta.
  std::vector<int> window;
  std::vector<float> layer_rope_theta;
  // A digest of the weights (GgufFile::tensor_digest, or of the llama2.c
  // file's bytes): the model's identity.
  uint64_t digest = 0;

  int head_dim() const { return key_length > 0 ? key_length : dim / n_heads; }
  int q_dim() const { return n_heads * head_dim(); }
  int kv_dim() const { return head_dim() * n_kv_heads; }
  int layer_window(int l) const { return window.empty() ? 0 : window[l]; }
  float layer_rope(int l) const {
    return layer_rope_theta.empty() ? rope_theta : layer_rope_theta[l];
  }
  bool sliding() const {
    for (int w : window) {
      if (w > 0) return true;
    }
    return false;
  }
};

const char* ArchName(Arch a);

}  // namespace kvtier::model

#endif  // KVTIER_MODEL_CONFIG_H_
