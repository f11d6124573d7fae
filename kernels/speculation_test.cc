#include "kernels/speculation.h"

#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "gtest/gtest.h"

namespace kvtier::spec {
namespace {

TEST(SymmetricEigenTest, DecomposesARandomSymmetricMatrix) {
  const int n = 12;
  std::mt19937 rng(3);
  std::normal_distribution<double> g;
  std::vector<double> b(n * n), m(n * n, 0.0);
  for (double& x : b) x = g(rng);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      for (int k = 0; k < n; ++k) m[i * n + j] += b[k * n + i] * b[k * n + j];
    }
  }
  std::vector<double> values, vectors;
  SymmetricEigen(m, n, &values, &vectors);
  for (int j = 1; j < n; ++j) EXPECT_GE(values[j - 1], values[j]);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      double mv = 0, vtv = 0;
      for (int k = 0; k < n; ++k) {
        mv += m[i * n + k] * vectors[k * n + j];
        vtv += vectors[k * n + i] * vectors[k * n + j];
      }
      EXPECT_NEAR(mv, values[j] * vectors[i * n + j], 1e-9);  // M v_j = lambda_j v_j.
      EXPECT_NEAR(vtv, i == j ? 1.0 : 0.0, 1e-12);
    }
  }
}

// Queries whose energy lies in a few random directions (as real heads'
// do): the skew must keep q . k exactly and concentrate |q| in the partial
// columns far beyond what the same number of raw columns hold.
struct Calibration {
  int t = 256, hq = 4, hkv = 2, d = 16;
  std::vector<float> q, k;
  Calibration() {
    std::mt19937 rng(7);
    std::normal_distribution<float> g;
    std::vector<float> basis(d * d);
    for (float& x : basis) x = g(rng);
    q.resize(static_cast<size_t>(t) * hq * d);
    k.resize(static_cast<size_t>(t) * hkv * d);
    auto fill = [&](float* v) {
      // Weights 4, 2, 1, then 0.05 for the rest, on the random basis.
      for (int j = 0; j < d; ++j) v[j] = 0;
      for (int b = 0; b < d; ++b) {
        const float w = (b == 0 ? 4.0f : b == 1 ? 2.0f : b == 2 ? 1.0f : 0.05f) * g(rng);
        for (int j = 0; j < d; ++j) v[j] += w * basis[b * d + j];
      }
    };
    for (int i = 0; i < t * hq; ++i) fill(&q[i * d]);
    for (int i = 0; i < t * hkv; ++i) fill(&k[i * d]);
  }
};

TEST(CalibrateTest, SkewKeepsDotProductsAndConcentratesTheQuery) {
  Calibration c;
  auto layer = CalibrateLayer(c.q.data(), c.k.data(), c.t, c.hq, c.hkv, c.d, 0.2);
  ASSERT_TRUE(layer.ok()) << layer.status();
  ASSERT_EQ(layer->size(), 2u);
  const int r = PartialColumns(0.2, c.d);
  EXPECT_EQ(r, 3);
  std::vector<float> qs(c.d), ks(c.d);
  double raw_part = 0, skew_part = 0, total = 0;
  std::vector<double> raw_col(c.d, 0.0);  // Energy per unskewed column.
  for (int t = 0; t < 50; ++t) {
    for (int h = 0; h < c.hq; ++h) {
      const SkewHead& s = (*layer)[h / 2];
      ASSERT_EQ(s.partial.size(), static_cast<size_t>(r));
      const float* q = &c.q[(t * c.hq + h) * c.d];
      const float* k = &c.k[(t * c.hkv + h / 2) * c.d];
      Skew(s, c.d, q, qs.data());
      Skew(s, c.d, k, ks.data());
      double dot = 0, sdot = 0, norm = 0;
      for (int j = 0; j < c.d; ++j) {
        dot += q[j] * k[j];
        sdot += qs[j] * ks[j];
        norm += std::fabs(q[j] * k[j]);
      }
      EXPECT_NEAR(sdot, dot, 1e-5 * norm);
      std::vector<float> part(r);
      SkewPartial(s, c.d, q, part.data());
      for (int i = 0; i < r; ++i) {
        EXPECT_EQ(part[i], qs[s.partial[i]]);
        skew_part += part[i] * part[i];
      }
      for (int j = 0; j < c.d; ++j) {
        raw_col[j] += q[j] * q[j];
        total += q[j] * q[j];
      }
    }
  }
  std::sort(raw_col.begin(), raw_col.end(), std::greater<double>());
  for (int i = 0; i < r; ++i) raw_part += raw_col[i];
  EXPECT_GT(skew_part / total, 0.97);  // Three directions hold nearly all of it.
  // The best three raw columns hold much less (0.71 for this seed).
  EXPECT_LT(raw_part / total, skew_part / total - 0.2) << raw_part / total;
  EXPECT_FALSE(CalibrateLayer(c.q.data(), c.k.data(), c.t, 3, 2, c.d, 0.2).ok());
  EXPECT_FALSE(CalibrateLayer(c.q.data(), c.k.data(), c.t, 4, 2, c.d, 0).ok());
}

// Speculate against a longhand computation: full skewed vectors, the
// partial columns picked by hand, every score, the alpha count, the mean.
TEST(SpeculateTest, MatchesALonghandComputation) {
  Calibration c;
  auto layer = CalibrateLayer(c.q.data(), c.k.data(), c.t, c.hq, c.hkv, c.d, 0.25);
  ASSERT_TRUE(layer.ok());
  const int r = 4, T = 100;
  std::vector<std::vector<float>> pk(c.hkv, std::vector<float>(T * r));
  for (int h = 0; h < c.hkv; ++h) {
    for (int t = 0; t < T; ++t) {
      SkewPartial((*layer)[h], c.d, &c.k[(t * c.hkv + h) * c.d], &pk[h][t * r]);
    }
  }
  const float* qhat = &c.q[200 * c.hq * c.d];
  for (float alpha : {0.5f, 2.0f, 4.0f}) {
    for (int budget : {0, 5}) {
      SpeculationParams p;
      p.alpha = alpha;
      p.budget = budget;
      Speculated s = Speculate(*layer, qhat, {pk[0].data(), pk[1].data()}, T, c.hq, c.hkv, c.d, p);
      // Longhand.
      std::vector<std::vector<double>> score(c.hq, std::vector<double>(T));
      double mean = 0;
      for (int h = 0; h < c.hq; ++h) {
        const SkewHead& sh = (*layer)[h / 2];
        std::vector<float> qs(c.d), ks(c.d);
        Skew(sh, c.d, qhat + h * c.d, qs.data());
        double best = -1e300;
        for (int t = 0; t < T; ++t) {
          Skew(sh, c.d, &c.k[(t * c.hkv + h / 2) * c.d], ks.data());
          double acc = 0;
          for (int col : sh.partial) acc += static_cast<double>(qs[col]) * ks[col];
          score[h][t] = acc / std::sqrt(static_cast<double>(c.d));
          best = std::max(best, score[h][t]);
        }
        int count = 0;
        for (int t = 0; t < T; ++t) count += score[h][t] >= best - alpha + 1e-4;
        EXPECT_NEAR(s.counts[h], count, 1) << "alpha " << alpha << " head " << h;
        mean += s.counts[h];
      }
      mean /= c.hq;
      int n = static_cast<int>(std::llround(mean));
      if (budget > 0) n = std::min(n, budget);
      n = std::max(n, 1);
      ASSERT_EQ(s.n, n);
      for (int h = 0; h < c.hq; ++h) {
        ASSERT_EQ(s.tokens[h].size(), static_cast<size_t>(n));
        // Every chosen token scores at least as high as every other one.
        double lowest_in = 1e300, highest_out = -1e300;
        std::vector<bool> in(T, false);
        for (int32_t t : s.tokens[h]) in[t] = true;
        for (int t = 0; t < T; ++t) {
          (in[t] ? lowest_in : highest_out) =
              in[t] ? std::min(lowest_in, score[h][t]) : std::max(highest_out, score[h][t]);
        }
        EXPECT_GE(lowest_in + 1e-4, highest_out);
        EXPECT_TRUE(std::is_sorted(s.tokens[h].begin(), s.tokens[h].end()));
      }
    }
  }
}

// The scores speculation ranks by are the scalar loop's bits on every path
// (the AVX2 path sums 8 tokens at a time, one per lane), so that picks at
// the cut and counts at alpha agree with cuda::SpeculateSelect's.
TEST(SpeculateTest, PartialScoresAreTheScalarLoopsBits) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (int r : {1, 7, 26, 32}) {
    for (int64_t tokens : {int64_t{1}, int64_t{8}, int64_t{13}, int64_t{1001}}) {
      const int n_q = 3;
      std::vector<float> qp(static_cast<size_t>(n_q) * r), keys(static_cast<size_t>(tokens) * r);
      for (float& x : qp) x = nd(rng);
      for (float& x : keys) x = nd(rng);
      const float scale = 1.0f / std::sqrt(128.0f);
      std::vector<std::vector<float>> got(n_q, std::vector<float>(tokens));
      std::vector<float*> rows = {got[0].data(), got[1].data(), got[2].data()};
      PartialScores(qp.data(), n_q, keys.data(), tokens, r, scale, rows.data());
      for (int i = 0; i < n_q; ++i) {
        for (int64_t t = 0; t < tokens; ++t) {
          volatile float acc = 0;  // One rounding per product and per sum.
          for (int c = 0; c < r; ++c) {
            volatile float prod = qp[i * r + c] * keys[t * r + c];
            acc = acc + prod;
          }
          const float want = acc * scale;
          ASSERT_EQ(std::memcmp(&got[i][t], &want, sizeof(float)), 0)
              << "r " << r << " tokens " << tokens << " query " << i << " token " << t << ": "
              << got[i][t] << " against " << want;
        }
      }
    }
  }
}

// Partial keys made 4 rows at a time are SkewPartial's, bit for bit.
TEST(SpeculateTest, SkewPartialRowsIsSkewPartialPerRow) {
  Calibration c;
  for (double ratio : {0.25, 0.6, 1.0}) {
    auto layer = CalibrateLayer(c.q.data(), c.k.data(), c.t, c.hq, c.hkv, c.d, ratio);
    ASSERT_TRUE(layer.ok());
    const SkewHead& h = (*layer)[1];
    const int r = static_cast<int>(h.partial.size());
    for (int64_t n : {int64_t{1}, int64_t{4}, int64_t{7}, int64_t{150}}) {
      std::vector<float> got(static_cast<size_t>(n) * r), want(r);
      SkewPartialRows(h, c.d, c.k.data(), n, got.data());
      for (int64_t t = 0; t < n; ++t) {
        SkewPartial(h, c.d, c.k.data() + t * c.d, want.data());
        ASSERT_EQ(std::memcmp(got.data() + t * r, want.data(), sizeof(float) * r), 0)
            << "ratio " << ratio << " row " << t << " of " << n;
      }
    }
  }
}

TEST(SpeculateTest, ScoreOfTheTrueTopSetIsOne) {
  // One head, d = 2, keys along the query with rising weight.
  const int T = 6, d = 2;
  std::vector<float> keys = {0, 1, 1, 0, 2, 0, 3, 0, 0.5f, 0, -1, 0};
  const float q[2] = {1, 0};
  Speculated s;
  s.n = 2;
  s.tokens = {{2, 3}};  // The two largest q . k.
  HitRate h = Score(s, q, {keys.data()}, T, 1, 1, d);
  EXPECT_DOUBLE_EQ(h.hit, 1.0);
  double z = 0, top = 0;
  for (int t = 0; t < T; ++t) z += std::exp(keys[t * 2] / std::sqrt(2.0));
  top = (std::exp(2 / std::sqrt(2.0)) + std::exp(3 / std::sqrt(2.0))) / z;
  EXPECT_NEAR(h.mass, top, 1e-12);
  s.tokens = {{2, 5}};
  h = Score(s, q, {keys.data()}, T, 1, 1, d);
  EXPECT_NEAR(h.hit, std::exp(2 / std::sqrt(2.0)) / (top * z), 1e-12);
}

TEST(SkewFileTest, RoundTripAndDamage) {
  Calibration c;
  SkewModel m;
  m.model = "test-model";
  m.layers = 2;
  m.q_heads = c.hq;
  m.kv_heads = c.hkv;
  m.head_dim = c.d;
  m.partial_ratio = 0.2;
  m.calibration_tokens = c.t;
  for (int l = 0; l < 2; ++l) {
    m.heads.push_back(*CalibrateLayer(c.q.data(), c.k.data(), c.t, c.hq, c.hkv, c.d, 0.2));
  }
  const std::string bytes = SerializeSkew(m);
  auto back = ParseSkew(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->model, "test-model");
  EXPECT_EQ(back->calibration_tokens, c.t);
  for (int l = 0; l < 2; ++l) {
    for (int h = 0; h < c.hkv; ++h) {
      EXPECT_EQ(back->heads[l][h].a, m.heads[l][h].a);
      EXPECT_EQ(back->heads[l][h].partial, m.heads[l][h].partial);
    }
  }
  std::string bad = bytes;
  bad[bad.size() / 2] ^= 1;
  EXPECT_EQ(ParseSkew(bad).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(ParseSkew(bytes.substr(0, bytes.size() - 9)).status().code(),
            absl::StatusCode::kDataLoss);
  bad = bytes;
  bad[8] = 2;  // Version 2.
  EXPECT_EQ(ParseSkew(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseSkew("not a skew file at all").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadSkew("/nonexistent/x.skew").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvtier::spec
