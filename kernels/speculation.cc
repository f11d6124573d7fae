#include "kernels/speculation.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <numeric>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "kernels/codec_internal.h"
#include "kernels/crc32c.h"

namespace kvtier::spec {

int PartialColumns(double ratio, int head_dim) {
  const int r = static_cast<int>(std::lround(ratio * head_dim));
  return std::clamp(r, 1, head_dim);
}

int SkewModel::partial_columns() const { return PartialColumns(partial_ratio, head_dim); }

SkewModel IdentitySkew(int layers, int q_heads, int kv_heads, int head_dim, int partial) {
  SkewModel m;
  m.model = "identity";
  m.layers = layers;
  m.q_heads = q_heads;
  m.kv_heads = kv_heads;
  m.head_dim = head_dim;
  m.partial_ratio = static_cast<double>(partial) / head_dim;
  SkewHead h;
  h.a.assign(static_cast<size_t>(head_dim) * head_dim, 0.0f);
  for (int i = 0; i < head_dim; ++i) h.a[static_cast<size_t>(i) * head_dim + i] = 1.0f;
  for (int c = 0; c < partial; ++c) h.partial.push_back(c);
  m.heads.assign(layers, std::vector<SkewHead>(kv_heads, h));
  return m;
}

void SymmetricEigen(const std::vector<double>& m, int n, std::vector<double>* values,
                    std::vector<double>* vectors) {
  std::vector<double> a = m, v(static_cast<size_t>(n) * n, 0.0);
  for (int i = 0; i < n; ++i) v[i * n + i] = 1.0;
  auto at = [n](std::vector<double>& x, int i, int j) -> double& { return x[i * n + j]; };
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0, diag = 0;
    for (int i = 0; i < n; ++i) {
      diag += at(a, i, i) * at(a, i, i);
      for (int j = i + 1; j < n; ++j) off += at(a, i, j) * at(a, i, j);
    }
    if (off <= 1e-30 * std::max(diag, 1e-300)) break;
    for (int p = 0; p < n; ++p) {
      for (int q = p + 1; q < n; ++q) {
        const double apq = at(a, p, q);
        if (std::fabs(apq) < 1e-300) continue;
        // The rotation that zeroes a[p][q].
        const double theta = (at(a, q, q) - at(a, p, p)) / (2 * apq);
        const double t =
            (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int k = 0; k < n; ++k) {
          const double akp = at(a, k, p), akq = at(a, k, q);
          at(a, k, p) = c * akp - s * akq;
          at(a, k, q) = s * akp + c * akq;
        }
        for (int k = 0; k < n; ++k) {
          const double apk = at(a, p, k), aqk = at(a, q, k);
          at(a, p, k) = c * apk - s * aqk;
          at(a, q, k) = s * apk + c * aqk;
        }
        for (int k = 0; k < n; ++k) {
          const double vkp = at(v, k, p), vkq = at(v, k, q);
          at(v, k, p) = c * vkp - s * vkq;
          at(v, k, q) = s * vkp + c * vkq;
        }
      }
    }
  }
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int x, int y) { return at(a, x, x) > at(a, y, y); });
  values->assign(n, 0.0);
  vectors->assign(static_cast<size_t>(n) * n, 0.0);
  for (int j = 0; j < n; ++j) {
    (*values)[j] = at(a, order[j], order[j]);
    for (int i = 0; i < n; ++i) (*vectors)[i * n + j] = at(v, i, order[j]);
  }
}

absl::StatusOr<std::vector<SkewHead>> CalibrateLayer(const float* q, const float* k, int64_t tokens,
                                                     int q_heads, int kv_heads, int d,
                                                     double ratio) {
  if (tokens < 1 || q_heads < 1 || kv_heads < 1 || d < 1 || q_heads % kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("calibration shape: ", tokens, " tokens, ",
                                                   q_heads, " query heads, ", kv_heads,
                                                   " KV heads, head_dim ", d));
  }
  if (!(ratio > 0 && ratio <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("partial ratio must be in (0, 1], got ", ratio));
  }
  const int group = q_heads / kv_heads, r = PartialColumns(ratio, d);
  std::vector<SkewHead> out(kv_heads);
  for (int h = 0; h < kv_heads; ++h) {
    // Q^T Q and K^T K: their eigenvectors are the right singular vectors,
    // their eigenvalues the squared singular values.
    std::vector<double> cq(static_cast<size_t>(d) * d, 0.0), ck(cq.size(), 0.0);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int g = 0; g < group; ++g) {
        const float* x = q + (t * q_heads + h * group + g) * d;
        for (int i = 0; i < d; ++i) {
          for (int j = i; j < d; ++j) cq[i * d + j] += static_cast<double>(x[i]) * x[j];
        }
      }
      const float* y = k + (t * kv_heads + h) * d;
      for (int i = 0; i < d; ++i) {
        for (int j = i; j < d; ++j) ck[i * d + j] += static_cast<double>(y[i]) * y[j];
      }
    }
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j < i; ++j) {
        cq[i * d + j] = cq[j * d + i];
        ck[i * d + j] = ck[j * d + i];
      }
    }
    std::vector<double> lq, vq, lk, vk;
    SymmetricEigen(cq, d, &lq, &vq);
    SymmetricEigen(ck, d, &lk, &vk);
    // Rank the directions by sigma_q * sigma_k (both sorted, paired by rank).
    std::vector<int> order(d);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
      return std::sqrt(std::max(0.0, lq[x] * lk[x])) > std::sqrt(std::max(0.0, lq[y] * lk[y]));
    });
    SkewHead& s = out[h];
    s.a.resize(static_cast<size_t>(d) * d);
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j < d; ++j) s.a[i * d + j] = static_cast<float>(vq[i * d + order[j]]);
    }
    // Partial columns: the largest sum |q A| over the calibration queries.
    std::vector<double> mag(d, 0.0);
    std::vector<float> skewed(d);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int g = 0; g < group; ++g) {
        Skew(s, d, q + (t * q_heads + h * group + g) * d, skewed.data());
        for (int j = 0; j < d; ++j) mag[j] += std::fabs(skewed[j]);
      }
    }
    std::vector<int> cols(d);
    std::iota(cols.begin(), cols.end(), 0);
    std::stable_sort(cols.begin(), cols.end(), [&](int x, int y) { return mag[x] > mag[y]; });
    s.partial.assign(cols.begin(), cols.begin() + r);
    std::sort(s.partial.begin(), s.partial.end());
  }
  return out;
}

// Both walk A by rows (each output's sum still runs over i in order), so
// that every load of a row stays in the cache lines just read.
void Skew(const SkewHead& h, int d, const float* v, float* out) {
  std::vector<double> acc(d, 0.0);
  for (int i = 0; i < d; ++i) {
    const double vi = v[i];
    const float* row = h.a.data() + static_cast<size_t>(i) * d;
    for (int j = 0; j < d; ++j) acc[j] += vi * row[j];
  }
  for (int j = 0; j < d; ++j) out[j] = static_cast<float>(acc[j]);
}

void SkewPartial(const SkewHead& h, int d, const float* v, float* out) {
  const size_t r = h.partial.size();
  double small[256];
  std::vector<double> large;
  double* acc = small;
  if (r > 256) {
    large.resize(r);
    acc = large.data();
  }
  std::fill(acc, acc + r, 0.0);
  for (int i = 0; i < d; ++i) {
    const double vi = v[i];
    const float* row = h.a.data() + static_cast<size_t>(i) * d;
    for (size_t c = 0; c < r; ++c) acc[c] += vi * row[h.partial[c]];
  }
  for (size_t c = 0; c < r; ++c) out[c] = static_cast<float>(acc[c]);
}

namespace {

// SkewPartialRows for rows [0, n - n % 4): each row's sums in double over i
// in order, a product then a sum (no fused multiply-add), as SkewPartial;
// 4 rows in the lanes of a vector, 8 partial columns at a time.
__attribute__((target("avx2"))) void SkewPartialRows4(const SkewHead& h, int d, const float* rows,
                                                      int64_t n, float* out) {
  const int r = static_cast<int>(h.partial.size());
  std::vector<double> rt(static_cast<size_t>(d) * 4);  // 4 rows, transposed.
  for (int64_t t = 0; t + 4 <= n; t += 4) {
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j < 4; ++j) rt[i * 4 + j] = rows[(t + j) * d + i];
    }
    for (int c0 = 0; c0 < r; c0 += 8) {
      int col[8];
      for (int k = 0; k < 8; ++k) col[k] = h.partial[std::min(c0 + k, r - 1)];
      __m256d acc[8];
      for (__m256d& x : acc) x = _mm256_setzero_pd();
      for (int i = 0; i < d; ++i) {
        const __m256d vi = _mm256_loadu_pd(&rt[i * 4]);
        const float* arow = h.a.data() + static_cast<size_t>(i) * d;
        for (int k = 0; k < 8; ++k) {
          acc[k] = _mm256_add_pd(acc[k], _mm256_mul_pd(vi, _mm256_set1_pd(arow[col[k]])));
        }
      }
      for (int k = 0; k < 8 && c0 + k < r; ++k) {
        alignas(32) double lane[4];
        _mm256_store_pd(lane, acc[k]);
        for (int j = 0; j < 4; ++j) out[(t + j) * r + c0 + k] = static_cast<float>(lane[j]);
      }
    }
  }
}

}  // namespace

void SkewPartialRows(const SkewHead& h, int d, const float* rows, int64_t n, float* out) {
  const int64_t r = static_cast<int64_t>(h.partial.size());
  int64_t done = 0;
  if (internal::SimdAvailable()) {
    done = n - n % 4;
    SkewPartialRows4(h, d, rows, done, out);
  }
  for (int64_t t = done; t < n; ++t) SkewPartial(h, d, rows + t * d, out + t * r);
}

Speculated Speculate(const std::vector<SkewHead>& layer, const float* qhat,
                     const std::vector<const float*>& partial_keys, int64_t tokens, int q_heads,
                     int kv_heads, int d, const SpeculationParams& p) {
  return Speculate(layer, qhat, partial_keys, std::vector<int64_t>(kv_heads, tokens), q_heads,
                   kv_heads, d, p);
}

namespace {

// PartialScores of tokens [0, tokens - tokens % 8), 8 at a time, one per
// lane: each block of 8 keys is transposed into `block` (column c of the 8 at
// block[8c..8c+7]), then every query sums over it in column order with
// separate roundings, as the scalar loop does per token. Returns the tokens
// done.
__attribute__((target("avx2"))) int64_t PartialScoresAvx2(const float* qp, int n_q,
                                                          const float* keys, int64_t tokens, int r,
                                                          float scale, float* const* scores) {
  std::vector<float> block(static_cast<size_t>(r) * 8);
  const __m256 sv = _mm256_set1_ps(scale);
  int64_t t = 0;
  for (; t + 8 <= tokens; t += 8) {
    for (int j = 0; j < 8; ++j) {
      const float* row = keys + (t + j) * r;
      for (int c = 0; c < r; ++c) block[c * 8 + j] = row[c];
    }
    for (int i = 0; i < n_q; ++i) {
      const float* q = qp + static_cast<size_t>(i) * r;
      __m256 acc = _mm256_setzero_ps();
      for (int c = 0; c < r; ++c) {
        acc =
            _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(q[c]), _mm256_loadu_ps(&block[c * 8])));
      }
      _mm256_storeu_ps(scores[i] + t, _mm256_mul_ps(acc, sv));
    }
  }
  return t;
}

}  // namespace

void PartialScores(const float* qp, int n_q, const float* keys, int64_t tokens, int r, float scale,
                   float* const* scores) {
  if (tokens == 0) return;
  const int64_t done =
      internal::SimdAvailable() ? PartialScoresAvx2(qp, n_q, keys, tokens, r, scale, scores) : 0;
  for (int i = 0; i < n_q; ++i) {
    const float* q = qp + static_cast<size_t>(i) * r;
    for (int64_t t = done; t < tokens; ++t) {
      float acc = 0;
      for (int c = 0; c < r; ++c) acc += q[c] * keys[t * r + c];
      scores[i][t] = acc * scale;
    }
  }
}

Speculated Speculate(const std::vector<SkewHead>& layer, const float* qhat,
                     const std::vector<const float*>& partial_keys,
                     const std::vector<int64_t>& head_tokens, int q_heads, int kv_heads, int d,
                     const SpeculationParams& p) {
  Speculated out;
  const int group = q_heads / kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<std::vector<float>> scores(q_heads);
  out.counts.assign(q_heads, 0);
  int64_t most = 0;
  for (int kh = 0; kh < kv_heads; ++kh) {
    const int64_t tokens = head_tokens[kh];
    most = std::max(most, tokens);
    const SkewHead& s = layer[kh];
    const int r = static_cast<int>(s.partial.size());
    std::vector<float> qp(static_cast<size_t>(group) * r);
    std::vector<float*> rows(group);
    for (int g = 0; g < group; ++g) {
      const int h = kh * group + g;
      scores[h].resize(tokens);
      rows[g] = scores[h].data();
      SkewPartial(s, d, qhat + static_cast<size_t>(h) * d, qp.data() + static_cast<size_t>(g) * r);
    }
    PartialScores(qp.data(), group, partial_keys[kh], tokens, r, scale, rows.data());
    for (int g = 0; g < group; ++g) {
      const int h = kh * group + g;
      float best = -INFINITY;
      for (int64_t t = 0; t < tokens; ++t) best = std::max(best, scores[h][t]);
      for (int64_t t = 0; t < tokens; ++t) out.counts[h] += scores[h][t] >= best - p.alpha;
    }
  }
  double mean = 0;
  for (int c : out.counts) mean += c;
  mean /= std::max(1, q_heads);
  int64_t n = std::llround(mean);
  if (p.budget > 0) n = std::min<int64_t>(n, p.budget);
  n = std::clamp<int64_t>(n, 1, std::max<int64_t>(1, most));
  out.n = static_cast<int>(n);
  out.tokens.resize(q_heads);
  std::vector<int32_t> idx;
  for (int h = 0; h < q_heads; ++h) {
    const std::vector<float>& sc = scores[h];
    idx.resize(sc.size());
    std::iota(idx.begin(), idx.end(), 0);
    const auto take = static_cast<ptrdiff_t>(std::min<int64_t>(n, static_cast<int64_t>(sc.size())));
    // The top `take` under a strict order (score, then earlier token) is one
    // set: nth_element finds it in linear time (partial_sort's heap was a
    // tenth of a speculating decode step); the set is sorted by token below.
    if (take < static_cast<ptrdiff_t>(idx.size())) {
      std::nth_element(idx.begin(), idx.begin() + take, idx.end(), [&](int32_t x, int32_t y) {
        return sc[x] > sc[y] || (sc[x] == sc[y] && x < y);
      });
    }
    out.tokens[h].assign(idx.begin(), idx.begin() + take);
    std::sort(out.tokens[h].begin(), out.tokens[h].end());
  }
  return out;
}

HitRate Score(const Speculated& s, const float* q, const std::vector<const float*>& keys,
              int64_t tokens, int q_heads, int kv_heads, int d) {
  return Score(s, q, keys, std::vector<int64_t>(kv_heads, tokens), q_heads, kv_heads, d);
}

HitRate Score(const Speculated& s, const float* q, const std::vector<const float*>& keys,
              const std::vector<int64_t>& head_tokens, int q_heads, int kv_heads, int d) {
  HitRate r;
  const int group = q_heads / kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> p;
  for (int h = 0; h < q_heads; ++h) {
    const int64_t tokens = head_tokens[h / group];
    p.assign(static_cast<size_t>(tokens), 0.0);
    const float* qh = q + static_cast<size_t>(h) * d;
    const float* kh = keys[h / group];
    double best = -INFINITY;
    for (int64_t t = 0; t < tokens; ++t) {
      double acc = 0;
      for (int i = 0; i < d; ++i) acc += static_cast<double>(qh[i]) * kh[t * d + i];
      p[t] = acc * scale;
      best = std::max(best, p[t]);
    }
    double sum = 0;
    for (double& x : p) sum += (x = std::exp(x - best));
    for (double& x : p) x /= sum;
    const std::vector<int32_t>& sel = s.tokens[h];
    const size_t n = sel.size();
    std::vector<int32_t> order(tokens);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + n, order.end(),
                      [&](int32_t x, int32_t y) { return p[x] > p[y] || (p[x] == p[y] && x < y); });
    std::vector<bool> top(tokens, false);
    double top_mass = 0;
    for (size_t i = 0; i < n; ++i) {
      top[order[i]] = true;
      top_mass += p[order[i]];
    }
    double covered = 0, mass = 0;
    for (int32_t t : sel) {
      mass += p[t];
      if (top[t]) covered += p[t];
    }
    r.hit += top_mass > 0 ? covered / top_mass : 1.0;
    r.mass += mass;
  }
  r.hit /= std::max(1, q_heads);
  r.mass /= std::max(1, q_heads);
  return r;
}

namespace {

constexpr char kMagic[8] = {'K', 'V', 'T', 'S', 'K', 'E', 'W', '\0'};
constexpr uint32_t kVersion = 1;

template <typename T>
void Put(std::string* s, T x) {
  s->append(reinterpret_cast<const char*>(&x), sizeof(x));
}

class Reader {
 public:
  explicit Reader(absl::string_view b) : b_(b) {}
  template <typename T>
  bool Get(T* x) {
    if (b_.size() < sizeof(T)) return false;
    std::memcpy(x, b_.data(), sizeof(T));
    b_.remove_prefix(sizeof(T));
    return true;
  }
  bool Bytes(size_t n, std::string* out) {
    if (b_.size() < n) return false;
    out->assign(b_.data(), n);
    b_.remove_prefix(n);
    return true;
  }
  size_t left() const { return b_.size(); }

 private:
  absl::string_view b_;
};

}  // namespace

std::string SerializeSkew(const SkewModel& m) {
  std::string s(kMagic, sizeof(kMagic));
  Put<uint32_t>(&s, kVersion);
  for (int x : {m.layers, m.q_heads, m.kv_heads, m.head_dim, m.partial_columns()}) {
    Put<uint32_t>(&s, static_cast<uint32_t>(x));
  }
  Put<double>(&s, m.partial_ratio);
  Put<int64_t>(&s, m.calibration_tokens);
  Put<uint32_t>(&s, static_cast<uint32_t>(m.model.size()));
  s += m.model;
  for (const auto& layer : m.heads) {
    for (const SkewHead& h : layer) {
      s.append(reinterpret_cast<const char*>(h.a.data()), h.a.size() * sizeof(float));
      s.append(reinterpret_cast<const char*>(h.partial.data()), h.partial.size() * sizeof(int32_t));
    }
  }
  Put<uint32_t>(&s, Crc32c(s));
  return s;
}

absl::StatusOr<SkewModel> ParseSkew(absl::string_view bytes) {
  if (bytes.size() < sizeof(kMagic) || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return absl::InvalidArgumentError(
        "not a kvtier skew file (kvtier calibrate infinigen writes one)");
  }
  if (bytes.size() < sizeof(kMagic) + 8) return absl::DataLossError("skew file cut short");
  const absl::string_view body = bytes.substr(0, bytes.size() - 4);
  uint32_t crc;
  std::memcpy(&crc, bytes.data() + body.size(), 4);
  Reader rd(body.substr(sizeof(kMagic)));
  uint32_t version = 0;
  rd.Get(&version);
  if (version != kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("skew file version ", version, "; this build reads version ", kVersion));
  }
  if (Crc32c(std::string_view(body.data(), body.size())) != crc) {
    return absl::DataLossError("skew file checksum mismatch (corrupt or cut short)");
  }
  SkewModel m;
  uint32_t shape[5], name_len = 0;
  for (uint32_t& x : shape) {
    if (!rd.Get(&x)) return absl::DataLossError("skew file cut short");
  }
  if (!rd.Get(&m.partial_ratio) || !rd.Get(&m.calibration_tokens) || !rd.Get(&name_len) ||
      !rd.Bytes(name_len, &m.model)) {
    return absl::DataLossError("skew file cut short");
  }
  m.layers = static_cast<int>(shape[0]);
  m.q_heads = static_cast<int>(shape[1]);
  m.kv_heads = static_cast<int>(shape[2]);
  m.head_dim = static_cast<int>(shape[3]);
  const int r = static_cast<int>(shape[4]);
  if (m.layers < 1 || m.layers > 4096 || m.kv_heads < 1 || m.q_heads < m.kv_heads ||
      m.q_heads % m.kv_heads != 0 || m.head_dim < 1 || m.head_dim > 1024 || r < 1 ||
      r > m.head_dim || r != m.partial_columns()) {
    return absl::InvalidArgumentError(
        absl::StrCat("skew file shape: ", m.layers, " layers, ", m.q_heads, " query heads, ",
                     m.kv_heads, " KV heads, head_dim ", m.head_dim, ", ", r, " partial columns"));
  }
  const size_t per = static_cast<size_t>(m.head_dim) * m.head_dim * 4 + static_cast<size_t>(r) * 4;
  if (rd.left() != per * m.layers * m.kv_heads) {
    return absl::InvalidArgumentError("skew file size does not match its shape");
  }
  m.heads.assign(m.layers, std::vector<SkewHead>(m.kv_heads));
  for (auto& layer : m.heads) {
    for (SkewHead& h : layer) {
      std::string a, p;
      rd.Bytes(static_cast<size_t>(m.head_dim) * m.head_dim * 4, &a);
      rd.Bytes(static_cast<size_t>(r) * 4, &p);
      h.a.resize(static_cast<size_t>(m.head_dim) * m.head_dim);
      h.partial.resize(r);
      std::memcpy(h.a.data(), a.data(), a.size());
      std::memcpy(h.partial.data(), p.data(), p.size());
      for (int32_t c : h.partial) {
        if (c < 0 || c >= m.head_dim) {
          return absl::InvalidArgumentError(absl::StrCat("skew file: partial column ", c));
        }
      }
    }
  }
  return m;
}

absl::Status SaveSkew(const std::string& path, const SkewModel& m) {
  const std::string bytes = SerializeSkew(m);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!f) return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadSkewFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read skew file ", path));
  std::stringstream ss;
  ss << f.rdbuf();
  std::string bytes = ss.str();
  absl::StatusOr<SkewModel> m = ParseSkew(bytes);
  if (!m.ok())
    return absl::Status(m.status().code(), absl::StrCat(path, ": ", m.status().message()));
  return bytes;
}

absl::StatusOr<SkewModel> LoadSkew(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadSkewFile(path);
  if (!bytes.ok()) return bytes.status();
  return ParseSkew(*bytes);
}

}  // namespace kvtier::spec
