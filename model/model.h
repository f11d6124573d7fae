// A model's weights in float32, loaded from a GGUF file (llama or gemma3,
// model/architecture.h) or a llama2.c checkpoint, with its tokenizer when
// the file carries one. Immutable once loaded: any number of threads may
// run Forward passes over one Model.
#ifndef KVTIER_MODEL_MODEL_H_
#define KVTIER_MODEL_MODEL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/codec.h"
#include "model/config.h"
#include "model/qmatrix.h"
#include "model/thread_pool.h"
#include "model/tokenizer.h"

namespace kvtier::model {

// Row-major [rows][cols]: row r holds the weights of output r. Held as
// float32 (`w`), or, for a block-quantized GGUF tensor, as its exact 8-bit
// codes (`codes`, model/qmatrix.h; `w` is then empty).
struct Matrix {
  int rows = 0;
  int cols = 0;
  std::vector<float> w;
  QMatrix codes;

  bool coded() const { return !codes.q.empty(); }
  // Row r in float32.
  void Row(int r, float* out) const;
  // out[t][r] = row r . x[t] for n tokens (model/matmul.h's contract), the
  // rows split over `pool` when given.
  void Mul(const float* x, int n, float* out, ThreadPool* pool = nullptr,
           KernelLevel level = KernelLevel::kBest) const;
};

struct LayerWeights {
  std::vector<float> attn_norm, ffn_norm;            // [dim]
  std::vector<float> q_norm, k_norm;                 // gemma3: [head_dim]
  std::vector<float> post_attn_norm, post_ffn_norm;  // gemma3: [dim]
  Matrix wq, wk, wv, wo;                             // [q_dim][dim], [kv_dim][dim] x2, [dim][q_dim]
  Matrix gate, up, down;                             // [hidden][dim] x2, [dim][hidden]
};

class Model {
 public:
  // A GGUF file (by its magic) or a llama2.c checkpoint. NOT_FOUND when the
  // file cannot be opened; INVALID_ARGUMENT, naming the file and the
  // problem, for anything malformed, an unsupported architecture or
  // tensor type, or a tensor of the wrong shape.
  static absl::StatusOr<std::unique_ptr<Model>> Load(const std::string& path);

  const ModelConfig& config() const { return config_; }
  const std::string& path() const { return path_; }
  // Null for a llama2.c checkpoint (it has no vocabulary).
  const Tokenizer* tokenizer() const { return tokenizer_.get(); }

  const Matrix& embedding() const { return embed_; }
  const Matrix& output() const { return config_.shared_classifier ? embed_ : output_; }
  const std::vector<float>& final_norm() const { return final_norm_; }
  const LayerWeights& layer(int l) const { return layers_[l]; }

 private:
  friend absl::StatusOr<std::unique_ptr<Model>> LoadLlama2c(const std::string& path);
  friend absl::StatusOr<std::unique_ptr<Model>> LoadGguf(const std::string& path);
  Model() = default;

  ModelConfig config_;
  std::string path_;
  std::unique_ptr<Tokenizer> tokenizer_;
  Matrix embed_, output_;
  std::vector<float> final_norm_;
  std::vector<LayerWeights> layers_;
};

// The loaders behind Model::Load.
absl::StatusOr<std::unique_ptr<Model>> LoadLlama2c(const std::string& path);
absl::StatusOr<std::unique_ptr<Model>> LoadGguf(const std::string& path);

}  // namespace kvtier::model

#endif  // KVTIER_MODEL_MODEL_H_
