#include "traces/trace.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/half.h"
#include "testing/test_util.h"
#include "tests/util/status_matchers.h"

namespace kvtier::traces {
namespace {

using ::kvtier::testing::StatusIs;

// Softmax attention weights of one query over one head's keys.
std::vector<double> Weights(const float* q, const float* k, int64_t n, int d) {
  std::vector<double> s(n);
  double m = -1e300;
  for (int64_t t = 0; t < n; ++t) {
    double dot = 0;
    for (int c = 0; c < d; ++c) dot += static_cast<double>(q[c]) * k[t * d + c];
    s[t] = dot / std::sqrt(static_cast<double>(d));
    m = std::max(m, s[t]);
  }
  double z = 0;
  for (double& x : s) z += (x = std::exp(x - m));
  for (double& x : s) x /= z;
  return s;
}

TEST(SyntheticTraceTest, HasTheDocumentedProperties) {
  SyntheticOptions o;
  o.layers = 1;
  KVT_ASSERT_OK_AND_ASSIGN(KvTrace t, MakeSyntheticTrace(o));
  EXPECT_THAT(t.name, ::testing::HasSubstr("synthetic"));
  ASSERT_EQ(t.k.size(), static_cast<size_t>(8 * 2048 * 128));
  ASSERT_EQ(t.q.size(), static_cast<size_t>(32 * 16 * 128));
  ASSERT_EQ(t.focus_rounds.size(), 2u);
  const int d = 128;
  // Outlier channels: 4 channels per head with mean |k| far above the rest.
  for (int h = 0; h < 8; ++h) {
    std::vector<double> mag(d, 0);
    for (int64_t tok = 0; tok < t.tokens; ++tok) {
      for (int c = 0; c < d; ++c) mag[c] += std::fabs(t.K(0, h)[tok * d + c]) / t.tokens;
    }
    int big = 0;
    for (double m : mag) big += m > 6.0;
    EXPECT_EQ(big, 4) << "head " << h;
  }
  // Sinks and focus rounds take most of the mass; heads differ in entropy.
  double min_entropy = 1e9, max_entropy = 0;
  double focus_mass = 0, sink_mass = 0;
  for (int qh = 0; qh < 32; ++qh) {
    const std::vector<double> w = Weights(t.Q(0, qh), t.K(0, qh / 4), t.tokens, d);
    double ent = 0;
    for (double p : w) ent -= p > 0 ? p * std::log(p) : 0;
    min_entropy = std::min(min_entropy, ent);
    max_entropy = std::max(max_entropy, ent);
    for (int f : t.focus_rounds) {
      for (int64_t tok = t.round_begin[f]; tok < t.round_begin[f] + 256; ++tok)
        focus_mass += w[tok] / 32;
    }
    for (int s = 0; s < o.sink_tokens; ++s) sink_mass += w[s] / 32;
  }
  std::printf("focus mass %.3f, sink mass %.3f, head entropy %.2f..%.2f nats\n", focus_mass,
              sink_mass, min_entropy, max_entropy);
  // Focus rounds are 2 of 8 rounds (25% of tokens) but draw far more.
  EXPECT_GT(focus_mass, 0.4);
  // 4 sink tokens of 2048 (0.2%) draw well over their share.
  EXPECT_GT(sink_mass, 0.05);
  EXPECT_LT(min_entropy, 3.0);
  EXPECT_GT(max_entropy, 6.5);
  EXPECT_THAT(MakeSyntheticTrace(SyntheticOptions{.q_heads = 12, .kv_heads = 8}),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

void WriteNpy(const std::string& path, const std::string& descr, const std::vector<int64_t>& shape,
              const void* data, size_t bytes) {
  std::string dims;
  for (int64_t s : shape) dims += std::to_string(s) + ", ";
  std::string h = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (" + dims + "), }";
  while ((10 + h.size() + 1) % 64 != 0) h += ' ';
  h += '\n';
  std::ofstream f(path, std::ios::binary);
  f.write("\x93NUMPY\x01\x00", 8);
  const uint16_t n = static_cast<uint16_t>(h.size());
  f.write(reinterpret_cast<const char*>(&n), 2);
  f << h;
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
}

TEST(TraceDumpTest, NpyAndSafetensorsImport) {
  kvtier::testing::TempDir dir;
  std::vector<float> k(2 * 3 * 5 * 8), v(k.size()), q(2 * 6 * 2 * 8);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = 0.25f * static_cast<float>(i % 17) - 1.0f;
    v[i] = 0.5f * static_cast<float>(i % 5);
  }
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(i % 3);
  std::vector<uint16_t> vh(v.size());
  for (size_t i = 0; i < v.size(); ++i) vh[i] = FloatToHalf(v[i]);
  WriteNpy(dir.path() + "/k.npy", "<f4", {2, 3, 5, 8}, k.data(), k.size() * 4);
  WriteNpy(dir.path() + "/v.npy", "<f2", {2, 3, 5, 8}, vh.data(), vh.size() * 2);
  WriteNpy(dir.path() + "/q.npy", "<f4", {2, 6, 2, 8}, q.data(), q.size() * 4);
  KVT_ASSERT_OK_AND_ASSIGN(KvTrace t, LoadTraceDump(dir.path()));
  EXPECT_EQ(t.layers, 2);
  EXPECT_EQ(t.kv_heads, 3);
  EXPECT_EQ(t.q_heads, 6);
  EXPECT_EQ(t.tokens, 5);
  EXPECT_EQ(t.queries, 2);
  EXPECT_EQ(t.k, k);
  EXPECT_EQ(t.v, v);
  EXPECT_EQ(t.q, q);
  const std::string st = dir.path() + "/dump.safetensors";
  ASSERT_TRUE(SaveSafetensors(t, st).ok());
  KVT_ASSERT_OK_AND_ASSIGN(KvTrace u, LoadTraceDump(st));
  EXPECT_EQ(u.k, k);
  EXPECT_EQ(u.q, q);
  EXPECT_EQ(u.q_heads, 6);
  // Damage: wrong shape in the npy, truncated safetensors, missing files.
  WriteNpy(dir.path() + "/v.npy", "<f4", {2, 3, 5, 7}, v.data(), 2 * 3 * 5 * 7 * 4);
  EXPECT_THAT(LoadTraceDump(dir.path()), StatusIs(absl::StatusCode::kInvalidArgument));
  WriteNpy(dir.path() + "/v.npy", ">f4", {2, 3, 5, 8}, v.data(), v.size() * 4);
  EXPECT_THAT(LoadTraceDump(dir.path()), StatusIs(absl::StatusCode::kInvalidArgument));
  std::filesystem::resize_file(st, 200);
  EXPECT_THAT(LoadTraceDump(st), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(LoadTraceDump(dir.path() + "/none.safetensors"),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST(ModelTraceTest, CapturesStories260K) {
  KVT_REQUIRE_SHARED_MODEL(path);
  KVT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Model> m, model::Model::Load(path));
  KVT_ASSERT_OK_AND_ASSIGN(std::vector<int> tokens, model::SampleTokens(*m, 100, 3));
  KVT_ASSERT_OK_AND_ASSIGN(KvTrace t, CaptureModelTrace(*m, tokens, 10, "stories260K"));
  EXPECT_EQ(t.layers, 5);
  EXPECT_EQ(t.q_heads, 8);
  EXPECT_EQ(t.kv_heads, 4);
  EXPECT_EQ(t.head_dim, 8);
  EXPECT_EQ(t.tokens, 90);
  EXPECT_EQ(t.queries, 10);
  // Token 0's key at layer 0 has no rotation: it is wk * rmsnorm(embed[BOS]),
  // the same for any sequence, so two captures agree there.
  KVT_ASSERT_OK_AND_ASSIGN(std::vector<int> other, model::SampleTokens(*m, 50, 4));
  KVT_ASSERT_OK_AND_ASSIGN(KvTrace u, CaptureModelTrace(*m, other, 5, "stories260K-b"));
  for (int c = 0; c < 8; ++c) EXPECT_EQ(t.K(0, 1)[c], u.K(0, 1)[c]);
  for (float x : t.q) ASSERT_TRUE(std::isfinite(x));
}

}  // namespace
}  // namespace kvtier::traces
