#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/codec_internal.h"
#include "kernels/encoded_tensor.h"

namespace kvtier {
namespace {

constexpr int64_t kTileTokens = 64;

absl::Status CheckBlock(const AttentionShape& shape, const KvBlock& b, size_t i) {
  auto bad = [&](const char* what) {
    return absl::InvalidArgumentError(absl::StrCat("attention block ", i, ": ", what));
  };
  if (b.k.slabs != shape.kv_heads || b.v.slabs != shape.kv_heads) {
    return bad("K and V need one slab per KV head");
  }
  if (b.k.head_dim != shape.head_dim || b.v.head_dim != shape.head_dim) {
    return bad("head_dim does not match");
  }
  if (b.k.tokens != b.v.tokens) return bad("K and V hold different token counts");
  if (b.k.codec != v1::CODEC_RAW && b.k.role != v1::TENSOR_ROLE_KEY)
    return bad("K is not a KEY tensor");
  if (b.v.codec != v1::CODEC_RAW && b.v.role != v1::TENSOR_ROLE_VALUE) {
    return bad("V is not a VALUE tensor");
  }
  return absl::OkStatus();
}

void Reference(const AttentionShape& shape, const float* q, absl::Span<const KvBlock> blocks,
               int64_t total, float* out) {
  const int d = shape.head_dim;
  const int rep = shape.q_heads / shape.kv_heads;
  std::vector<float> rows;
  std::vector<double> scores(static_cast<size_t>(total)), acc(d);
  for (int h = 0; h < shape.q_heads; ++h) {
    const int kvh = h / rep;
    int64_t pos = 0;
    for (const KvBlock& b : blocks) {
      rows.resize(static_cast<size_t>(b.k.tokens * d));
      DecodeRows(b.k, kvh, 0, b.k.tokens, rows.data(), KernelLevel::kReference);
      for (int64_t t = 0; t < b.k.tokens; ++t) {
        double s = 0;
        for (int c = 0; c < d; ++c) s += static_cast<double>(q[h * d + c]) * rows[t * d + c];
        scores[pos + t] = s * shape.scale;
      }
      pos += b.k.tokens;
    }
    const double m = *std::max_element(scores.begin(), scores.end());
    double sum = 0;
    for (double& s : scores) sum += (s = std::exp(s - m));
    std::fill(acc.begin(), acc.end(), 0.0);
    pos = 0;
    for (const KvBlock& b : blocks) {
      rows.resize(static_cast<size_t>(b.v.tokens * d));
      DecodeRows(b.v, kvh, 0, b.v.tokens, rows.data(), KernelLevel::kReference);
      for (int64_t t = 0; t < b.v.tokens; ++t) {
        const double p = scores[pos + t] / sum;
        for (int c = 0; c < d; ++c) acc[c] += p * rows[t * d + c];
      }
      pos += b.v.tokens;
    }
    for (int c = 0; c < d; ++c) out[h * d + c] = static_cast<float>(acc[c]);
  }
}

// Scores or accumulates one block through fp32 tiles when no fused kernel
// handles it (GEAR, or a shape the vectorized kernels do not cover).
void TiledScore(const EncodedView& k, int64_t s, const float* const* q, int rep, float scale,
                float* const* scores, std::vector<float>* tile) {
  const int d = k.head_dim;
  tile->resize(static_cast<size_t>(kTileTokens * d));
  std::vector<float*> sc(rep);
  for (int64_t t0 = 0; t0 < k.tokens; t0 += kTileTokens) {
    const int64_t n = std::min(kTileTokens, k.tokens - t0);
    DecodeRows(k, s, t0, t0 + n, tile->data(), KernelLevel::kVectorized);
    const EncodedView tv = EncodedView::Raw(v1::DTYPE_FP32, tile->data(), 1, n, d, n * d, d);
    for (int r = 0; r < rep; ++r) sc[r] = scores[r] + t0;
    if (!internal::ScoreBlockSimd(tv, 0, q, rep, scale, sc.data())) {
      for (int r = 0; r < rep; ++r) {
        for (int64_t t = 0; t < n; ++t) {
          float acc = 0;
          for (int c = 0; c < d; ++c) acc += q[r][c] * (*tile)[t * d + c];
          sc[r][t] = scale * acc;
        }
      }
    }
  }
}

void TiledAccumulate(const EncodedView& v, int64_t s, const float* const* p, int rep,
                     float* const* out, std::vector<float>* tile) {
  const int d = v.head_dim;
  tile->resize(static_cast<size_t>(kTileTokens * d));
  std::vector<const float*> pp(rep);
  for (int64_t t0 = 0; t0 < v.tokens; t0 += kTileTokens) {
    const int64_t n = std::min(kTileTokens, v.tokens - t0);
    DecodeRows(v, s, t0, t0 + n, tile->data(), KernelLevel::kVectorized);
    const EncodedView tv = EncodedView::Raw(v1::DTYPE_FP32, tile->data(), 1, n, d, n * d, d);
    for (int r = 0; r < rep; ++r) pp[r] = p[r] + t0;
    if (!internal::AccumulateBlockSimd(tv, 0, pp.data(), rep, out)) {
      for (int r = 0; r < rep; ++r) {
        for (int64_t t = 0; t < n; ++t) {
          for (int c = 0; c < d; ++c) out[r][c] += pp[r][t] * (*tile)[t * d + c];
        }
      }
    }
  }
}

void Vectorized(const AttentionShape& shape, const float* q, absl::Span<const KvBlock> blocks,
                int64_t total, float* out, bool integer) {
  const int d = shape.head_dim;
  const int rep = shape.q_heads / shape.kv_heads;
  std::vector<float> scores(static_cast<size_t>(rep) * total), tile;
  std::vector<float*> sc(rep), o(rep);
  std::vector<const float*> qr(rep), pr(rep);
  for (int h = 0; h < shape.kv_heads; ++h) {
    for (int r = 0; r < rep; ++r) {
      qr[r] = q + (h * rep + r) * d;
      o[r] = out + (h * rep + r) * d;
      std::fill(o[r], o[r] + d, 0.0f);
    }
    int64_t pos = 0;
    for (const KvBlock& b : blocks) {
      for (int r = 0; r < rep; ++r) sc[r] = scores.data() + r * total + pos;
      if (!internal::ScoreBlockSimd(b.k, h, qr.data(), rep, shape.scale, sc.data(), integer)) {
        TiledScore(b.k, h, qr.data(), rep, shape.scale, sc.data(), &tile);
      }
      pos += b.k.tokens;
    }
    for (int r = 0; r < rep; ++r) {
      float* s = scores.data() + r * total;
      if (!internal::SoftmaxSimd(s, total)) {
        const float m = *std::max_element(s, s + total);
        double sum = 0;
        for (int64_t t = 0; t < total; ++t) sum += (s[t] = std::exp(s[t] - m));
        for (int64_t t = 0; t < total; ++t) s[t] = static_cast<float>(s[t] / sum);
      }
    }
    pos = 0;
    for (const KvBlock& b : blocks) {
      for (int r = 0; r < rep; ++r) pr[r] = scores.data() + r * total + pos;
      if (!internal::AccumulateBlockSimd(b.v, h, pr.data(), rep, o.data(), integer)) {
        TiledAccumulate(b.v, h, pr.data(), rep, o.data(), &tile);
      }
      pos += b.v.tokens;
    }
  }
}

}  // namespace

bool Int8AttentionEnabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("KVTIER_INT8_ATTENTION");
    return env == nullptr || std::string(env) != "off";
  }();
  return enabled && internal::SimdAvailable();
}

absl::Status DecodeAttention(const AttentionShape& shape_in, const float* q,
                             absl::Span<const KvBlock> blocks, float* out, KernelLevel level) {
  AttentionShape shape = shape_in;
  if (shape.q_heads < 1 || shape.kv_heads < 1 || shape.head_dim < 1 ||
      shape.q_heads % shape.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention shape needs q_heads a positive multiple of kv_heads and head_dim >= 1; got ",
        shape.q_heads, "/", shape.kv_heads, "/", shape.head_dim));
  }
  if (shape.scale == 0.0f) shape.scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  int64_t total = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (auto s = CheckBlock(shape, blocks[i], i); !s.ok()) return s;
    total += blocks[i].k.tokens;
  }
  if (total == 0) return absl::InvalidArgumentError("attention over no tokens");
  if (level == KernelLevel::kReference || !internal::SimdAvailable()) {
    Reference(shape, q, blocks, total, out);
  } else {
    Vectorized(shape, q, blocks, total, out, level == KernelLevel::kBest && Int8AttentionEnabled());
  }
  return absl::OkStatus();
}

EncodedView SliceSlabs(const EncodedView& v, int64_t first, int64_t count) {
  EncodedView o = v;
  o.slabs = count;
  const int64_t dsize = DTypeSize(v.dtype);
  if (v.codec == v1::CODEC_RAW) {
    o.raw = static_cast<const uint8_t*>(v.raw) + first * v.slab_stride * dsize;
    return o;
  }
  o.codes = v.codes + first * v.words_per_slab * 4;
  o.scales = v.scales + first * v.groups_per_slab;
  o.zeros = v.zeros + first * v.groups_per_slab;
  if (v.residual_data != nullptr) {
    o.residual_data = static_cast<const uint8_t*>(v.residual_data) + first * v.slab_stride * dsize;
  }
  if (v.rank > 0) {
    o.lowrank_a = v.lowrank_a + first * v.quantized * v.rank;
    o.lowrank_b = v.lowrank_b + first * v.rank * v.head_dim;
  }
  if (v.outliers_per_row > 0) {
    const int64_t per_slab = v.sparse_rows_per_slab * v.outliers_per_row;
    o.sparse_index = v.sparse_index + first * per_slab * v.sparse_index_bytes;
    o.sparse_value = v.sparse_value + first * per_slab * dsize;
  }
  return o;
}

}  // namespace kvtier
