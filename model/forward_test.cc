#include "model/forward.h"

#include <cmath>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/test_util.h"
#include "tests/util/status_matchers.h"

namespace kvtier::model {
namespace {

using ::kvtier::testing::StatusIs;
using ::testing::HasSubstr;

// Attention written out longhand in float64, independent of kernels/.
class NaiveAttention : public AttentionBackend {
 public:
  explicit NaiveAttention(const ModelConfig& c) : c_(c), k_(c.n_layers), v_(c.n_layers) {}
  absl::Status Attend(int layer, int pos, const float* q, const float* k, const float* v,
                      float* out) override {
    const int kv = c_.kv_dim(), hd = c_.head_dim(), rep = c_.n_heads / c_.n_kv_heads;
    k_[layer].insert(k_[layer].end(), k, k + kv);
    v_[layer].insert(v_[layer].end(), v, v + kv);
    for (int h = 0; h < c_.n_heads; ++h) {
      const int g = h / rep;
      std::vector<double> s(pos + 1);
      double m = -1e300;
      for (int t = 0; t <= pos; ++t) {
        double dot = 0;
        for (int i = 0; i < hd; ++i) dot += q[h * hd + i] * k_[layer][t * kv + g * hd + i];
        s[t] = dot / std::sqrt(static_cast<double>(hd));
        m = std::max(m, s[t]);
      }
      double sum = 0;
      for (double& x : s) sum += (x = std::exp(x - m));
      for (int i = 0; i < hd; ++i) {
        double acc = 0;
        for (int t = 0; t <= pos; ++t) acc += s[t] / sum * v_[layer][t * kv + g * hd + i];
        out[h * hd + i] = static_cast<float>(acc);
      }
    }
    return absl::OkStatus();
  }

 private:
  ModelConfig c_;
  std::vector<std::vector<float>> k_, v_;
};

TEST(LlamaLoadTest, ClearErrors) {
  EXPECT_THAT(Model::Load("/nonexistent/model.bin"), StatusIs(absl::StatusCode::kNotFound));
  kvtier::testing::TempDir dir;
  const std::string bad = dir.path() + "/bad.bin";
  {
    std::ofstream f(bad, std::ios::binary);
    const int32_t h[7] = {64, 172, 5, 8, 3, 512, 512};  // 8 heads do not split into 3 groups.
    f.write(reinterpret_cast<const char*>(h), sizeof(h));
  }
  EXPECT_THAT(Model::Load(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("header")));
  {
    std::ofstream f(bad, std::ios::binary);
    const int32_t h[7] = {64, 172, 5, 8, 4, 512, 512};
    f.write(reinterpret_cast<const char*>(h), sizeof(h));
    const float zero[100] = {};
    f.write(reinterpret_cast<const char*>(zero), sizeof(zero));
  }
  EXPECT_THAT(Model::Load(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bytes")));
}

TEST(LlamaTest, Stories260KForwardMatchesNaiveAttentionAndPredictsWell) {
  KVT_REQUIRE_SHARED_MODEL(path);
  KVT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> m, Model::Load(path));
  const ModelConfig& c = m->config();
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.seq_len, 512);
  KVT_ASSERT_OK_AND_ASSIGN(std::vector<int> tokens, SampleTokens(*m, 160, 7));
  ASSERT_EQ(tokens.size(), 160u);
  EXPECT_EQ(tokens[0], 1);
  FullCacheAttention vec(c), ref(c, KernelLevel::kReference);
  NaiveAttention naive(c);
  Forward fv(*m), fr(*m), fn(*m);
  std::vector<float> lv(c.vocab_size), lr(c.vocab_size), ln(c.vocab_size);
  double nll = 0;
  for (int pos = 0; pos + 1 < static_cast<int>(tokens.size()); ++pos) {
    ASSERT_TRUE(fv.Step(tokens[pos], pos, &vec, lv.data()).ok());
    ASSERT_TRUE(fr.Step(tokens[pos], pos, &ref, lr.data()).ok());
    ASSERT_TRUE(fn.Step(tokens[pos], pos, &naive, ln.data()).ok());
    for (int i = 0; i < c.vocab_size; ++i) {
      ASSERT_TRUE(std::isfinite(lv[i]));
      ASSERT_NEAR(lv[i], ln[i], 2e-3 * (1 + std::fabs(ln[i]))) << "pos " << pos;
      ASSERT_NEAR(lr[i], ln[i], 1e-4 * (1 + std::fabs(ln[i]))) << "pos " << pos;
    }
    nll -= std::log(Softmax(ln.data(), c.vocab_size)[tokens[pos + 1]]);
  }
  // A trained model is far more certain than uniform (ln 512 = 6.24 nats);
  // on its own temperature-1 samples this one averages about 3.7.
  EXPECT_LT(nll / (tokens.size() - 1), 4.5);
  EXPECT_THAT(fv.Step(600, 159, &vec, lv.data()), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(fv.Step(1, 512, &vec, lv.data()), StatusIs(absl::StatusCode::kOutOfRange));
}

}  // namespace
}  // namespace kvtier::model

namespace kvtier::model {
namespace {

// The layer-major Run() over chunks of tokens gives bit-identical logits to
// Step() token by token (same arithmetic per token).
TEST(LlamaTest, RunLayerByLayerEqualsStep) {
  KVT_REQUIRE_SHARED_MODEL(path);
  KVT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> m, Model::Load(path));
  const ModelConfig& c = m->config();
  KVT_ASSERT_OK_AND_ASSIGN(std::vector<int> tokens, SampleTokens(*m, 40, 7));
  FullCacheAttention a(c), b(c);
  PerTokenLayerAttention layered(c, &b);
  Forward fa(*m), fb(*m);
  std::vector<float> la(c.vocab_size), lb(c.vocab_size);
  int pos = 0;
  for (int chunk : {7, 1, 1, 12, 1, 18}) {
    std::vector<int> part(tokens.begin() + pos, tokens.begin() + pos + chunk);
    for (int i = 0; i < chunk; ++i) {
      ASSERT_TRUE(fa.Step(part[i], pos + i, &a, la.data()).ok());
    }
    ASSERT_TRUE(fb.Run(part, pos, &layered, lb.data()).ok());
    for (int v = 0; v < c.vocab_size; ++v) ASSERT_EQ(la[v], lb[v]) << "pos " << pos;
    pos += chunk;
  }
  EXPECT_THAT(fb.Run({}, pos, &layered, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(fb.Run({1}, c.seq_len, &layered, nullptr), StatusIs(absl::StatusCode::kOutOfRange));
}

}  // namespace
}  // namespace kvtier::model
