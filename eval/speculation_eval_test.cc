#include "eval/speculation_eval.h"

#include "gtest/gtest.h"
#include "testing/test_util.h"

namespace kvtier::eval {
namespace {

struct Fixture {
  std::unique_ptr<model::Model> m;
  std::vector<std::vector<int>> text;
  std::vector<std::vector<SpecRound>> convs;
};

// stories260K, two sampled calibration sequences, and a conversation of
// three rounds from another sample.
absl::Status Load(const std::string& path, Fixture* f) {
  auto m = model::Model::Load(path);
  if (!m.ok()) return m.status();
  f->m = std::move(*m);
  for (uint64_t seed : {11, 12}) {
    auto t = model::SampleTokens(*f->m, 128, seed);
    if (!t.ok()) return t.status();
    f->text.push_back(std::move(*t));
  }
  auto t = model::SampleTokens(*f->m, 150, 99);
  if (!t.ok()) return t.status();
  std::vector<SpecRound> conv;
  for (int r = 0; r < 3; ++r) {
    const auto b = t->begin() + r * 50;
    conv.push_back({std::vector<int>(b, b + 30), std::vector<int>(b + 30, b + 50)});
  }
  f->convs.push_back(std::move(conv));
  return absl::OkStatus();
}

TEST(SpeculationEvalTest, SkewIsExactAndConcentratesTheQuery) {
  KVT_REQUIRE_SHARED_MODEL(path);
  Fixture f;
  ASSERT_TRUE(Load(path, &f).ok());
  CalibrationReport rep;
  auto skew = CalibrateSkew(*f.m, f.text, 0.25, "stories260K", &rep);
  ASSERT_TRUE(skew.ok()) << skew.status();
  EXPECT_EQ(rep.tokens, 256);
  EXPECT_EQ(skew->partial_columns(), 2);
  ASSERT_EQ(rep.invariance_err.size(), 5u);
  for (int l = 0; l < 5; ++l) {
    EXPECT_LT(rep.invariance_err[l], 1e-5) << "layer " << l;
    EXPECT_GE(rep.energy_skewed[l], rep.energy_raw[l] - 0.01) << "layer " << l;
  }
}

// Against the dense run in the same pass: an alpha that keeps every token
// changes nothing; with every column and each layer's own query, the
// speculated n tokens are exactly the true top n (hit rate 1).
TEST(SpeculationEvalTest, LimitsMatchTheDenseComputation) {
  KVT_REQUIRE_SHARED_MODEL(path);
  Fixture f;
  ASSERT_TRUE(Load(path, &f).ok());
  auto skew = CalibrateSkew(*f.m, f.text, 0.25, "stories260K", nullptr);
  ASSERT_TRUE(skew.ok());
  spec::SpeculationParams all;
  all.alpha = 1e6f;
  auto r = EvaluateSpeculation(*f.m, *skew, f.convs, all);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->positions, 60);
  EXPECT_EQ(r->top1, 1.0);
  EXPECT_LT(r->kl, 1e-9);
  EXPECT_LT(r->attn_rel_err, 1e-5);
  EXPECT_EQ(r->layers[0].steps, 0);  // Layer 0 runs dense.
  for (int l = 1; l < 5; ++l) {
    EXPECT_EQ(r->layers[l].steps, 60);
    EXPECT_DOUBLE_EQ(r->layers[l].hit, 1.0);
    EXPECT_NEAR(r->layers[l].mass, 1.0, 1e-12);
  }
  // Speculating costs the partial keys on top of dense here.
  EXPECT_GT(r->bytes_speculative, r->bytes_dense);

  auto exact = CalibrateSkew(*f.m, f.text, 1.0, "stories260K", nullptr);
  ASSERT_TRUE(exact.ok());
  spec::SpeculationParams p;
  p.alpha = 3;
  auto o = EvaluateSpeculation(*f.m, *exact, f.convs, p, /*oracle_query=*/true);
  ASSERT_TRUE(o.ok());
  for (int l = 1; l < 5; ++l) {
    EXPECT_NEAR(o->layers[l].hit, 1.0, 1e-6) << "layer " << l;
    EXPECT_LT(o->layers[l].n, 60) << "layer " << l;  // It did select.
  }
  EXPECT_LT(o->bytes_speculative, o->bytes_dense);
  // The approximate query (from the previous layer's input) does worse.
  auto a = EvaluateSpeculation(*f.m, *exact, f.convs, p);
  ASSERT_TRUE(a.ok());
  EXPECT_LT(a->layers[1].hit, 0.99);

  spec::SkewModel wrong = *skew;
  wrong.head_dim = 16;
  EXPECT_EQ(EvaluateSpeculation(*f.m, wrong, f.convs, p).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier::eval
