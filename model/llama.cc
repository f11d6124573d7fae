#include "model/llama.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/attention.h"

namespace kvtier::model {
namespace {

void RmsNorm(float* out, const float* x, const float* w, int n) {
  double ss = 0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / n + 1e-5));
  for (int i = 0; i < n; ++i) out[i] = w[i] * (inv * x[i]);
}

// out[rows] = W[rows][cols] x[cols]
void MatVec(float* out, const float* x, const float* w, int rows, int cols) {
  for (int i = 0; i < rows; ++i) {
    const float* row = w + static_cast<int64_t>(i) * cols;
    float acc = 0;
    for (int j = 0; j < cols; ++j) acc += row[j] * x[j];
    out[i] = acc;
  }
}

// RoPE at position `pos`, in place, on q ([dim]) and, when not null, on k
// ([kv_dim]): each pair of a head's dimensions turned by pos * theta^(-i/hd).
void Rope(const LlamaConfig& c, int pos, float* q, float* k) {
  const int d = c.dim, hd = c.head_dim(), kv = c.kv_dim();
  for (int i = 0; i < d; i += 2) {
    const int hi = i % hd;
    const double freq =
        1.0 / std::pow(static_cast<double>(c.rope_theta), static_cast<double>(hi) / hd);
    const double angle = pos * freq;
    const float fc = static_cast<float>(std::cos(angle)), fs = static_cast<float>(std::sin(angle));
    for (int which = 0; which < (i < kv && k != nullptr ? 2 : 1); ++which) {
      float* vec = which == 0 ? q : k;
      const float a = vec[i], b = vec[i + 1];
      vec[i] = a * fc - b * fs;
      vec[i + 1] = a * fs + b * fc;
    }
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open model checkpoint ", path));
  const int64_t size = in.tellg();
  in.seekg(0);
  int32_t h[7];
  if (size < 28 || !in.read(reinterpret_cast<char*>(h), sizeof(h))) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": too short for a llama2.c header"));
  }
  auto m = std::unique_ptr<LlamaModel>(new LlamaModel());
  LlamaConfig& c = m->config_;
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
  m->weights_.resize(static_cast<size_t>(floats));
  if (!in.read(reinterpret_cast<char*>(m->weights_.data()), floats * 4)) {
    return absl::DataLossError(absl::StrCat(path, ": short read"));
  }
  for (float w : m->weights_) {
    if (!std::isfinite(w))
      return absl::InvalidArgumentError(absl::StrCat(path, ": non-finite weight"));
  }
  const float* p = m->weights_.data();
  auto take = [&](int64_t n) {
    const float* r = p;
    p += n;
    return r;
  };
  m->embed_ = take(c.vocab_size * d);
  m->rms_att_ = take(l * d);
  m->wq_ = take(l * d * d);
  m->wk_ = take(l * kv * d);
  m->wv_ = take(l * kv * d);
  m->wo_ = take(l * d * d);
  m->rms_ffn_ = take(l * d);
  m->w1_ = take(l * hd * d);
  m->w2_ = take(l * d * hd);
  m->w3_ = take(l * hd * d);
  m->rms_final_ = take(d);
  take(static_cast<int64_t>(c.seq_len) * c.head_dim());  // freq_cis, unused.
  m->wcls_ = c.shared_classifier ? m->embed_ : take(c.vocab_size * d);
  m->path_ = path;
  return m;
}

FullCacheAttention::FullCacheAttention(const LlamaConfig& c, KernelLevel level)
    : c_(c), level_(level), k_(c.n_layers), v_(c.n_layers) {}

absl::Status FullCacheAttention::Attend(int layer, int pos, const float* q, const float* k,
                                        const float* v, float* out) {
  const int kv = c_.kv_dim();
  if (static_cast<int64_t>(k_[layer].size()) != static_cast<int64_t>(pos) * kv) {
    return absl::FailedPreconditionError("positions must be fed in order");
  }
  k_[layer].insert(k_[layer].end(), k, k + kv);
  v_[layer].insert(v_[layer].end(), v, v + kv);
  const int hd = c_.head_dim();
  KvBlock b{EncodedView::Raw(v1::DTYPE_FP32, k_[layer].data(), c_.n_kv_heads, pos + 1, hd, hd, kv),
            EncodedView::Raw(v1::DTYPE_FP32, v_[layer].data(), c_.n_kv_heads, pos + 1, hd, hd, kv)};
  return DecodeAttention({c_.n_heads, c_.n_kv_heads, hd}, q, {&b, 1}, out, level_);
}

Forward::Forward(const LlamaModel& m) : m_(m) {
  const LlamaConfig& c = m.config();
  x_.resize(c.dim);
  xb_.resize(c.dim);
  q_.resize(c.dim);
  k_.resize(c.kv_dim());
  v_.resize(c.kv_dim());
  att_.resize(c.dim);
  hb_.resize(c.hidden_dim);
  hb2_.resize(c.hidden_dim);
}

absl::Status Forward::Step(int token, int pos, AttentionBackend* attn, float* logits) {
  const LlamaConfig& c = m_.config();
  if (token < 0 || token >= c.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("token id ", token, " outside vocab ", c.vocab_size));
  }
  if (pos < 0 || pos >= c.seq_len) {
    return absl::OutOfRangeError(
        absl::StrCat("position ", pos, " outside the model's ", c.seq_len));
  }
  const int d = c.dim, kv = c.kv_dim(), hid = c.hidden_dim;
  std::memcpy(x_.data(), m_.embed_ + static_cast<int64_t>(token) * d, d * sizeof(float));
  for (int l = 0; l < c.n_layers; ++l) {
    RmsNorm(xb_.data(), x_.data(), m_.rms_att_ + l * d, d);
    MatVec(q_.data(), xb_.data(), m_.wq_ + static_cast<int64_t>(l) * d * d, d, d);
    MatVec(k_.data(), xb_.data(), m_.wk_ + static_cast<int64_t>(l) * kv * d, kv, d);
    MatVec(v_.data(), xb_.data(), m_.wv_ + static_cast<int64_t>(l) * kv * d, kv, d);
    Rope(c, pos, q_.data(), k_.data());
    KVT_RETURN_IF_ERROR(attn->Attend(l, pos, q_.data(), k_.data(), v_.data(), att_.data()));
    MatVec(xb_.data(), att_.data(), m_.wo_ + static_cast<int64_t>(l) * d * d, d, d);
    for (int i = 0; i < d; ++i) x_[i] += xb_[i];
    RmsNorm(xb_.data(), x_.data(), m_.rms_ffn_ + l * d, d);
    MatVec(hb_.data(), xb_.data(), m_.w1_ + static_cast<int64_t>(l) * hid * d, hid, d);
    MatVec(hb2_.data(), xb_.data(), m_.w3_ + static_cast<int64_t>(l) * hid * d, hid, d);
    for (int i = 0; i < hid; ++i) {
      const float s = hb_[i] / (1.0f + std::exp(-hb_[i]));
      hb_[i] = s * hb2_[i];
    }
    MatVec(xb_.data(), hb_.data(), m_.w2_ + static_cast<int64_t>(l) * d * hid, d, hid);
    for (int i = 0; i < d; ++i) x_[i] += xb_[i];
  }
  if (logits != nullptr) {
    RmsNorm(xb_.data(), x_.data(), m_.rms_final_, d);
    MatVec(logits, xb_.data(), m_.wcls_, c.vocab_size, d);
  }
  return absl::OkStatus();
}

absl::Status PerTokenLayerAttention::AttendLayer(int layer, int pos0, int n, const float* q,
                                                 const float* k, const float* v, float* out) {
  const int d = c_.dim, kv = c_.kv_dim();
  for (int i = 0; i < n; ++i) {
    KVT_RETURN_IF_ERROR(
        b_->Attend(layer, pos0 + i, q + i * d, k + i * kv, v + i * kv, out + i * d));
  }
  return absl::OkStatus();
}

absl::Status Forward::Run(const std::vector<int>& tokens, int pos0, LayerAttention* attn,
                          float* logits) {
  const LlamaConfig& c = m_.config();
  const int n = static_cast<int>(tokens.size());
  if (n == 0) return absl::InvalidArgumentError("no tokens to run");
  if (pos0 < 0 || pos0 + n > c.seq_len) {
    return absl::OutOfRangeError(
        absl::StrCat("positions ", pos0, "..", pos0 + n - 1, " outside the model's ", c.seq_len));
  }
  const int d = c.dim, kv = c.kv_dim(), hid = c.hidden_dim;
  std::vector<float> x(static_cast<size_t>(n) * d), q(x.size()), att(x.size()),
      k(static_cast<size_t>(n) * kv), v(k.size());
  for (int i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", tokens[i], " outside vocab ", c.vocab_size));
    }
    std::memcpy(&x[i * d], m_.embed_ + static_cast<int64_t>(tokens[i]) * d, d * sizeof(float));
  }
  const bool speculate = attn->WantsNextLayerQuery();
  std::vector<float> q_next(speculate ? x.size() : 0);
  for (int l = 0; l < c.n_layers; ++l) {
    for (int i = 0; i < n; ++i) {
      RmsNorm(xb_.data(), &x[i * d], m_.rms_att_ + l * d, d);
      float *qi = &q[i * d], *ki = &k[i * kv], *vi = &v[i * kv];
      MatVec(qi, xb_.data(), m_.wq_ + static_cast<int64_t>(l) * d * d, d, d);
      MatVec(ki, xb_.data(), m_.wk_ + static_cast<int64_t>(l) * kv * d, kv, d);
      MatVec(vi, xb_.data(), m_.wv_ + static_cast<int64_t>(l) * kv * d, kv, d);
      Rope(c, pos0 + i, qi, ki);
    }
    if (speculate && l + 1 < c.n_layers) {
      for (int i = 0; i < n; ++i) {
        RmsNorm(xb_.data(), &x[i * d], m_.rms_att_ + (l + 1) * d, d);
        MatVec(&q_next[i * d], xb_.data(), m_.wq_ + static_cast<int64_t>(l + 1) * d * d, d, d);
        Rope(c, pos0 + i, &q_next[i * d], nullptr);
      }
      KVT_RETURN_IF_ERROR(attn->NextLayerQuery(l, pos0, n, q_next.data()));
    }
    KVT_RETURN_IF_ERROR(attn->AttendLayer(l, pos0, n, q.data(), k.data(), v.data(), att.data()));
    for (int i = 0; i < n; ++i) {
      float* xi = &x[i * d];
      MatVec(xb_.data(), &att[i * d], m_.wo_ + static_cast<int64_t>(l) * d * d, d, d);
      for (int j = 0; j < d; ++j) xi[j] += xb_[j];
      RmsNorm(xb_.data(), xi, m_.rms_ffn_ + l * d, d);
      MatVec(hb_.data(), xb_.data(), m_.w1_ + static_cast<int64_t>(l) * hid * d, hid, d);
      MatVec(hb2_.data(), xb_.data(), m_.w3_ + static_cast<int64_t>(l) * hid * d, hid, d);
      for (int j = 0; j < hid; ++j) {
        const float s = hb_[j] / (1.0f + std::exp(-hb_[j]));
        hb_[j] = s * hb2_[j];
      }
      MatVec(xb_.data(), hb_.data(), m_.w2_ + static_cast<int64_t>(l) * d * hid, d, hid);
      for (int j = 0; j < d; ++j) xi[j] += xb_[j];
    }
  }
  if (logits != nullptr) {
    RmsNorm(xb_.data(), &x[static_cast<size_t>(n - 1) * d], m_.rms_final_, d);
    MatVec(logits, xb_.data(), m_.wcls_, c.vocab_size, d);
  }
  return absl::OkStatus();
}

std::vector<double> Softmax(const float* logits, int n) {
  std::vector<double> p(n);
  double m = logits[0];
  for (int i = 1; i < n; ++i) m = std::max(m, static_cast<double>(logits[i]));
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += (p[i] = std::exp(logits[i] - m));
  for (double& x : p) x /= sum;
  return p;
}

double KlDivergence(const std::vector<double>& p, const std::vector<double>& q) {
  double kl = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] > 0) kl += p[i] * (std::log(p[i]) - std::log(std::max(q[i], 1e-300)));
  }
  return std::max(kl, 0.0);
}

int Argmax(const float* logits, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return best;
}

absl::StatusOr<std::vector<int>> SampleTokens(const LlamaModel& m, int n, uint64_t seed) {
  const LlamaConfig& c = m.config();
  if (n < 1 || n > c.seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence length must be in [1, ", c.seq_len, "]"));
  }
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  FullCacheAttention cache(c);
  Forward f(m);
  std::vector<float> logits(c.vocab_size);
  std::vector<int> tokens = {1};
  while (static_cast<int>(tokens.size()) < n) {
    const int pos = static_cast<int>(tokens.size()) - 1;
    KVT_RETURN_IF_ERROR(f.Step(tokens.back(), pos, &cache, logits.data()));
    const std::vector<double> p = Softmax(logits.data(), c.vocab_size);
    double r = u(rng), acc = 0;
    int next = c.vocab_size - 1;
    for (int i = 0; i < c.vocab_size; ++i) {
      acc += p[i];
      if (r < acc) {
        next = i;
        break;
      }
    }
    tokens.push_back(next);
  }
  return tokens;
}

}  // namespace kvtier::model
