#include "model/forward.h"

#include <cmath>
#include <fstream>
#include <functional>
#include <tuple>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/export.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
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
    // A sliding layer sees its window's positions only.
    const int w = c_.layer_window(layer), first = w > 0 && pos + 1 > w ? pos + 1 - w : 0;
    for (int h = 0; h < c_.n_heads; ++h) {
      const int g = h / rep;
      std::vector<double> s(pos + 1, 0.0);
      double m = -1e300;
      for (int t = first; t <= pos; ++t) {
        double dot = 0;
        for (int i = 0; i < hd; ++i) dot += q[h * hd + i] * k_[layer][t * kv + g * hd + i];
        s[t] = dot / std::sqrt(static_cast<double>(hd));
        m = std::max(m, s[t]);
      }
      double sum = 0;
      for (int t = first; t <= pos; ++t) sum += (s[t] = std::exp(s[t] - m));
      for (int i = 0; i < hd; ++i) {
        double acc = 0;
        for (int t = first; t <= pos; ++t) acc += s[t] / sum * v_[layer][t * kv + g * hd + i];
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
  EXPECT_THAT(Model::Load(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("header")));
  {
    std::ofstream f(bad, std::ios::binary);
    const int32_t h[7] = {64, 172, 5, 8, 4, 512, 512};
    f.write(reinterpret_cast<const char*>(h), sizeof(h));
    const float zero[100] = {};
    f.write(reinterpret_cast<const char*>(zero), sizeof(zero));
  }
  EXPECT_THAT(Model::Load(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bytes")));
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

namespace kvtier::model {
namespace {

// The logits of `tokens` fed one at a time on the full cache.
std::vector<std::vector<float>> Logits(const Model& m, const std::vector<int>& tokens) {
  FullCacheAttention cache(m.config());
  Forward f(m);
  std::vector<std::vector<float>> out;
  for (size_t p = 0; p < tokens.size(); ++p) {
    out.emplace_back(m.config().vocab_size);
    EXPECT_TRUE(f.Step(tokens[p], static_cast<int>(p), &cache, out.back().data()).ok());
  }
  return out;
}

// traces/stories260k.gguf is the llama2.c checkpoint written as a llama GGUF
// (`kvtier model export`): the same model through the GGUF path.
TEST(ModelLoadTest, StoriesGgufIsTheCheckpoint) {
  KVT_REQUIRE_SHARED_MODEL(path);
  KVT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> bin, Model::Load(path));
  KVT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> gguf,
                           Model::Load(testing::SourcePath("traces/stories260k.gguf")));
  const ModelConfig &a = bin->config(), &b = gguf->config();
  EXPECT_EQ(b.arch, Arch::kLlama);
  EXPECT_EQ(std::tie(a.dim, a.hidden_dim, a.n_layers, a.n_heads, a.n_kv_heads, a.vocab_size,
                     a.seq_len, a.shared_classifier),
            std::tie(b.dim, b.hidden_dim, b.n_layers, b.n_heads, b.n_kv_heads, b.vocab_size,
                     b.seq_len, b.shared_classifier));
  EXPECT_EQ(a.head_dim(), b.head_dim());
  EXPECT_FALSE(b.sliding());
  KVT_ASSERT_OK_AND_ASSIGN(std::vector<int> tokens, SampleTokens(*bin, 30, 3));
  EXPECT_EQ(Logits(*bin, tokens), Logits(*gguf, tokens));
}

// A gemma3-shaped model (stories260K's weights, QK-norm and post-norms of
// 1, windows of 16 on every other layer): the forward pass with the full
// cache matches float64 attention that honours the windows, and the windows
// change the logits once the sequence outgrows them.
TEST(ForwardTest, SlidingWindowsAsGemma3) {
  KVT_REQUIRE_SHARED_MODEL(path);
  KVT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> bin, Model::Load(path));
  testing::TempDir dir;
  ExportOptions o;
  o.arch = "gemma3";
  o.gemma3_window = 16;
  o.gemma3_global_every = 2;
  ASSERT_TRUE(ExportGguf(*bin, o, dir.path() + "/w16.gguf").ok());
  o.gemma3_window = 4096;  // Wider than any sequence here: windows never bite.
  ASSERT_TRUE(ExportGguf(*bin, o, dir.path() + "/wide.gguf").ok());
  KVT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> m, Model::Load(dir.path() + "/w16.gguf"));
  KVT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> wide, Model::Load(dir.path() + "/wide.gguf"));
  const ModelConfig& c = m->config();
  ASSERT_EQ(c.arch, Arch::kGemma3);
  EXPECT_EQ(c.window, (std::vector<int>{16, 0, 16, 0, 16}));
  EXPECT_EQ(c.layer_rope(0), 10000.0f);
  EXPECT_EQ(c.layer_rope(1), c.rope_theta);
  KVT_ASSERT_OK_AND_ASSIGN(std::vector<int> tokens, SampleTokens(*bin, 48, 5));
  FullCacheAttention full(c);
  NaiveAttention naive(c);
  Forward f(*m), g(*m);
  std::vector<float> a(c.vocab_size), b(c.vocab_size);
  for (int p = 0; p < 48; ++p) {
    ASSERT_TRUE(f.Step(tokens[p], p, &full, a.data()).ok());
    ASSERT_TRUE(g.Step(tokens[p], p, &naive, b.data()).ok());
    for (int i = 0; i < c.vocab_size; ++i) {
      ASSERT_NEAR(a[i], b[i], 2e-3 * (1 + std::fabs(b[i]))) << "pos " << p;
    }
  }
  const auto lw = Logits(*m, tokens), lwide = Logits(*wide, tokens);
  for (int p = 0; p < 16; ++p) EXPECT_EQ(lw[p], lwide[p]) << "pos " << p;
  EXPECT_NE(lw[40], lwide[40]);
}

// What the architectures' code does not apply is refused at load, naming
// the key; so is an architecture it does not know.
TEST(ModelLoadTest, RefusesWhatItCannotRun) {
  KVT_REQUIRE_SHARED_MODEL(path);
  KVT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> bin, Model::Load(path));
  testing::TempDir dir;
  ExportOptions o;
  o.arch = "gemma3";
  const std::string good = dir.path() + "/g.gguf";
  ASSERT_TRUE(ExportGguf(*bin, o, good).ok());
  KVT_ASSERT_OK_AND_ASSIGN(auto f, GgufFile::Open(good));
  ASSERT_TRUE(Model::Load(good).ok());
  // The same file with one more metadata entry each time.
  auto with = [&](const std::function<void(GgufWriter*)>& add) {
    GgufWriter w;
    w.AddString("general.architecture", "gemma3");
    for (const auto& [k, v] : f->metadata()) {
      if (k == "general.architecture") continue;
      if (v.type == GgufType::kU32)
        w.AddU32(k, static_cast<uint32_t>(std::get<uint64_t>(v.scalar)));
      if (v.type == GgufType::kF32) w.AddF32(k, static_cast<float>(std::get<double>(v.scalar)));
      if (v.type == GgufType::kString) w.AddString(k, std::get<std::string>(v.scalar));
    }
    add(&w);
    for (const GgufTensor& t : f->tensors()) {
      w.AddTensor(t.name, t.type, t.dims,
                  std::string(reinterpret_cast<const char*>(t.data), t.bytes));
    }
    const std::string p = dir.path() + "/x.gguf";
    EXPECT_TRUE(w.Write(p).ok());
    return Model::Load(p).status();
  };
  EXPECT_TRUE(with([](GgufWriter*) {}).ok());
  EXPECT_THAT(with([](GgufWriter* w) { w->AddF32("gemma3.rope.scaling.factor", 8.0f); }),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("gemma3.rope.scaling.factor = 8 asks for RoPE scaling")));
  EXPECT_THAT(with([](GgufWriter* w) { w->AddF32("gemma3.final_logit_softcapping", 30.0f); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("logit soft-cap")));
  GgufWriter other;
  other.AddString("general.architecture", "qwen2");
  ASSERT_TRUE(other.Write(dir.path() + "/q.gguf").ok());
  EXPECT_THAT(Model::Load(dir.path() + "/q.gguf"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("architecture qwen2 is not supported")));
}

}  // namespace
}  // namespace kvtier::model
