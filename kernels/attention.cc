#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/codec_internal.h"

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
  if (b.k.codec != Codec::kRaw && b.k.role != TensorRole::kKey) return bad("K is not a KEY tensor");
  if (b.v.codec != Codec::kRaw && b.v.role != TensorRole::kValue) {
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
    const EncodedView tv = EncodedView::Raw(DType::kFp32, tile->data(), 1, n, d, n * d, d);
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
    const EncodedView tv = EncodedView::Raw(DType::kFp32, tile->data(), 1, n, d, n * d, d);
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

// GEAR and GEAR-L decode to D + A·B with the outliers put in place: the
// backbone's dequantized codes D, the low-rank term A·B (A [Tq, r], B [r, D],
// fp16), and at each outlier position the stored value instead. Attention
// runs the backbone through the fused KIVI/KCVT kernels and adds the rest
// as corrections, so no tile is ever decoded:
//   q·k_t   += q·(A_t·B) = A_t · (B q)         r products per token
//   Σ p_t v_t += Σ_t p_t A_t·B = (Σ_t p_t A_t)·B  r per token, r·D at the end
// and at an outlier (t, c) the difference between its value and D + A·B
// there, which is what DecodeRows' replacement amounts to.
bool IsGear(const EncodedView& v) { return v.codec == Codec::kGear || v.codec == Codec::kGearL; }

EncodedView GearBackbone(const EncodedView& v) {
  EncodedView b = v;
  // KIVI and KCVT share the layout; the effective group tells them apart.
  b.codec = Codec::kKivi;
  b.rank = 0;
  b.lowrank_a = b.lowrank_b = nullptr;
  b.outliers_per_row = 0;
  b.sparse_rows_per_slab = 0;
  b.sparse_index = b.sparse_value = nullptr;
  return b;
}

// One slab's GEAR terms in fp32: A, also transposed to [r, Tq] so that the
// per-token work runs along contiguous rows, and B [r, D].
class GearSlab {
 public:
  GearSlab(const EncodedView& v, int64_t s)
      : v_(v),
        s_(s),
        deq_(Shape(v), v.codes + s * v.words_per_slab * 4, v.scales + s * v.groups_per_slab,
             v.zeros + s * v.groups_per_slab) {
    if (v.rank > 0) {
      const int64_t tq = v.quantized;
      std::vector<float> a(static_cast<size_t>(tq * v.rank));
      Widen(v.lowrank_a + s * tq * v.rank, a);
      at_.resize(a.size());
      for (int64_t t = 0; t < tq; ++t) {
        for (int j = 0; j < v.rank; ++j) at_[j * tq + t] = a[t * v.rank + j];
      }
      a_ = std::move(a);
      b_.resize(static_cast<size_t>(v.rank * v.head_dim));
      Widen(v.lowrank_b + s * v.rank * v.head_dim, b_);
    }
  }
  int rank() const { return v_.rank; }
  const float* a_column(int j) const { return at_.data() + j * v_.quantized; }
  const float* b(int j) const { return b_.data() + j * v_.head_dim; }

  // Stored value minus D + A·B at (t, c).
  float OutlierDelta(int64_t t, int c, float value) const {
    float base = deq_(t, c);
    const float* __restrict a = a_.data() + t * v_.rank;
    const float* __restrict b = b_.data() + c;
    for (int j = 0; j < v_.rank; ++j) base += a[j] * b[j * v_.head_dim];
    return value - base;
  }

  // Calls f(t, c, value) for every outlier of the slab. K's rows are
  // channels, each with its positions (tokens) in order; they are walked a
  // block of kTileTokens tokens at a time, every channel within it, so that
  // the codes, A and the scores of those tokens stay in cache. V's rows are
  // tokens, with channel positions.
  template <typename F>
  void ForEachOutlier(F f) const {
    const int opr = v_.outliers_per_row;
    const int64_t rows = v_.sparse_rows_per_slab;
    const int64_t first = s_ * rows * opr;
    if (v_.role == TensorRole::kValue) {
      for (int64_t t = 0; t < rows; ++t) {
        for (int k = 0; k < opr; ++k) {
          const int64_t i = first + t * opr + k;
          f(t, static_cast<int>(ReadSparseIndex(i)), Value(i));
        }
      }
      return;
    }
    std::vector<int> next(static_cast<size_t>(rows), 0);
    for (int64_t t_end = kTileTokens;; t_end += kTileTokens) {
      for (int64_t c = 0; c < rows; ++c) {
        const int64_t row = first + c * opr;
        int& k = next[c];
        for (; k < opr; ++k) {
          const int64_t t = ReadSparseIndex(row + k);
          if (t >= t_end) break;
          f(t, static_cast<int>(c), Value(row + k));
        }
      }
      if (t_end >= v_.quantized) break;
    }
  }

 private:
  static internal::QuantShape Shape(const EncodedView& v) {
    internal::QuantShape q;
    q.key = v.role != TensorRole::kValue;
    q.bits = v.bits;
    q.group = v.group;
    q.tq = v.quantized;
    q.d = v.head_dim;
    return q;
  }
  static void Widen(const uint16_t* h, std::vector<float>& out) {
    if (internal::WidenSimd(h, false, static_cast<int64_t>(out.size()), out.data())) return;
    for (size_t i = 0; i < out.size(); ++i) out[i] = HalfToFloat(internal::LoadU16(h, i));
  }
  float Value(int64_t i) const {
    if (v_.dtype == DType::kFp16) {
      return HalfToFloat(internal::LoadU16(reinterpret_cast<const uint16_t*>(v_.sparse_value), i));
    }
    return internal::LoadElement(v_.dtype, v_.sparse_value, i);
  }
  int64_t ReadSparseIndex(int64_t i) const {
    return internal::ReadSparseIndex(v_.sparse_index, v_.sparse_index_bytes, i);
  }

  const EncodedView& v_;
  int64_t s_;
  internal::ElementDequantizer deq_;
  std::vector<float> a_, at_, b_;  // A as [Tq, r] and as [r, Tq]; B.
};

void Axpy(float a, const float* x, int64_t n, float* y) {
  if (internal::AxpySimd(a, x, n, y)) return;
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

float Dot(const float* x, const float* y, int64_t n) {
  float d = 0;
  if (internal::DotSimd(x, y, n, &d)) return d;
  for (int64_t i = 0; i < n; ++i) d += x[i] * y[i];
  return d;
}

void ScoreGear(const EncodedView& k, int64_t s, const float* const* q, int rep, float scale,
               float* const* scores, bool integer, std::vector<float>* tile) {
  const EncodedView bb = GearBackbone(k);
  if (!internal::ScoreBlockSimd(bb, s, q, rep, scale, scores, integer)) {
    TiledScore(bb, s, q, rep, scale, scores, tile);
  }
  if (k.quantized == 0 || (k.rank == 0 && k.outliers_per_row == 0)) return;
  const GearSlab g(k, s);
  const int d = k.head_dim;
  // scores_r += (scale * q_r · B_j) A_j for each rank j.
  for (int r = 0; r < rep; ++r) {
    for (int j = 0; j < g.rank(); ++j) {
      Axpy(scale * Dot(q[r], g.b(j), d), g.a_column(j), k.quantized, scores[r]);
    }
  }
  if (k.outliers_per_row == 0) return;
  // Each query head's score row, as locals the compiler need not reload.
  std::vector<float*> sr(scores, scores + rep);
  std::vector<const float*> qr(q, q + rep);
  g.ForEachOutlier([&](int64_t t, int c, float value) {
    const float delta = scale * g.OutlierDelta(t, c, value);
    for (int r = 0; r < rep; ++r) sr[r][t] += qr[r][c] * delta;
  });
}

void AccumulateGear(const EncodedView& v, int64_t s, const float* const* p, int rep,
                    float* const* out, bool integer, std::vector<float>* tile) {
  const EncodedView bb = GearBackbone(v);
  if (!internal::AccumulateBlockSimd(bb, s, p, rep, out, integer)) {
    TiledAccumulate(bb, s, p, rep, out, tile);
  }
  if (v.quantized == 0 || (v.rank == 0 && v.outliers_per_row == 0)) return;
  const GearSlab g(v, s);
  const int d = v.head_dim;
  // out_r += (p_r · A_j) B_j for each rank j.
  for (int r = 0; r < rep; ++r) {
    for (int j = 0; j < g.rank(); ++j)
      Axpy(Dot(p[r], g.a_column(j), v.quantized), g.b(j), d, out[r]);
  }
  if (v.outliers_per_row == 0) return;
  std::vector<float*> o(out, out + rep);
  std::vector<const float*> pr(p, p + rep);
  g.ForEachOutlier([&](int64_t t, int c, float value) {
    const float delta = g.OutlierDelta(t, c, value);
    for (int r = 0; r < rep; ++r) o[r][c] += pr[r][t] * delta;
  });
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
      if (IsGear(b.k)) {
        ScoreGear(b.k, h, qr.data(), rep, shape.scale, sc.data(), integer, &tile);
      } else if (!internal::ScoreBlockSimd(b.k, h, qr.data(), rep, shape.scale, sc.data(),
                                           integer)) {
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
      if (IsGear(b.v)) {
        AccumulateGear(b.v, h, pr.data(), rep, o.data(), integer, &tile);
      } else if (!internal::AccumulateBlockSimd(b.v, h, pr.data(), rep, o.data(), integer)) {
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

const char* IntegerDotIsa() {
  if (!Int8AttentionEnabled()) return "none";
  return internal::VnniAvailable() ? "avx512-vnni" : "avx2";
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
  if (v.codec == Codec::kRaw) {
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
