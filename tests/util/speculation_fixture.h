// The speculation tests' fixture: a worker engine with the reference
// kernels over a real kvtier-store process, a small fp16 model, skews of a
// chosen ratio, and a longhand history that computes what speculation must
// pick and attend.
#ifndef KVTIER_TESTS_UTIL_SPECULATION_FIXTURE_H_
#define KVTIER_TESTS_UTIL_SPECULATION_FIXTURE_H_

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/half.h"
#include "kernels/speculation.h"
#include "tests/util/status_matchers.h"
#include "tests/util/worker_stack.h"
#include "worker/engine.h"

namespace kvtier::speculation_test {

using worker::Engine;
using worker::ModelShape;
using worker::SessionPolicy;

inline constexpr ModelShape kShape{4, 4, 2, 16, DType::kFp16};

inline std::vector<float> Random(size_t n, std::mt19937* rng) {
  std::normal_distribution<float> nd;
  std::vector<float> x(n);
  // fp16-exact values: the open round holds them exactly.
  for (float& v : x) v = HalfToFloat(FloatToHalf(nd(*rng)));
  return x;
}

// A skew calibrated on random queries and keys of kShape, `ratio` of the
// columns kept.
inline spec::SkewModel MakeSkew(double ratio, int layers = kShape.layers, uint32_t seed = 7) {
  std::mt19937 rng(seed);
  spec::SkewModel m;
  m.model = "test";
  m.layers = layers;
  m.q_heads = kShape.q_heads;
  m.kv_heads = kShape.kv_heads;
  m.head_dim = kShape.head_dim;
  m.partial_ratio = ratio;
  m.calibration_tokens = 64;
  for (int l = 0; l < layers; ++l) {
    const auto q = Random(64 * kShape.q_heads * kShape.head_dim, &rng);
    const auto k = Random(64 * kShape.kv_heads * kShape.head_dim, &rng);
    auto heads = spec::CalibrateLayer(q.data(), k.data(), 64, kShape.q_heads, kShape.kv_heads,
                                      kShape.head_dim, ratio);
    EXPECT_TRUE(heads.ok()) << heads.status();
    m.heads.push_back(*heads);
  }
  return m;
}

// Every token's K and V per layer, token-major fp32, in the order the
// engine saw them; and which round each token belongs to.
struct History {
  std::vector<std::vector<float>> k, v;  // [layer] [T, kv_heads, d]
  int64_t tokens(int layer) const {
    return static_cast<int64_t>(k[layer].size()) / (kShape.kv_heads * kShape.head_dim);
  }
};

// Longhand: the union per KV head of the tokens speculation keeps among
// `cand` (per KV head, history indices in order), for approximate query qn
// [q_heads, d].
inline std::vector<std::vector<int64_t>> LonghandOver(const spec::SkewModel& skew, int layer,
                                                      const History& h,
                                                      const std::vector<std::vector<int64_t>>& cand,
                                                      const float* qn, float alpha, int budget) {
  const int d = kShape.head_dim, hq = kShape.q_heads, hkv = kShape.kv_heads, g = hq / hkv;
  std::vector<std::vector<double>> scores(hq);
  std::vector<int> counts(hq, 0);
  int64_t most = 0;
  for (int qh = 0; qh < hq; ++qh) {
    const spec::SkewHead& sh = skew.heads[layer][qh / g];
    const std::vector<int64_t>& c = cand[qh / g];
    most = std::max<int64_t>(most, static_cast<int64_t>(c.size()));
    std::vector<float> qa(d), ka(d);
    spec::Skew(sh, d, qn + qh * d, qa.data());
    double best = -INFINITY;
    for (int64_t t : c) {
      spec::Skew(sh, d, &h.k[layer][(t * hkv + qh / g) * d], ka.data());
      double acc = 0;
      // The worker holds partial keys in fp16.
      for (int32_t col : sh.partial)
        acc += static_cast<double>(qa[col]) * HalfToFloat(FloatToHalf(ka[col]));
      scores[qh].push_back(acc / std::sqrt(static_cast<double>(d)));
      best = std::max(best, scores[qh].back());
    }
    for (double x : scores[qh]) counts[qh] += x >= best - alpha;
  }
  int64_t n = std::llround(std::accumulate(counts.begin(), counts.end(), 0.0) / hq);
  if (budget > 0) n = std::min<int64_t>(n, budget);
  n = std::clamp<int64_t>(n, 1, std::max<int64_t>(1, most));
  std::vector<std::vector<int64_t>> out(hkv);
  for (int qh = 0; qh < hq; ++qh) {
    const std::vector<int64_t>& c = cand[qh / g];
    std::vector<int64_t> idx(c.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(),
                     [&](int64_t a, int64_t b) { return scores[qh][a] > scores[qh][b]; });
    const int64_t take = std::min<int64_t>(n, static_cast<int64_t>(c.size()));
    for (int64_t i = 0; i < take; ++i) out[qh / g].push_back(c[idx[i]]);
  }
  for (auto& u : out) {
    std::sort(u.begin(), u.end());
    u.erase(std::unique(u.begin(), u.end()), u.end());
  }
  return out;
}

// The same over the first `past` tokens, at every KV head.
inline std::vector<std::vector<int64_t>> Longhand(const spec::SkewModel& skew, int layer,
                                                  const History& h, int64_t past, const float* qn,
                                                  float alpha, int budget) {
  std::vector<int64_t> all(past);
  std::iota(all.begin(), all.end(), 0);
  return LonghandOver(skew, layer, h, std::vector<std::vector<int64_t>>(kShape.kv_heads, all), qn,
                      alpha, budget);
}

// Attention of q [q_heads, d] over `keep` (per KV head, indices into the
// history) plus tokens [from, to) of the history, in double.
inline std::vector<float> Attend(const History& h, int layer, const float* q,
                                 const std::vector<std::vector<int64_t>>& keep, int64_t from,
                                 int64_t to) {
  const int d = kShape.head_dim, hq = kShape.q_heads, hkv = kShape.kv_heads, g = hq / hkv;
  std::vector<float> out(static_cast<size_t>(hq) * d);
  for (int qh = 0; qh < hq; ++qh) {
    const int kh = qh / g;
    std::vector<int64_t> toks = keep[kh];
    for (int64_t t = from; t < to; ++t) toks.push_back(t);
    std::vector<double> w(toks.size());
    double best = -INFINITY;
    for (size_t j = 0; j < toks.size(); ++j) {
      double acc = 0;
      for (int i = 0; i < d; ++i)
        acc += double(q[qh * d + i]) * h.k[layer][(toks[j] * hkv + kh) * d + i];
      w[j] = acc / std::sqrt(static_cast<double>(d));
      best = std::max(best, w[j]);
    }
    double z = 0;
    for (double& x : w) z += (x = std::exp(x - best));
    for (int i = 0; i < d; ++i) {
      double acc = 0;
      for (size_t j = 0; j < toks.size(); ++j) {
        acc += w[j] / z * h.v[layer][(toks[j] * hkv + kh) * d + i];
      }
      out[qh * d + i] = static_cast<float>(acc);
    }
  }
  return out;
}

// Layer l of a decode step: draws q, k, v and the next layer's approximate
// query, appends k and v to the history and runs DecodeLayer (with q_next on
// every layer but the last).
struct DecodedLayer {
  std::vector<float> q, out, next;
  absl::Status status;
};
inline DecodedLayer DecodeOne(Engine* engine, const worker::SessionKey& id, int l, History* h,
                              std::mt19937* rng) {
  const int d = kShape.head_dim, hq = kShape.q_heads, hkv = kShape.kv_heads;
  DecodedLayer r;
  r.q = Random(hq * d, rng);
  const auto k = Random(hkv * d, rng), v = Random(hkv * d, rng);
  r.next = Random(hq * d, rng);
  r.out.resize(r.q.size());
  h->k[l].insert(h->k[l].end(), k.begin(), k.end());
  h->v[l].insert(h->v[l].end(), v.begin(), v.end());
  r.status = engine->DecodeLayer(id, l, r.q.data(), k.data(), v.data(), r.out.data(),
                                 l + 1 < kShape.layers ? r.next.data() : nullptr);
  return r;
}

class WorkerSpeculationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVT_ASSERT_OK(stack_.Start());
    worker::EngineOptions o;
    o.level = KernelLevel::kReference;
    o.placement = worker::EngineOptions::Placement::kHost;
    engine_ = std::make_unique<Engine>(stack_.segments(), o);
  }

  // A policy that keeps every past round visible at every layer (recall all,
  // raw fp32), so the longhand history is exactly what attention sees.
  SessionPolicy Policy(const std::string& skew, float alpha, int budget = 0) {
    SessionPolicy p;
    p.recall.mode = RecallMode::kAll;
    p.release_after_end_round = false;
    p.speculation.skew = skew;
    p.speculation.alpha = alpha;
    p.speculation.budget = budget;
    return p;
  }

  testing::StoreStack stack_;
  std::unique_ptr<Engine> engine_;
};

}  // namespace kvtier::speculation_test

#endif  // KVTIER_TESTS_UTIL_SPECULATION_FIXTURE_H_
