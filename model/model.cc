#include "model/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/architecture.h"
#include "model/gguf.h"
#include "model/matmul.h"

namespace kvtier::model {
namespace {

absl::Status CheckFinite(const std::string& file, const std::string& what,
                         const std::vector<float>& w) {
  for (float x : w) {
    if (!std::isfinite(x)) {
      return absl::InvalidArgumentError(absl::StrCat(file, ": ", what, " has a non-finite weight"));
    }
  }
  return absl::OkStatus();
}

// Tensor `name` of shape [cols, rows]: its codes when block-quantized,
// float32 otherwise.
absl::StatusOr<Matrix> ReadMatrix(const GgufFile& f, const std::string& name, int rows, int cols) {
  KVT_ASSIGN_OR_RETURN(const GgufTensor* t, f.Tensor(name, {cols, rows}));
  Matrix m;
  m.rows = rows;
  m.cols = cols;
  if (QMatrixHolds(t->type)) {
    m.codes = ToQMatrix(t->type, t->data, rows, cols);
    KVT_RETURN_IF_ERROR(CheckFinite(f.name(), name + "'s scales", m.codes.scale));
    KVT_RETURN_IF_ERROR(CheckFinite(f.name(), name + "'s biases", m.codes.bias));
    return m;
  }
  m.w.resize(static_cast<size_t>(rows) * cols);
  for (int r = 0; r < rows; ++r) {
    DequantizeRow(t->type, t->row(r), m.w.data() + static_cast<int64_t>(r) * cols, cols);
  }
  KVT_RETURN_IF_ERROR(CheckFinite(f.name(), name, m.w));
  return m;
}

absl::StatusOr<std::vector<float>> ReadVector(const GgufFile& f, const std::string& name, int n) {
  KVT_ASSIGN_OR_RETURN(const GgufTensor* t, f.Tensor(name, {n}));
  std::vector<float> v(n);
  DequantizeRow(t->type, t->data, v.data(), n);
  KVT_RETURN_IF_ERROR(CheckFinite(f.name(), name, v));
  return v;
}

constexpr uint32_t kGgufMagic = 0x46554747;

}  // namespace

void Matrix::Row(int r, float* out) const {
  if (coded()) return codes.Row(r, out);
  std::copy_n(w.data() + static_cast<size_t>(r) * cols, cols, out);
}

void Matrix::Mul(const float* x, int n, float* out, ThreadPool* pool, KernelLevel level) const {
  if (coded()) return QMatMul(x, n, codes, out, level, pool);
  MatMul(x, n, w.data(), rows, cols, out, level, pool);
}

absl::StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open model file ", path));
  uint32_t magic = 0;
  in.read(reinterpret_cast<char*>(&magic), 4);
  if (in && magic == kGgufMagic) return LoadGguf(path);
  return LoadLlama2c(path);
}

absl::StatusOr<std::unique_ptr<Model>> LoadGguf(const std::string& path) {
  KVT_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> f, GgufFile::Open(path));
  KVT_ASSIGN_OR_RETURN(ModelConfig c, ConfigFromGguf(*f));
  auto m = std::unique_ptr<Model>(new Model());
  m->path_ = path;
  m->config_ = c;
  if (f->Has("tokenizer.ggml.tokens")) {
    KVT_ASSIGN_OR_RETURN(m->tokenizer_, Tokenizer::FromGguf(*f));
    if (m->tokenizer_->size() != c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": the vocabulary has ",
                                                     m->tokenizer_->size(),
                                                     " pieces; the embedding has ", c.vocab_size));
    }
  }
  const int d = c.dim, q = c.q_dim(), kv = c.kv_dim(), h = c.hidden_dim;
  KVT_ASSIGN_OR_RETURN(m->embed_, ReadMatrix(*f, "token_embd.weight", c.vocab_size, d));
  if (!c.shared_classifier) {
    KVT_ASSIGN_OR_RETURN(m->output_, ReadMatrix(*f, "output.weight", c.vocab_size, d));
  }
  KVT_ASSIGN_OR_RETURN(m->final_norm_, ReadVector(*f, "output_norm.weight", d));
  const bool gemma = c.arch == Arch::kGemma3;
  m->layers_.resize(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    LayerWeights& w = m->layers_[l];
    const std::string b = absl::StrCat("blk.", l, ".");
    KVT_ASSIGN_OR_RETURN(w.attn_norm, ReadVector(*f, b + "attn_norm.weight", d));
    KVT_ASSIGN_OR_RETURN(w.ffn_norm, ReadVector(*f, b + "ffn_norm.weight", d));
    KVT_ASSIGN_OR_RETURN(w.wq, ReadMatrix(*f, b + "attn_q.weight", q, d));
    KVT_ASSIGN_OR_RETURN(w.wk, ReadMatrix(*f, b + "attn_k.weight", kv, d));
    KVT_ASSIGN_OR_RETURN(w.wv, ReadMatrix(*f, b + "attn_v.weight", kv, d));
    KVT_ASSIGN_OR_RETURN(w.wo, ReadMatrix(*f, b + "attn_output.weight", d, q));
    KVT_ASSIGN_OR_RETURN(w.gate, ReadMatrix(*f, b + "ffn_gate.weight", h, d));
    KVT_ASSIGN_OR_RETURN(w.up, ReadMatrix(*f, b + "ffn_up.weight", h, d));
    KVT_ASSIGN_OR_RETURN(w.down, ReadMatrix(*f, b + "ffn_down.weight", d, h));
    if (gemma) {
      KVT_ASSIGN_OR_RETURN(w.q_norm, ReadVector(*f, b + "attn_q_norm.weight", c.head_dim()));
      KVT_ASSIGN_OR_RETURN(w.k_norm, ReadVector(*f, b + "attn_k_norm.weight", c.head_dim()));
      KVT_ASSIGN_OR_RETURN(w.post_attn_norm, ReadVector(*f, b + "post_attention_norm.weight", d));
      KVT_ASSIGN_OR_RETURN(w.post_ffn_norm, ReadVector(*f, b + "post_ffw_norm.weight", d));
    }
  }
  return m;
}

absl::StatusOr<std::unique_ptr<Model>> LoadLlama2c(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open model checkpoint ", path));
  const int64_t size = in.tellg();
  in.seekg(0);
  int32_t h[7];
  if (size < 28 || !in.read(reinterpret_cast<char*>(h), sizeof(h))) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": too short for a llama2.c header"));
  }
  auto m = std::unique_ptr<Model>(new Model());
  ModelConfig& c = m->config_;
  c.arch = Arch::kLlama;
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  c.shared_classifier = h[5] > 0;
  c.vocab_size = std::abs(h[5]);
  c.seq_len = h[6];
  auto in_range = [](int v, int hi) { return v >= 1 && v <= hi; };
  if (!in_range(c.dim, 1 << 16) || !in_range(c.hidden_dim, 1 << 18) ||
      !in_range(c.n_layers, 1024) || !in_range(c.n_heads, 1024) || !in_range(c.n_kv_heads, 1024) ||
      !in_range(c.vocab_size, 1 << 20) || !in_range(c.seq_len, 1 << 20) || c.dim % c.n_heads != 0 ||
      c.n_heads % c.n_kv_heads != 0 || c.head_dim() % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header out of range (dim ", c.dim, ", hidden ", c.hidden_dim,
                     ", layers ", c.n_layers, ", heads ", c.n_heads, ", kv heads ", c.n_kv_heads,
                     ", vocab ", c.vocab_size, ", seq_len ", c.seq_len, ")"));
  }
  const int64_t d = c.dim, hd = c.hidden_dim, l = c.n_layers, kv = c.kv_dim();
  int64_t floats = c.vocab_size * d + l * d + l * d * d + 2 * l * kv * d + l * d * d + l * d +
                   3 * l * hd * d + d + static_cast<int64_t>(c.seq_len) * c.head_dim();
  if (!c.shared_classifier) floats += c.vocab_size * d;
  if (size != 28 + floats * 4) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": file has ", size, " bytes; its header needs ", 28 + floats * 4));
  }
  std::vector<float> all(static_cast<size_t>(floats));
  if (!in.read(reinterpret_cast<char*>(all.data()), floats * 4)) {
    return absl::DataLossError(absl::StrCat(path, ": short read"));
  }
  KVT_RETURN_IF_ERROR(CheckFinite(path, "the checkpoint", all));
  // FNV-1a over the weights' bytes: the checkpoint's identity.
  uint64_t digest = 0xcbf29ce484222325ull;
  for (float x : all) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    digest = (digest ^ u) * 0x100000001b3ull;
  }
  c.digest = digest;
  const float* p = all.data();
  auto take = [&](int64_t n) {
    std::vector<float> v(p, p + n);
    p += n;
    return v;
  };
  auto matrix = [&](int rows, int cols) {
    Matrix mx;
    mx.rows = rows;
    mx.cols = cols;
    mx.w = take(static_cast<int64_t>(rows) * cols);
    return mx;
  };
  // The checkpoint stores each kind of weight for every layer in turn.
  m->embed_ = matrix(c.vocab_size, c.dim);
  m->layers_.resize(c.n_layers);
  for (auto& w : m->layers_) w.attn_norm = take(d);
  for (auto& w : m->layers_) w.wq = matrix(c.dim, c.dim);
  for (auto& w : m->layers_) w.wk = matrix(kv, c.dim);
  for (auto& w : m->layers_) w.wv = matrix(kv, c.dim);
  for (auto& w : m->layers_) w.wo = matrix(c.dim, c.dim);
  for (auto& w : m->layers_) w.ffn_norm = take(d);
  for (auto& w : m->layers_) w.gate = matrix(c.hidden_dim, c.dim);
  for (auto& w : m->layers_) w.down = matrix(c.dim, c.hidden_dim);
  for (auto& w : m->layers_) w.up = matrix(c.hidden_dim, c.dim);
  m->final_norm_ = take(d);
  p += static_cast<int64_t>(c.seq_len) * c.head_dim();  // freq_cis, unused.
  if (!c.shared_classifier) m->output_ = matrix(c.vocab_size, c.dim);
  m->path_ = path;
  return m;
}

}  // namespace kvtier::model
