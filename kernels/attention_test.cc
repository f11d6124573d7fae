// Decode attention (kernels/attention.h) against its float64 reference over
// mixed raw and encoded blocks, the integer kernels' error against the
// codecs', and KvStream's block-at-a-time encoding.
#include "kernels/attention.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec_internal.h"
#include "kernels/half.h"
#include "kernels/kv_stream.h"
#include "tests/util/kv_data.h"
#include "tests/util/status_matchers.h"

namespace kvtier {
namespace {

using ::kvtier::testing::AddOutlierChannels;
using ::kvtier::testing::IsOk;
using ::kvtier::testing::Random;
using ::kvtier::testing::StatusIs;
using ::testing::HasSubstr;

struct AttnCase {
  int q_heads, kv_heads, d;
  int64_t tokens;
};

class AttentionTest : public ::testing::TestWithParam<AttnCase> {};

TEST_P(AttentionTest, VectorizedMatchesReferenceOverMixedBlocks) {
  const AttnCase& ac = GetParam();
  const AttentionShape shape{ac.q_heads, ac.kv_heads, ac.d};
  std::vector<std::string> settings = {"fp16",  "kivi4:R=9",         "kivi2:g=32",
                                       "kcvt4", "gear2:r=2:R=3",     "kivi8:g=16",
                                       "bf16",  "gearl2:r=1:bb=kcvt"};
  std::vector<EncodedBlock> keep;
  std::vector<std::vector<float>> raw_keep;
  std::vector<KvBlock> blocks, decoded_blocks;
  uint32_t seed = 100;
  for (const std::string& s : settings) {
    const int64_t n = ac.tokens + (seed % 5);
    const int64_t shp[] = {ac.kv_heads, n, ac.d};
    std::vector<float> k = Random(ac.kv_heads * n * ac.d, seed++);
    AddOutlierChannels(&k, ac.d);
    const std::vector<float> v = Random(ac.kv_heads * n * ac.d, seed++);
    KVT_ASSERT_OK_AND_ASSIGN(CodecConfig c, ParseCodecSetting(s));
    KVT_ASSERT_OK_AND_ASSIGN(EncodedBlock kt,
                             EncodedBlock::Encode(c, TensorRole::kKey, shp, k.data()));
    KVT_ASSERT_OK_AND_ASSIGN(EncodedBlock vt,
                             EncodedBlock::Encode(c, TensorRole::kValue, shp, v.data()));
    keep.push_back(std::move(kt));
    keep.push_back(std::move(vt));
  }
  // A raw fp32 strided tail, token-major like an engine's.
  const int64_t tail = 5;
  raw_keep.push_back(Random(tail * ac.kv_heads * ac.d, 7));
  raw_keep.push_back(Random(tail * ac.kv_heads * ac.d, 8));
  for (size_t i = 0; i < keep.size(); i += 2)
    blocks.push_back({keep[i].view(), keep[i + 1].view()});
  const int64_t row = ac.kv_heads * ac.d;
  blocks.push_back(
      {EncodedView::Raw(DType::kFp32, raw_keep[0].data(), ac.kv_heads, tail, ac.d, ac.d, row),
       EncodedView::Raw(DType::kFp32, raw_keep[1].data(), ac.kv_heads, tail, ac.d, ac.d, row)});
  // The same tokens decoded to raw fp32, for the fused-vs-decoded check.
  for (size_t i = 0; i < keep.size(); i += 2) {
    raw_keep.push_back(DecodeAll(keep[i].view()));
    raw_keep.push_back(DecodeAll(keep[i + 1].view()));
    const int64_t n = keep[i].header().shape[1];
    decoded_blocks.push_back({EncodedView::Raw(DType::kFp32, raw_keep[raw_keep.size() - 2].data(),
                                               ac.kv_heads, n, ac.d, n * ac.d, ac.d),
                              EncodedView::Raw(DType::kFp32, raw_keep.back().data(), ac.kv_heads, n,
                                               ac.d, n * ac.d, ac.d)});
  }
  decoded_blocks.push_back(blocks.back());
  const std::vector<float> q = Random(ac.q_heads * ac.d, 3, 2.0f);
  std::vector<float> ref(ac.q_heads * ac.d), vec(ref.size()), dec(ref.size());
  KVT_ASSERT_OK(DecodeAttention(shape, q.data(), blocks, ref.data(), KernelLevel::kReference));
  KVT_ASSERT_OK(DecodeAttention(shape, q.data(), blocks, vec.data(), KernelLevel::kVectorized));
  KVT_ASSERT_OK(
      DecodeAttention(shape, q.data(), decoded_blocks, dec.data(), KernelLevel::kReference));
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_FALSE(std::isnan(vec[i]));
    ASSERT_NEAR(vec[i], ref[i], 2e-5 + 2e-4 * std::fabs(ref[i])) << i;
    ASSERT_NEAR(dec[i], ref[i], 1e-5 + 1e-5 * std::fabs(ref[i])) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionTest,
                         ::testing::Values(AttnCase{1, 1, 64, 33}, AttnCase{8, 4, 8, 61},
                                           AttnCase{32, 8, 128, 70}, AttnCase{12, 3, 64, 17},
                                           AttnCase{6, 6, 128, 1}, AttnCase{10, 2, 64, 129},
                                           // Gemma 3 270M: 4 query heads over 1 KV head of 256.
                                           AttnCase{4, 1, 256, 90}));

// kBest multiplies 2-, 4- and 8-bit codes as integers against q rounded to
// int16 and p rounded to int8. Its output is checked against the float64 reference over the same
// codes: the error the rounding adds must stay a small fraction of what the codec itself costs (the
// reference over the codes against the original fp32).
struct IntCase {
  const char* setting;
  int q_heads, kv_heads, d;
  int64_t tokens;
  float q_scale;
};

class IntegerAttentionTest : public ::testing::TestWithParam<IntCase> {};

TEST_P(IntegerAttentionTest, ErrorIsSmallAgainstTheCodecs) {
  const IntCase& ic = GetParam();
  if (!Int8AttentionEnabled()) GTEST_SKIP() << "no AVX2 here (or KVTIER_INT8_ATTENTION=off)";
  const AttentionShape shape{ic.q_heads, ic.kv_heads, ic.d};
  KVT_ASSERT_OK_AND_ASSIGN(CodecConfig c, ParseCodecSetting(ic.setting));
  std::vector<EncodedBlock> keep;
  std::vector<std::vector<float>> raw;
  std::vector<KvBlock> blocks, exact_blocks;
  // Two blocks, the second with an odd token count, and K with outlier channels.
  for (int64_t n : {ic.tokens, ic.tokens / 2 + 7}) {
    const int64_t shp[] = {ic.kv_heads, n, ic.d};
    std::vector<float> k = Random(ic.kv_heads * n * ic.d, 40 + static_cast<uint32_t>(n));
    AddOutlierChannels(&k, ic.d);
    raw.push_back(std::move(k));
    raw.push_back(Random(ic.kv_heads * n * ic.d, 41 + static_cast<uint32_t>(n)));
    KVT_ASSERT_OK_AND_ASSIGN(EncodedBlock kt, EncodedBlock::Encode(c, TensorRole::kKey, shp,
                                                                   raw[raw.size() - 2].data()));
    KVT_ASSERT_OK_AND_ASSIGN(EncodedBlock vt,
                             EncodedBlock::Encode(c, TensorRole::kValue, shp, raw.back().data()));
    keep.push_back(std::move(kt));
    keep.push_back(std::move(vt));
    exact_blocks.push_back(
        {EncodedView::Raw(DType::kFp32, raw[raw.size() - 2].data(), ic.kv_heads, n, ic.d, n * ic.d,
                          ic.d),
         EncodedView::Raw(DType::kFp32, raw.back().data(), ic.kv_heads, n, ic.d, n * ic.d, ic.d)});
  }
  for (size_t i = 0; i < keep.size(); i += 2)
    blocks.push_back({keep[i].view(), keep[i + 1].view()});
  const std::vector<float> q = Random(ic.q_heads * ic.d, 5, ic.q_scale);
  const size_t n = q.size();
  std::vector<float> exact(n), ref(n), vec(n), best(n);
  KVT_ASSERT_OK(
      DecodeAttention(shape, q.data(), exact_blocks, exact.data(), KernelLevel::kReference));
  KVT_ASSERT_OK(DecodeAttention(shape, q.data(), blocks, ref.data(), KernelLevel::kReference));
  KVT_ASSERT_OK(DecodeAttention(shape, q.data(), blocks, vec.data(), KernelLevel::kVectorized));
  // Both instruction sets where the CPU has VNNI: its kernels (vpdpbusd,
  // vpdpwssd) and the AVX2 ones (vpmaddubsw), which every AVX2 CPU runs.
  std::vector<bool> vnni_settings = {false};
  if (internal::VnniCpu()) vnni_settings.push_back(true);
  for (bool vnni : vnni_settings) {
    const bool was = internal::SetVnni(vnni);
    const absl::Status st =
        DecodeAttention(shape, q.data(), blocks, best.data(), KernelLevel::kBest);
    internal::SetVnni(was);
    KVT_ASSERT_OK(st);
    const char* isa = vnni ? "avx512-vnni" : "avx2";
    double codec_err = 0, int_err = 0, worst = 0, codec_worst = 0;
    bool differs = false;
    for (size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(std::isfinite(best[i])) << isa << " " << i;
      codec_err += (ref[i] - exact[i]) * (ref[i] - exact[i]);
      int_err += (best[i] - ref[i]) * (best[i] - ref[i]);
      worst = std::max(worst, static_cast<double>(std::fabs(best[i] - ref[i])));
      codec_worst = std::max(codec_worst, static_cast<double>(std::fabs(ref[i] - exact[i])));
      differs |= best[i] != vec[i];
    }
    codec_err = std::sqrt(codec_err / n);
    int_err = std::sqrt(int_err / n);
    EXPECT_TRUE(differs) << isa << ": kBest took the fp32 path";
    // The rounding must cost under a tenth of what the codec itself costs.
    EXPECT_LT(int_err, 0.1 * codec_err)
        << isa << " rms error: integer path " << int_err << ", codec " << codec_err;
    EXPECT_LT(worst, 0.1 * codec_worst)
        << isa << " largest element error: integer path " << worst << ", codec " << codec_worst;
    std::printf(
        "%s (%s): rms error integer path %.4f, codec %.4f; largest integer path %.4f, codec "
        "%.4f\n",
        ic.setting, isa, int_err, codec_err, worst, codec_worst);
  }
  if (vnni_settings.size() == 1) {
    std::printf("%s: this CPU has no AVX-512 VNNI (or KVTIER_VNNI=off): avx2 kernels only\n",
                ic.setting);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Codecs, IntegerAttentionTest,
    ::testing::Values(
        IntCase{"kivi4", 32, 8, 128, 300, 2.0f}, IntCase{"kivi2", 32, 8, 128, 300, 2.0f},
        IntCase{"kivi4:g=64", 8, 4, 128, 129, 4.0f}, IntCase{"kcvt4", 6, 2, 64, 97, 1.0f},
        // 8 V groups per token (head_dim 256).
        IntCase{"kivi2", 8, 2, 256, 150, 2.0f}, IntCase{"kivi4", 4, 4, 256, 61, 2.0f},
        IntCase{"kivi2:g=32:R=8", 5, 5, 32, 77, 2.0f}, IntCase{"kivi4:g=128", 12, 4, 256, 64, 2.0f},
        // 2-bit K: a whole 64-channel block, then a half one.
        IntCase{"kivi2", 6, 3, 96, 90, 2.0f},
        // 8-bit codes: int16 products (vpmaddwd).
        IntCase{"kivi8", 32, 8, 128, 300, 2.0f}, IntCase{"kivi8:g=16", 8, 4, 64, 129, 4.0f},
        IntCase{"kcvt8", 6, 2, 64, 97, 1.0f}, IntCase{"kivi8:R=8", 5, 5, 32, 77, 2.0f},
        // GEAR: the backbone's codes as integers, the
        // low-rank term and the outliers in fp32.
        IntCase{"gear4", 32, 8, 128, 300, 2.0f}, IntCase{"gear2:r=2:s=0.05", 8, 2, 64, 200, 2.0f},
        IntCase{"gear4:bb=kcvt", 6, 2, 64, 97, 1.0f}, IntCase{"gearl2:r=4", 8, 4, 128, 150, 2.0f},
        // Gemma 3 270M's shape: 4 query heads over 1 KV head of 256.
        IntCase{"kivi4", 4, 1, 256, 200, 2.0f}, IntCase{"kivi2", 4, 1, 256, 200, 2.0f},
        IntCase{"kivi8", 4, 1, 256, 200, 2.0f}, IntCase{"kcvt4", 4, 1, 256, 200, 1.0f},
        IntCase{"gear2:r=2", 4, 1, 256, 200, 2.0f}));

TEST(AttentionTest, RejectsMismatchedBlocks) {
  const std::vector<float> k(2 * 4 * 8, 1.0f), q(4 * 8, 1.0f);
  std::vector<float> out(4 * 8);
  KvBlock b{EncodedView::Raw(DType::kFp32, k.data(), 2, 4, 8, 32, 8),
            EncodedView::Raw(DType::kFp32, k.data(), 2, 3, 8, 32, 8)};
  EXPECT_THAT(DecodeAttention({4, 2, 8}, q.data(), {&b, 1}, out.data()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token counts")));
  b.v.tokens = 4;
  EXPECT_THAT(DecodeAttention({4, 3, 8}, q.data(), {&b, 1}, out.data()),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(DecodeAttention({4, 2, 8}, q.data(), {}, out.data()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no tokens")));
}

TEST(KvStreamTest, EncodesWholeBlocksAndNeverReencodes) {
  KVT_ASSERT_OK_AND_ASSIGN(CodecConfig c, ParseCodecSetting("kivi4:R=8:nb=16"));
  KVT_ASSERT_OK_AND_ASSIGN(KvStream s, KvStream::Create(c, 2, 64));
  const std::vector<float> k = Random(100 * 2 * 64, 1), v = Random(100 * 2 * 64, 2);
  std::string first;
  for (int t = 0; t < 100; ++t) {
    KVT_ASSERT_OK(s.Append(k.data() + t * 128, v.data() + t * 128, 1));
    EXPECT_LT(s.tail_tokens(), 8 + 16);
    EXPECT_GE(s.tail_tokens(), std::min(t + 1, 8));
    if (t == 30) first = std::string(s.key_blocks()[0]->bytes());
  }
  EXPECT_EQ(s.tokens(), 100);
  EXPECT_EQ(s.key_blocks().size(), 5u);  // (100 - 8) / 16 whole blocks.
  EXPECT_EQ(s.key_blocks()[0]->bytes(), first);
  EXPECT_EQ(s.key_blocks()[0]->header().block_tokens, 16);
  // Attention over the stream equals attention over its decoded tokens.
  const std::vector<float> q = Random(4 * 64, 3);
  std::vector<float> a(4 * 64), b(4 * 64);
  const std::vector<KvBlock> blocks = s.Blocks();
  KVT_ASSERT_OK(DecodeAttention({4, 2, 64}, q.data(), blocks, a.data(), KernelLevel::kVectorized));
  KVT_ASSERT_OK(DecodeAttention({4, 2, 64}, q.data(), blocks, b.data(), KernelLevel::kReference));
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-4);
  KVT_ASSERT_OK(s.Flush());
  EXPECT_EQ(s.tail_tokens(), 8);
  EXPECT_GT(s.bytes(), 0);
}

}  // namespace
}  // namespace kvtier
