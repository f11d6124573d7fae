#include "model/forward.h"

#include <cmath>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/attention.h"
#include "model/matmul.h"

namespace kvtier::model {
namespace {

// out = w * x / rms(x), the sum of squares in float64.
void RmsNorm(float* out, const float* x, const float* w, int n, float eps) {
  double ss = 0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
  for (int i = 0; i < n; ++i) out[i] = w[i] * (inv * x[i]);
}

// RoPE at position `pos` on `heads` heads of width hd, in place: dimension
// pair i turned by pos * base^(-2i/hd). llama pairs adjacent dimensions
// (2i, 2i + 1); gemma3 pairs the halves (i, i + hd/2).
void Rope(bool halves, float base, int pos, float* v, int heads, int hd) {
  for (int i = 0; i < hd / 2; ++i) {
    const double freq = 1.0 / std::pow(static_cast<double>(base), 2.0 * i / hd);
    const double angle = pos * freq;
    const float fc = static_cast<float>(std::cos(angle)), fs = static_cast<float>(std::sin(angle));
    const int a = halves ? i : 2 * i, b = halves ? i + hd / 2 : 2 * i + 1;
    for (int h = 0; h < heads; ++h) {
      float* x = v + h * hd;
      const float x0 = x[a], x1 = x[b];
      x[a] = x0 * fc - x1 * fs;
      x[b] = x0 * fs + x1 * fc;
    }
  }
}

float Gelu(float x) {
  constexpr double kSqrt2OverPi = 0.7978845608028654;
  const double d = x;
  return static_cast<float>(0.5 * d * (1.0 + std::tanh(kSqrt2OverPi * (d + 0.044715 * d * d * d))));
}

float Silu(float x) { return x / (1.0f + std::exp(-x)); }

}  // namespace

FullCacheAttention::FullCacheAttention(const ModelConfig& c, KernelLevel level)
    : c_(c), level_(level), k_(c.n_layers), v_(c.n_layers) {}

absl::Status FullCacheAttention::Attend(int layer, int pos, const float* q, const float* k,
                                        const float* v, float* out) {
  const int kv = c_.kv_dim();
  if (static_cast<int64_t>(k_[layer].size()) != static_cast<int64_t>(pos) * kv) {
    return absl::FailedPreconditionError("positions must be fed in order");
  }
  k_[layer].insert(k_[layer].end(), k, k + kv);
  v_[layer].insert(v_[layer].end(), v, v + kv);
  const int hd = c_.head_dim(), window = c_.layer_window(layer);
  const int first = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
  const int n = pos + 1 - first;
  const float* kp = k_[layer].data() + static_cast<int64_t>(first) * kv;
  const float* vp = v_[layer].data() + static_cast<int64_t>(first) * kv;
  KvBlock b{EncodedView::Raw(DType::kFp32, kp, c_.n_kv_heads, n, hd, hd, kv),
            EncodedView::Raw(DType::kFp32, vp, c_.n_kv_heads, n, hd, hd, kv)};
  return DecodeAttention({c_.n_heads, c_.n_kv_heads, hd}, q, {&b, 1}, out, level_);
}

absl::Status PerTokenLayerAttention::AttendLayer(int layer, int pos0, int n, const float* q,
                                                 const float* k, const float* v, float* out) {
  const int qd = c_.q_dim(), kv = c_.kv_dim();
  for (int i = 0; i < n; ++i) {
    KVT_RETURN_IF_ERROR(b_->Attend(
        layer, pos0 + i, q + static_cast<int64_t>(i) * qd, k + static_cast<int64_t>(i) * kv,
        v + static_cast<int64_t>(i) * kv, out + static_cast<int64_t>(i) * qd));
  }
  return absl::OkStatus();
}

Forward::Forward(const Model& m, ThreadPool* pool) : m_(m), pool_(pool) {}

absl::Status Forward::Step(int token, int pos, AttentionBackend* attn, float* logits) {
  PerTokenLayerAttention layered(m_.config(), attn);
  return RunTokens({token}, pos, &layered, logits, false);
}

absl::Status Forward::Run(const std::vector<int>& tokens, int pos0, LayerAttention* attn,
                          float* logits) {
  return RunTokens(tokens, pos0, attn, logits, false);
}

absl::Status Forward::RunAllLogits(const std::vector<int>& tokens, int pos0, LayerAttention* attn,
                                   float* logits) {
  return RunTokens(tokens, pos0, attn, logits, true);
}

absl::Status Forward::Layer(int l, int pos0, int n, float* x, LayerAttention* attn) {
  const ModelConfig& c = m_.config();
  const LayerWeights& w = m_.layer(l);
  const bool gemma = c.arch == Arch::kGemma3;
  const int d = c.dim, qd = c.q_dim(), kv = c.kv_dim(), hd = c.head_dim(), hid = c.hidden_dim;
  const size_t nn = static_cast<size_t>(n);
  std::vector<float> xn(nn * d), q(nn * qd), k(nn * kv), v(nn * kv), att(nn * qd), o(nn * d);
  auto norm_rows = [&](const float* in, const std::vector<float>& wt, float* out, int width,
                       int rows) {
    for (int i = 0; i < rows; ++i) {
      RmsNorm(out + static_cast<int64_t>(i) * width, in + static_cast<int64_t>(i) * width,
              wt.data(), width, c.rms_eps);
    }
  };
  norm_rows(x, w.attn_norm, xn.data(), d, n);
  w.wq.Mul(xn.data(), n, q.data(), pool_);
  w.wk.Mul(xn.data(), n, k.data(), pool_);
  w.wv.Mul(xn.data(), n, v.data(), pool_);
  if (gemma) {
    norm_rows(q.data(), w.q_norm, q.data(), hd, n * c.n_heads);
    norm_rows(k.data(), w.k_norm, k.data(), hd, n * c.n_kv_heads);
  }
  const float base = c.layer_rope(l);
  for (int i = 0; i < n; ++i) {
    Rope(gemma, base, pos0 + i, &q[i * static_cast<size_t>(qd)], c.n_heads, hd);
    Rope(gemma, base, pos0 + i, &k[i * static_cast<size_t>(kv)], c.n_kv_heads, hd);
  }
  if (attn->WantsNextLayerQuery() && l + 1 < c.n_layers) {
    // The approximate query of layer l + 1: this layer's input through the
    // next layer's norm, W_q (QK-norm) and RoPE.
    const LayerWeights& nw = m_.layer(l + 1);
    std::vector<float> qn(nn * qd);
    norm_rows(x, nw.attn_norm, xn.data(), d, n);
    nw.wq.Mul(xn.data(), n, qn.data(), pool_);
    if (gemma) norm_rows(qn.data(), nw.q_norm, qn.data(), hd, n * c.n_heads);
    for (int i = 0; i < n; ++i) {
      Rope(gemma, c.layer_rope(l + 1), pos0 + i, &qn[i * static_cast<size_t>(qd)], c.n_heads, hd);
    }
    KVT_RETURN_IF_ERROR(attn->NextLayerQuery(l, pos0, n, qn.data()));
  }
  KVT_RETURN_IF_ERROR(attn->AttendLayer(l, pos0, n, q.data(), k.data(), v.data(), att.data()));
  w.wo.Mul(att.data(), n, o.data(), pool_);
  if (gemma) norm_rows(o.data(), w.post_attn_norm, o.data(), d, n);
  for (size_t i = 0; i < nn * d; ++i) x[i] += o[i];
  norm_rows(x, w.ffn_norm, xn.data(), d, n);
  std::vector<float> g(nn * hid), u(nn * hid);
  w.gate.Mul(xn.data(), n, g.data(), pool_);
  w.up.Mul(xn.data(), n, u.data(), pool_);
  for (size_t i = 0; i < g.size(); ++i) g[i] = (gemma ? Gelu(g[i]) : Silu(g[i])) * u[i];
  w.down.Mul(g.data(), n, o.data(), pool_);
  if (gemma) norm_rows(o.data(), w.post_ffn_norm, o.data(), d, n);
  for (size_t i = 0; i < nn * d; ++i) x[i] += o[i];
  return absl::OkStatus();
}

absl::Status Forward::RunTokens(const std::vector<int>& tokens, int pos0, LayerAttention* attn,
                                float* logits, bool all) {
  const ModelConfig& c = m_.config();
  const int n = static_cast<int>(tokens.size());
  if (n == 0) return absl::InvalidArgumentError("no tokens to run");
  if (pos0 < 0 || pos0 + n > c.seq_len) {
    return absl::OutOfRangeError(
        absl::StrCat("positions ", pos0, "..", pos0 + n - 1, " outside the model's ", c.seq_len));
  }
  const int d = c.dim;
  std::vector<float> x(static_cast<size_t>(n) * d);
  const float scale = c.arch == Arch::kGemma3 ? std::sqrt(static_cast<float>(d)) : 1.0f;
  for (int i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", tokens[i], " outside vocab ", c.vocab_size));
    }
    float* xi = &x[static_cast<size_t>(i) * d];
    m_.embedding().Row(tokens[i], xi);
    for (int j = 0; j < d; ++j) xi[j] *= scale;
  }
  for (int l = 0; l < c.n_layers; ++l) KVT_RETURN_IF_ERROR(Layer(l, pos0, n, x.data(), attn));
  if (logits != nullptr) {
    const int first = all ? 0 : n - 1, rows = n - first;
    std::vector<float> xn(static_cast<size_t>(rows) * d);
    for (int i = 0; i < rows; ++i) {
      RmsNorm(&xn[static_cast<size_t>(i) * d], &x[static_cast<size_t>(first + i) * d],
              m_.final_norm().data(), d, c.rms_eps);
    }
    m_.output().Mul(xn.data(), rows, logits, pool_);
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

absl::StatusOr<std::vector<int>> SampleTokens(const Model& m, int n, uint64_t seed) {
  const ModelConfig& c = m.config();
  if (n < 1 || n > c.seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence length must be in [1, ", c.seq_len, "]"));
  }
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  FullCacheAttention cache(c);
  Forward f(m);
  std::vector<float> logits(c.vocab_size);
  std::vector<int> tokens = {
      m.tokenizer() != nullptr && m.tokenizer()->bos() >= 0 ? m.tokenizer()->bos() : 1};
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
