#include "kernels/eviction.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "kernels/attention.h"
#include "kernels/flat_cache.h"

namespace kvtier::evict {
namespace {

// `scored`: the caller reads x.q and x.k (every method but none and
// streaming, which select by position alone).
absl::Status CheckShape(const LayerQK& x, bool scored = true) {
  if (x.q_heads < 1 || x.kv_heads < 1 || x.q_heads % x.kv_heads != 0 || x.d < 1 || x.tokens < 1 ||
      (scored && (x.q == nullptr || x.k == nullptr))) {
    return absl::InvalidArgumentError(
        absl::StrCat("eviction scoring needs q_heads a multiple of kv_heads, head_dim >= 1, "
                     "tokens >= 1 and the queries and keys it scores; got q_heads/kv_heads/"
                     "head_dim/tokens ",
                     x.q_heads, "/", x.kv_heads, "/", x.d, "/", x.tokens,
                     x.q == nullptr ? ", no queries" : "", x.k == nullptr ? ", no keys" : ""));
  }
  return absl::OkStatus();
}

// Softmax of query row i of q head hq over keys [0, i], added (times `weight`)
// into acc[0..limit).
void AddAttention(const LayerQK& x, int hq, int64_t i, int64_t limit, double weight,
                  std::vector<double>* acc, std::vector<double>* s, const float* q = nullptr) {
  const int rep = x.q_heads / x.kv_heads;
  const int64_t hs = x.head_stride > 0 ? x.head_stride : x.tokens * x.d;
  const int64_t qs = x.q_head_stride > 0 ? x.q_head_stride : hs;
  if (q == nullptr) q = x.q + static_cast<int64_t>(hq) * qs + (i - x.q_first) * x.d;
  const float* k = x.k + static_cast<int64_t>(hq / rep) * hs;
  const double scale = 1.0 / std::sqrt(static_cast<double>(x.d));
  s->resize(static_cast<size_t>(i + 1));
  double m = -1e300;
  for (int64_t j = 0; j <= i; ++j) {
    float dot = 0;
    for (int c = 0; c < x.d; ++c) dot += q[c] * k[j * x.d + c];
    (*s)[j] = dot * scale;
    m = std::max(m, (*s)[j]);
  }
  double z = 0;
  for (int64_t j = 0; j <= i; ++j) z += ((*s)[j] = std::exp((*s)[j] - m));
  const int64_t e = std::min(limit, i + 1);
  for (int64_t j = 0; j < e; ++j) (*acc)[j] += weight * (*s)[j] / z;
}

std::vector<float> Reduce(const std::vector<std::vector<double>>& per_q, int kv_heads, int64_t n,
                          GqaReduce gqa) {
  const int rep = static_cast<int>(per_q.size()) / kv_heads;
  std::vector<float> out(static_cast<size_t>(kv_heads) * n);
  for (int h = 0; h < kv_heads; ++h) {
    for (int64_t j = 0; j < n; ++j) {
      double v = gqa == GqaReduce::kMax ? -1e300 : 0.0;
      for (int r = 0; r < rep; ++r) {
        const double x = per_q[h * rep + r][j];
        v = gqa == GqaReduce::kMax ? std::max(v, x) : v + x / rep;
      }
      out[h * n + j] = static_cast<float>(v);
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<float>> ObservationScores(const ScoreOptions& o, const LayerQK& x) {
  if (auto s = CheckShape(x); !s.ok()) return s;
  if (o.window < 1) return absl::InvalidArgumentError("observation window must be >= 1");
  if (o.kernel < 1 || o.kernel % 2 == 0) {
    return absl::InvalidArgumentError("pooling kernel must be odd and >= 1");
  }
  const int64_t w = std::min<int64_t>(o.window, x.tokens);
  const int64_t n = x.tokens - w;
  if (n == 0) return std::vector<float>();
  if (x.future_q == nullptr && (x.q_first < 0 || x.q_first > n)) {
    return absl::InvalidArgumentError(absl::StrCat("observation window of ", w,
                                                   " queries, but q holds rows from ", x.q_first,
                                                   " of ", x.tokens));
  }
  std::vector<std::vector<double>> per_q(x.q_heads, std::vector<double>(n, 0.0));
  std::vector<double> s;
  for (int hq = 0; hq < x.q_heads; ++hq) {
    if (x.future_q != nullptr) {
      for (int64_t i = 0; i < x.future_queries; ++i) {
        AddAttention(x, hq, x.tokens - 1, n, 1.0 / x.future_queries, &per_q[hq], &s,
                     x.future_q + (hq * x.future_queries + i) * x.d);
      }
      continue;
    }
    for (int64_t i = n; i < x.tokens; ++i) AddAttention(x, hq, i, n, 1.0 / w, &per_q[hq], &s);
  }
  std::vector<float> raw = Reduce(per_q, x.kv_heads, n, o.gqa);
  if (o.pooling == Pooling::kNone || o.kernel == 1) return raw;
  std::vector<float> pooled(raw.size());
  const int half = o.kernel / 2;
  for (int h = 0; h < x.kv_heads; ++h) {
    const float* r = raw.data() + h * n;
    for (int64_t j = 0; j < n; ++j) {
      double acc = o.pooling == Pooling::kMax ? -1e300 : 0.0;
      for (int64_t t = j - half; t <= j + half; ++t) {
        if (t < 0 || t >= n) continue;  // Max pads with -inf, avg with zeros (counted).
        acc = o.pooling == Pooling::kMax ? std::max(acc, static_cast<double>(r[t])) : acc + r[t];
      }
      pooled[h * n + j] = static_cast<float>(o.pooling == Pooling::kMax ? acc : acc / o.kernel);
    }
  }
  return pooled;
}

absl::StatusOr<std::vector<float>> H2oScores(const LayerQK& x, GqaReduce gqa) {
  if (auto s = CheckShape(x); !s.ok()) return s;
  if (x.q_first != 0) {
    return absl::InvalidArgumentError("H2O scores every query, but q holds only the last rows");
  }
  std::vector<std::vector<double>> per_q(x.q_heads, std::vector<double>(x.tokens, 0.0));
  std::vector<double> s;
  for (int hq = 0; hq < x.q_heads; ++hq) {
    for (int64_t i = 0; i < x.tokens; ++i) AddAttention(x, hq, i, x.tokens, 1.0, &per_q[hq], &s);
  }
  return Reduce(per_q, x.kv_heads, x.tokens, gqa);
}

int DefaultWindow(int64_t budget) {
  return static_cast<int>(std::clamp<int64_t>(budget / 4, 1, 32));
}

int64_t QueriesRead(const Policy& p) {
  switch (p.method) {
    case Method::kNone:
    case Method::kStreaming:
      return 0;
    case Method::kH2o:
      return -1;
    default:
      return p.score.window;
  }
}

absl::Status ValidateBudget(int64_t budget, int window) {
  if (budget < 1)
    return absl::InvalidArgumentError(absl::StrCat("budget must be >= 1, got ", budget));
  if (window < 0) return absl::InvalidArgumentError("window must be >= 0");
  if (window >= budget) {
    return absl::InvalidArgumentError(
        absl::StrCat("window (", window, ") must be smaller than the budget (", budget, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> AdaKvBudgets(const std::vector<float>& scores, int heads,
                                                  int64_t n, int64_t b_prime, double alpha) {
  if (heads < 1 || n < 0 || b_prime < 0) return absl::InvalidArgumentError("bad Ada-KV shape");
  if (!(alpha >= 0.0 && alpha <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("Ada-KV alpha must be in [0, 1], got ", alpha));
  }
  if (static_cast<int64_t>(scores.size()) != heads * n) {
    return absl::InvalidArgumentError("Ada-KV scores must be [heads, n]");
  }
  std::vector<int64_t> b(heads, std::min(b_prime, n));
  if (b_prime >= n) return b;
  const int64_t total = heads * b_prime;
  std::vector<int64_t> order(scores.size());
  std::iota(order.begin(), order.end(), 0);
  std::nth_element(order.begin(), order.begin() + total, order.end(), [&](int64_t a, int64_t c) {
    return scores[a] > scores[c] || (scores[a] == scores[c] && a < c);
  });
  std::vector<int64_t> count(heads, 0);
  for (int64_t i = 0; i < total; ++i) ++count[order[i] / n];
  std::vector<double> target(heads);
  int64_t sum = 0;
  for (int h = 0; h < heads; ++h) {
    target[h] = (1.0 - alpha) * count[h] + alpha * b_prime;
    b[h] = std::min<int64_t>(n, std::llround(target[h]));
    sum += b[h];
  }
  // Repair rounding so the layer keeps exactly heads * b_prime tokens.
  while (sum != total) {
    int best = -1;
    double gap = 0;
    for (int h = 0; h < heads; ++h) {
      const double g = sum > total ? b[h] - target[h] : target[h] - b[h];
      const bool can = sum > total ? b[h] > 0 : b[h] < n;
      if (can && (best < 0 || g > gap)) {
        best = h;
        gap = g;
      }
    }
    if (best < 0) break;
    b[best] += sum > total ? -1 : 1;
    sum += sum > total ? -1 : 1;
  }
  return b;
}

absl::StatusOr<std::vector<int64_t>> PyramidBudgets(int64_t budget, int window, double beta,
                                                    int layers, int64_t tokens) {
  if (auto s = ValidateBudget(budget, window); !s.ok()) return s;
  if (layers < 1 || !(beta > 0))
    return absl::InvalidArgumentError("PyramidKV needs layers >= 1, beta > 0");
  const int64_t n = std::max<int64_t>(0, tokens - window);
  const int64_t bp = budget - window;
  int64_t mn = static_cast<int64_t>(std::floor(bp / beta));
  int64_t mx = 2 * bp - mn;
  if (mx >= n) {
    mx = n;
    mn = 2 * bp - mx;
  }
  if (layers == 1) return std::vector<int64_t>{std::min(bp, n)};  // No pyramid over one layer.
  const int64_t step = (mx - mn) / (layers - 1);
  std::vector<int64_t> out(layers);
  for (int l = 0; l < layers; ++l) out[l] = std::clamp<int64_t>(mx - l * step, 0, n);
  return out;
}

std::vector<int64_t> SelectTopK(const float* scores, int64_t n, int64_t keep, int window) {
  std::vector<int64_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  if (keep < n) {
    keep = std::max<int64_t>(keep, 0);
    std::nth_element(idx.begin(), idx.begin() + keep, idx.end(), [&](int64_t a, int64_t b) {
      return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
    });
    idx.resize(static_cast<size_t>(keep));
    std::sort(idx.begin(), idx.end());
  }
  for (int64_t t = n; t < n + window; ++t) idx.push_back(t);
  return idx;
}

std::vector<int64_t> StreamingSelect(int64_t tokens, int sinks, int64_t recent) {
  std::vector<int64_t> idx;
  for (int64_t t = 0; t < tokens; ++t) {
    if (t < sinks || t >= tokens - recent) idx.push_back(t);
  }
  return idx;
}

absl::StatusOr<EvictionError> EvictionLoss(int q_heads, int kv_heads, int d, int64_t tokens,
                                           const float* q, const float* k, const float* v,
                                           const std::vector<std::vector<int64_t>>& keep) {
  KVT_ASSIGN_OR_RETURN(FlatKvCache c, FlatKvCache::Gather(kv_heads, d, tokens, k, v, keep));
  std::vector<float> full(static_cast<size_t>(q_heads) * d), kept(full.size());
  const KvBlock b{EncodedView::Raw(DType::kFp32, k, kv_heads, tokens, d, tokens * d, d),
                  EncodedView::Raw(DType::kFp32, v, kv_heads, tokens, d, tokens * d, d)};
  KVT_RETURN_IF_ERROR(DecodeAttention({q_heads, kv_heads, d}, q, {&b, 1}, full.data()));
  KVT_RETURN_IF_ERROR(c.Attend(q_heads, q, kept.data()));
  EvictionError e;
  double num = 0, den = 0;
  for (size_t i = 0; i < full.size(); ++i) {
    const double diff = static_cast<double>(full[i]) - kept[i];
    e.l1 += std::fabs(diff);
    num += diff * diff;
    den += static_cast<double>(full[i]) * full[i];
  }
  e.rel = den > 0 ? std::sqrt(num / den) : 0.0;
  return e;
}

}  // namespace kvtier::evict

namespace kvtier::evict {

absl::StatusOr<Policy> ParsePolicy(const std::string& text) {
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  Policy p;
  const std::string& name = parts[0];
  static const std::pair<const char*, Method> kNames[] = {{"none", Method::kNone},
                                                          {"streaming", Method::kStreaming},
                                                          {"streamingllm", Method::kStreaming},
                                                          {"h2o", Method::kH2o},
                                                          {"snapkv", Method::kSnapKv},
                                                          {"pyramidkv", Method::kPyramidKv},
                                                          {"ada-snapkv", Method::kAdaSnapKv},
                                                          {"ada-pyramid", Method::kAdaPyramid},
                                                          {"ada-pyramidkv", Method::kAdaPyramid},
                                                          {"profile", Method::kProfile}};
  bool found = false;
  for (const auto& [n, m] : kNames) {
    if (name == n) {
      p.method = m;
      found = true;
    }
  }
  if (!found) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown eviction method '", name,
        "' (none, streaming, h2o, snapkv, pyramidkv, ada-snapkv, ada-pyramid, profile)"));
  }
  if (p.method == Method::kNone) return p;
  if (parts.size() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("eviction policy '", text, "' needs a budget, e.g. ", name, ":64"));
  }
  if (p.method == Method::kProfile) {
    KVT_ASSIGN_OR_RETURN(Policy prof, LoadLayerProfile(parts[1]));
    p.layer_budgets = prof.layer_budgets;
    p.profile_name = prof.profile_name;
    p.budget = *std::max_element(p.layer_budgets.begin(), p.layer_budgets.end());
  } else if (!absl::SimpleAtoi(parts[1], &p.budget)) {
    return absl::InvalidArgumentError(absl::StrCat("budget '", parts[1], "' is not an integer"));
  }
  bool window_given = false;
  for (size_t i = 2; i < parts.size(); ++i) {
    std::pair<std::string, std::string> kv = absl::StrSplit(parts[i], absl::MaxSplits('=', 1));
    double dv = 0;
    int iv = 0;
    if (kv.first == "w" && absl::SimpleAtoi(kv.second, &iv)) {
      p.score.window = iv;
      window_given = true;
    } else if (kv.first == "k" && absl::SimpleAtoi(kv.second, &iv)) {
      p.score.kernel = iv;
    } else if (kv.first == "pool" &&
               (kv.second == "max" || kv.second == "avg" || kv.second == "none")) {
      p.score.pooling = kv.second == "max"   ? Pooling::kMax
                        : kv.second == "avg" ? Pooling::kAvg
                                             : Pooling::kNone;
    } else if (kv.first == "gqa" && (kv.second == "mean" || kv.second == "max")) {
      p.score.gqa = kv.second == "max" ? GqaReduce::kMax : GqaReduce::kMean;
    } else if (kv.first == "alpha" && absl::SimpleAtod(kv.second, &dv)) {
      p.alpha = dv;
    } else if (kv.first == "beta" && absl::SimpleAtod(kv.second, &dv)) {
      p.beta = dv;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("bad eviction option '", parts[i], "' in '", text, "'"));
    }
  }
  if (!(p.alpha >= 0 && p.alpha <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("alpha must be in [0, 1], got ", p.alpha));
  }
  if (!(p.beta > 0)) return absl::InvalidArgumentError("beta must be > 0");
  const bool windowed = p.method != Method::kStreaming && p.method != Method::kH2o;
  const int64_t smallest = p.method == Method::kProfile
                               ? *std::min_element(p.layer_budgets.begin(), p.layer_budgets.end())
                               : p.budget;
  if (windowed && !window_given) p.score.window = DefaultWindow(smallest);
  if (p.method == Method::kProfile) {
    for (int64_t b : p.layer_budgets) KVT_RETURN_IF_ERROR(ValidateBudget(b, p.score.window));
  } else {
    absl::Status valid = ValidateBudget(p.budget, windowed ? p.score.window : 0);
    if (!valid.ok() && windowed && p.budget > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(valid.message(), ": pass a smaller observation window, e.g. '", name, ":",
                       p.budget, ":w=", DefaultWindow(p.budget), "'"));
    }
    KVT_RETURN_IF_ERROR(valid);
  }
  if (p.method == Method::kStreaming && p.budget <= p.sinks) {
    return absl::InvalidArgumentError(
        absl::StrCat("streaming budget must exceed its ", p.sinks, " sinks"));
  }
  return p;
}

std::string PolicyName(const Policy& p) {
  switch (p.method) {
    case Method::kNone:
      return "none";
    case Method::kStreaming:
      return absl::StrCat("streaming:", p.budget);
    case Method::kH2o:
      return absl::StrCat("h2o:", p.budget);
    case Method::kSnapKv:
      return absl::StrCat("snapkv:", p.budget);
    case Method::kPyramidKv:
      return absl::StrCat("pyramidkv:", p.budget);
    case Method::kAdaSnapKv:
      return absl::StrCat("ada-snapkv:", p.budget);
    case Method::kAdaPyramid:
      return absl::StrCat("ada-pyramid:", p.budget);
    case Method::kProfile:
      return absl::StrCat("profile:", p.profile_name);
  }
  return "?";
}

absl::StatusOr<std::vector<std::vector<int64_t>>> SelectTokens(const Policy& p, int layer,
                                                               int layers, const LayerQK& x) {
  KVT_RETURN_IF_ERROR(CheckShape(x, p.method != Method::kNone && p.method != Method::kStreaming));
  const int heads = x.kv_heads;
  std::vector<std::vector<int64_t>> keep(heads);
  const int64_t layer_budget =
      p.method == Method::kProfile ? p.layer_budgets.at(static_cast<size_t>(layer)) : p.budget;
  if (p.method == Method::kNone || layer_budget >= x.tokens) {
    for (auto& k : keep) k = StreamingSelect(x.tokens, 0, x.tokens);
    return keep;
  }
  if (p.method == Method::kStreaming) {
    for (auto& k : keep) k = StreamingSelect(x.tokens, p.sinks, layer_budget - p.sinks);
    return keep;
  }
  if (p.method == Method::kH2o) {
    KVT_ASSIGN_OR_RETURN(std::vector<float> s, H2oScores(x, p.score.gqa));
    const int64_t recent = layer_budget / 2, heavy = layer_budget - recent;
    const int64_t n = x.tokens - recent;
    for (int h = 0; h < heads; ++h)
      keep[h] = SelectTopK(s.data() + h * x.tokens, n, heavy, static_cast<int>(recent));
    return keep;
  }
  KVT_ASSIGN_OR_RETURN(std::vector<float> s, ObservationScores(p.score, x));
  const int w = static_cast<int>(std::min<int64_t>(p.score.window, x.tokens));
  const int64_t n = x.tokens - w;
  int64_t bp = layer_budget - w;
  if (p.method == Method::kPyramidKv || p.method == Method::kAdaPyramid) {
    KVT_ASSIGN_OR_RETURN(std::vector<int64_t> pb,
                         PyramidBudgets(p.budget, w, p.beta, layers, x.tokens));
    bp = pb[layer];
  }
  std::vector<int64_t> per_head(heads, bp);
  if (p.method == Method::kAdaSnapKv || p.method == Method::kAdaPyramid) {
    KVT_ASSIGN_OR_RETURN(per_head, AdaKvBudgets(s, heads, n, bp, p.alpha));
  }
  for (int h = 0; h < heads; ++h) keep[h] = SelectTopK(s.data() + h * n, n, per_head[h], w);
  return keep;
}

absl::StatusOr<Policy> LoadLayerProfile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open layer profile ", path));
  Policy p;
  p.method = Method::kProfile;
  std::string line;
  bool header = false;
  while (std::getline(in, line)) {
    line = line.substr(0, line.find('#'));
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (f.empty()) continue;
    if (f[0] == "kvtier-layer-profile") {
      if (f.size() != 2 || f[1] != "1")
        return absl::InvalidArgumentError(absl::StrCat(path, ": unsupported profile version"));
      header = true;
    } else if (f[0] == "name" && f.size() == 2) {
      p.profile_name = f[1];
    } else if (f[0] == "budgets") {
      for (size_t i = 1; i < f.size(); ++i) {
        int64_t b;
        if (!absl::SimpleAtoi(f[i], &b) || b < 1) {
          return absl::InvalidArgumentError(absl::StrCat(path, ": bad budget '", f[i], "'"));
        }
        p.layer_budgets.push_back(b);
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat(path, ": unexpected line '", line, "'"));
    }
  }
  if (!header || p.layer_budgets.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a kvtier layer profile (header and budgets required)"));
  }
  if (p.profile_name.empty()) p.profile_name = path;
  p.budget = *std::max_element(p.layer_budgets.begin(), p.layer_budgets.end());
  return p;
}

absl::Status SaveLayerProfile(const std::string& path, const std::string& name,
                              const std::vector<int64_t>& budgets) {
  std::ofstream out(path, std::ios::trunc);
  out << "kvtier-layer-profile 1\nname " << name << "\nbudgets";
  for (int64_t b : budgets) out << " " << b;
  out << "\n";
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace kvtier::evict
