#include "kernels/codec.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "encoded/encode.h"
#include "encoded/encoded_tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/attention.h"
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

double RelErr(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(a[i]) * a[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

CodecConfig Kivi(int bits, int group, int residual) {
  CodecConfig c;
  c.codec = Codec::kKivi;
  c.bits = bits;
  c.group_size = group;
  c.residual_tokens = residual;
  return c;
}

TEST(HalfTest, EveryHalfRoundTrips) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToHalf(f), h) << h;
  }
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // Rounds to infinity.
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(1.0f + 1.0f / 2048.0f), 0x3c00);  // Tie to even.
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.5f)), 1.5f);
}

TEST(CodecSettingTest, ParsesAndRejects) {
  KVT_ASSERT_OK_AND_ASSIGN(CodecConfig c, ParseCodecSetting("gear2:r=2:s=0.01:g=64"));
  EXPECT_EQ(c.codec, Codec::kGear);
  EXPECT_EQ(c.bits, 2);
  EXPECT_EQ(c.rank, 2);
  EXPECT_EQ(c.group_size, 64);
  EXPECT_FLOAT_EQ(c.outlier_fraction, 0.01f);
  KVT_ASSERT_OK_AND_ASSIGN(CodecConfig l, ParseCodecSetting("gearl2:r=1"));
  EXPECT_EQ(l.codec, Codec::kGearL);
  EXPECT_EQ(l.outlier_fraction, 0.0f);
  KVT_ASSERT_OK_AND_ASSIGN(CodecConfig r, ParseCodecSetting(CodecSettingName(c)));
  EXPECT_EQ(CodecSettingName(r), CodecSettingName(c));
  EXPECT_THAT(ParseCodecSetting("kivi3"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseCodecSetting("zip"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseCodecSetting("kivi4:g=0"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseCodecSetting("kivi4:q=1"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseCodecSetting("gear8"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseCodecSetting("gear2:s=0.7"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseCodecSetting("gearl2:s=0.1"), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(CodecTest, BadInputsAreRejected) {
  const std::vector<float> x = Random(2 * 16 * 8, 1);
  const int64_t shape[] = {2, 16, 8};
  CodecConfig c = Kivi(4, 32, 0);
  EXPECT_THAT(Encode(c, TensorRole::kUnspecified, shape, x.data()),
              StatusIs(absl::StatusCode::kInvalidArgument));
  const int64_t flat[] = {256};
  EXPECT_THAT(Encode(c, TensorRole::kKey, flat, x.data()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tokens, head_dim")));
  std::vector<float> bad = x;
  bad[17] = NAN;
  EXPECT_THAT(Encode(c, TensorRole::kKey, shape, bad.data()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("finite")));
  bad[17] = 1e6f;
  EXPECT_THAT(Encode(c, TensorRole::kKey, shape, bad.data()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("fp16 range")));
  CodecConfig g;
  g.codec = Codec::kGear;
  g.bits = 2;
  g.rank = 9;
  EXPECT_THAT(Encode(g, TensorRole::kKey, shape, x.data()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank")));
}

// Encode's input check: the vectorized scan finds the same first bad
// element as a plain loop, wherever it sits in a block or tail.
TEST(CodecTest, VectorizedInputCheckFindsTheFirstBadElement) {
  if (!internal::SimdAvailable()) GTEST_SKIP() << "no AVX2 on this CPU";
  const float bads[] = {std::numeric_limits<float>::quiet_NaN(),
                        std::numeric_limits<float>::infinity(), -70000.0f, 65505.0f};
  for (int64_t n : {1, 7, 8, 9, 255, 256, 257, 1000}) {
    std::vector<float> x(static_cast<size_t>(n), -65504.0f);
    for (int64_t i = 0; i < n; ++i) x[i] = (i % 3 == 0) ? -0.0f : 65504.0f * ((i % 7) - 3) / 3;
    int64_t first = 0;
    ASSERT_TRUE(internal::FirstOutOfRangeSimd(x.data(), n, kHalfMax, &first));
    EXPECT_EQ(first, -1) << "n " << n;
    for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
      for (float bad : bads) {
        std::vector<float> y = x;
        y[at] = bad;
        if (at + 1 < n) y[n - 1] = bad;  // A later bad element must not win.
        ASSERT_TRUE(internal::FirstOutOfRangeSimd(y.data(), n, kHalfMax, &first));
        EXPECT_EQ(first, at) << "n " << n << " bad " << bad;
      }
    }
  }
}

TEST(CodecTest, RawRoundTrips) {
  const int64_t shape[] = {3, 17, 8};
  const std::vector<float> x = Random(3 * 17 * 8, 2);
  for (DType dt : {DType::kFp32, DType::kFp16, DType::kBf16}) {
    CodecConfig c;
    c.codec = Codec::kRaw;
    c.dtype = dt;
    KVT_ASSERT_OK_AND_ASSIGN(v1::EncodedTensor t, Encode(c, TensorRole::kKey, shape, x.data()));
    KVT_ASSERT_OK_AND_ASSIGN(std::vector<float> y, Decode(t));
    const double tol = dt == DType::kFp32 ? 0 : dt == DType::kFp16 ? 1e-3 : 8e-3;
    EXPECT_LE(RelErr(x, y), tol);
    KVT_ASSERT_OK_AND_ASSIGN(int64_t bytes, EncodedBufferBytes(c, TensorRole::kKey, shape));
    EXPECT_EQ(bytes, 3 * 17 * 8 * DTypeSize(dt));
  }
}

// Every quantized element is within half a step of its input (plus fp16
// rounding of the zero point), for every codec level.
struct QuantCase {
  int bits, group, residual;
  int64_t slabs, tokens;
  int d;
};

class KiviTest : public ::testing::TestWithParam<QuantCase> {};

TEST_P(KiviTest, LevelsAgreeAndErrorIsBounded) {
  const QuantCase& qc = GetParam();
  const int64_t shape[] = {qc.slabs, qc.tokens, qc.d};
  std::vector<float> x = Random(qc.slabs * qc.tokens * qc.d, 7 + qc.bits + qc.d);
  AddOutlierChannels(&x, qc.d);
  for (Codec codec : {Codec::kKivi, Codec::kKcvt}) {
    for (TensorRole role : {TensorRole::kKey, TensorRole::kValue}) {
      CodecConfig c = Kivi(qc.bits, qc.group, qc.residual);
      c.codec = codec;
      SCOPED_TRACE(absl::StrCat(CodecSettingName(c), " role ", role, " shape ", qc.slabs, "x",
                                qc.tokens, "x", qc.d));
      KVT_ASSERT_OK_AND_ASSIGN(v1::EncodedTensor ref,
                               Encode(c, role, shape, x.data(), KernelLevel::kReference));
      KVT_ASSERT_OK_AND_ASSIGN(v1::EncodedTensor vec,
                               Encode(c, role, shape, x.data(), KernelLevel::kVectorized));
      KVT_ASSERT_OK_AND_ASSIGN(int64_t predicted, EncodedBufferBytes(c, role, shape));
      int64_t actual = 0;
      for (const auto& b : ref.buffers()) actual += b.data().size();
      EXPECT_EQ(predicted, actual);
      // Same bytes decode the same at both levels.
      KVT_ASSERT_OK_AND_ASSIGN(std::vector<float> dr, Decode(ref, KernelLevel::kReference));
      KVT_ASSERT_OK_AND_ASSIGN(std::vector<float> dv, Decode(ref, KernelLevel::kVectorized));
      ASSERT_EQ(dr.size(), x.size());
      for (size_t i = 0; i < dr.size(); ++i)
        ASSERT_NEAR(dr[i], dv[i], 1e-5 * (1 + std::fabs(dr[i])));
      // Each element within half a quantization step of the input.
      KVT_ASSERT_OK_AND_ASSIGN(EncodedView view, ParseEncoded(ref));
      const double qmax = (1 << qc.bits) - 1;
      for (int64_t s = 0; s < qc.slabs; ++s) {
        for (int64_t t = 0; t < view.quantized; ++t) {
          for (int ch = 0; ch < qc.d; ++ch) {
            const int64_t i = (s * qc.tokens + t) * qc.d + ch;
            const int64_t si = role == TensorRole::kKey
                                   ? (t / view.group) * qc.d + ch
                                   : t * ((qc.d + view.group - 1) / view.group) + ch / view.group;
            const double step = HalfToFloat(view.scales[s * view.groups_per_slab + si]);
            const double zero = HalfToFloat(view.zeros[s * view.groups_per_slab + si]);
            const double slack = 0.5 * step + 1e-3 * (std::fabs(zero) + step * qmax) + 1e-6;
            ASSERT_LE(std::fabs(dr[i] - x[i]), slack) << "element " << i;
          }
        }
      }
      // Vectorized encoding is the reference up to rare off-by-one codes at ties.
      KVT_ASSERT_OK_AND_ASSIGN(std::vector<float> dvec, Decode(vec, KernelLevel::kReference));
      int differ = 0;
      for (size_t i = 0; i < dr.size(); ++i) differ += dr[i] != dvec[i];
      EXPECT_LE(differ, static_cast<int>(dr.size() / 200) + 2);
      EXPECT_LE(RelErr(x, dvec), RelErr(x, dr) * 1.01 + 1e-6);
      // Bit-exact round trip through the serialized bytes.
      std::string bytes = ref.SerializeAsString();
      v1::EncodedTensor back;
      ASSERT_TRUE(back.ParseFromString(bytes));
      EXPECT_EQ(back.SerializeAsString(), bytes);
      KVT_ASSERT_OK_AND_ASSIGN(std::vector<float> db, Decode(back, KernelLevel::kReference));
      EXPECT_EQ(db, dr);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, KiviTest,
    ::testing::Values(QuantCase{2, 32, 0, 1, 64, 128}, QuantCase{4, 32, 0, 8, 33, 64},
                      QuantCase{8, 32, 5, 4, 70, 64}, QuantCase{4, 16, 3, 32, 7, 128},
                      QuantCase{2, 8, 0, 3, 1, 8}, QuantCase{4, 32, 128, 2, 200, 8},
                      QuantCase{2, 48, 0, 2, 97, 128}, QuantCase{4, 20, 0, 2, 41, 60},
                      QuantCase{8, 128, 10, 5, 5, 128}));

TEST(KiviTest, BitsShrinkError) {
  const int64_t shape[] = {4, 256, 128};
  const std::vector<float> x = Random(4 * 256 * 128, 3);
  double prev = 1e9;
  for (int bits : {2, 4, 8}) {
    KVT_ASSERT_OK_AND_ASSIGN(v1::EncodedTensor t,
                             Encode(Kivi(bits, 32, 0), TensorRole::kKey, shape, x.data()));
    KVT_ASSERT_OK_AND_ASSIGN(std::vector<float> y, Decode(t));
    const double e = RelErr(x, y);
    EXPECT_LT(e, prev);
    prev = e;
  }
  EXPECT_LT(prev, 0.01);
}

TEST(GearTest, BeatsItsBackboneAndKeepsOutliersExact) {
  for (TensorRole role : {TensorRole::kKey, TensorRole::kValue}) {
    const int64_t shape[] = {4, 96, 64};
    // Low-rank structure plus noise plus outlier channels.
    std::vector<float> x = Random(4 * 96 * 64, 11, 0.2f);
    const std::vector<float> u = Random(4 * 96, 12), w = Random(64, 13);
    for (int64_t s = 0; s < 4; ++s) {
      for (int64_t t = 0; t < 96; ++t) {
        for (int c = 0; c < 64; ++c) x[(s * 96 + t) * 64 + c] += 2.0f * u[s * 96 + t] * w[c];
      }
    }
    AddOutlierChannels(&x, 64);
    for (KernelLevel level : {KernelLevel::kReference, KernelLevel::kVectorized}) {
      CodecConfig k = Kivi(2, 32, 0);
      CodecConfig g = k;
      g.codec = Codec::kGear;
      g.rank = 4;
      g.outlier_fraction = 0.05f;
      CodecConfig gl = g;
      gl.codec = Codec::kGearL;
      gl.outlier_fraction = 0;
      KVT_ASSERT_OK_AND_ASSIGN(v1::EncodedTensor kt, Encode(k, role, shape, x.data(), level));
      KVT_ASSERT_OK_AND_ASSIGN(v1::EncodedTensor gt, Encode(g, role, shape, x.data(), level));
      KVT_ASSERT_OK_AND_ASSIGN(v1::EncodedTensor lt, Encode(gl, role, shape, x.data(), level));
      KVT_ASSERT_OK_AND_ASSIGN(std::vector<float> kd, Decode(kt, level));
      KVT_ASSERT_OK_AND_ASSIGN(std::vector<float> gd, Decode(gt, level));
      KVT_ASSERT_OK_AND_ASSIGN(std::vector<float> ld, Decode(lt, level));
      EXPECT_LT(RelErr(x, gd), 0.7 * RelErr(x, kd)) << "role " << role;
      EXPECT_LT(RelErr(x, ld), RelErr(x, kd)) << "role " << role;
      KVT_ASSERT_OK_AND_ASSIGN(int64_t predicted, EncodedBufferBytes(g, role, shape));
      int64_t actual = 0;
      for (const auto& b : gt.buffers()) actual += b.data().size();
      EXPECT_EQ(predicted, actual);
      // Outliers come back as their fp16 values.
      KVT_ASSERT_OK_AND_ASSIGN(EncodedView v, ParseEncoded(gt));
      ASSERT_GT(v.outliers_per_row, 0);
      for (int64_t s = 0; s < 4; ++s) {
        for (int64_t row = 0; row < v.sparse_rows_per_slab; ++row) {
          for (int k2 = 0; k2 < v.outliers_per_row; ++k2) {
            uint16_t pos;
            std::memcpy(
                &pos,
                v.sparse_index + ((s * v.sparse_rows_per_slab + row) * v.outliers_per_row + k2) * 2,
                2);
            const int64_t i =
                role == TensorRole::kKey ? (s * 96 + pos) * 64 + row : (s * 96 + row) * 64 + pos;
            ASSERT_EQ(gd[i], HalfToFloat(FloatToHalf(x[i])));
          }
        }
      }
    }
  }
}

TEST(GearTest, LevelsDecodeTheSameBytesAlike) {
  const int64_t shape[] = {3, 45, 128};
  const std::vector<float> x = Random(3 * 45 * 128, 21);
  CodecConfig g = Kivi(2, 32, 7);
  g.codec = Codec::kGear;
  g.rank = 2;
  for (TensorRole role : {TensorRole::kKey, TensorRole::kValue}) {
    KVT_ASSERT_OK_AND_ASSIGN(v1::EncodedTensor t, Encode(g, role, shape, x.data()));
    KVT_ASSERT_OK_AND_ASSIGN(std::vector<float> a, Decode(t, KernelLevel::kReference));
    KVT_ASSERT_OK_AND_ASSIGN(std::vector<float> b, Decode(t, KernelLevel::kVectorized));
    for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-5 * (1 + std::fabs(a[i])));
  }
}

// The outliers of each row are its m smallest and m largest values (ties by
// position), checked against a full sort of the row; K rows are channels.
// Data with many ties (values on a coarse grid) makes the order's second key
// count.
TEST(GearTest, OutliersAreEachRowsExtremes) {
  const int64_t shape[] = {2, 300, 32};
  std::vector<float> x = Random(2 * 300 * 32, 31);
  for (size_t i = 0; i < x.size(); i += 3) x[i] = std::round(x[i] * 4) / 4;
  for (const char* setting : {"gear2:s=0.05", "gear4:s=0.2:r=1", "gear2:s=0.5:r=0"}) {
    SCOPED_TRACE(setting);
    KVT_ASSERT_OK_AND_ASSIGN(CodecConfig c, ParseCodecSetting(setting));
    for (TensorRole role : {TensorRole::kKey, TensorRole::kValue}) {
      const bool key = role == TensorRole::kKey;
      KVT_ASSERT_OK_AND_ASSIGN(v1::EncodedTensor t, Encode(c, role, shape, x.data()));
      KVT_ASSERT_OK_AND_ASSIGN(EncodedView v, ParseEncoded(t));
      ASSERT_GT(v.outliers_per_row, 0);
      const int m = v.outliers_per_row / 2;
      const int64_t row_len = key ? v.quantized : 32;
      for (int64_t s = 0; s < 2; ++s) {
        for (int64_t row = 0; row < v.sparse_rows_per_slab; ++row) {
          auto at = [&](int64_t j) {
            return x[key ? (s * 300 + j) * 32 + row : (s * 300 + row) * 32 + j];
          };
          std::vector<int64_t> all(static_cast<size_t>(row_len));
          std::iota(all.begin(), all.end(), 0);
          std::sort(all.begin(), all.end(), [&](int64_t i, int64_t j) {
            return at(i) < at(j) || (at(i) == at(j) && i < j);
          });
          std::vector<int64_t> want(all.begin(), all.begin() + m);
          want.insert(want.end(), all.end() - m, all.end());
          std::sort(want.begin(), want.end());
          std::vector<int64_t> got;
          for (int k = 0; k < v.outliers_per_row; ++k) {
            uint16_t pos;
            std::memcpy(
                &pos,
                v.sparse_index + ((s * v.sparse_rows_per_slab + row) * v.outliers_per_row + k) * 2,
                2);
            got.push_back(pos);
          }
          ASSERT_EQ(got, want) << "slab " << s << " row " << row;
        }
      }
    }
  }
}

// Raw rows widen whole (memcpy for fp32, SIMD for fp16 and bf16) to what
// the element loads give, for any width, token stride and byte offset.
TEST(CodecTest, RawRowsDecodeToTheirElements) {
  std::mt19937 rng(29);
  std::normal_distribution<float> nd;
  for (DType dtype : {DType::kFp32, DType::kFp16, DType::kBf16}) {
    const int es = dtype == DType::kFp32 ? 4 : 2;
    for (int d : {1, 7, 26, 128}) {
      for (int64_t stride : {int64_t{d}, int64_t{d} + 3}) {
        const int64_t tokens = 9;
        // One byte in: rows at odd addresses.
        std::vector<uint8_t> buf(1 + static_cast<size_t>(tokens * stride * es));
        for (int64_t i = 0; i < tokens * stride; ++i) {
          const float f = nd(rng);
          if (dtype == DType::kFp32) {
            std::memcpy(buf.data() + 1 + i * 4, &f, 4);
          } else {
            const uint16_t h = dtype == DType::kFp16 ? FloatToHalf(f) : FloatToBf16(f);
            std::memcpy(buf.data() + 1 + i * 2, &h, 2);
          }
        }
        const EncodedView v = EncodedView::Raw(dtype, buf.data() + 1, 1, tokens, d, 0, stride);
        for (KernelLevel level : {KernelLevel::kReference, KernelLevel::kBest}) {
          std::vector<float> got(static_cast<size_t>((tokens - 2) * d));
          DecodeRows(v, 0, 2, tokens, got.data(), level);
          for (int64_t t = 2; t < tokens; ++t) {
            for (int c = 0; c < d; ++c) {
              ASSERT_EQ(got[(t - 2) * d + c], internal::LoadElement(dtype, v.raw, t * stride + c))
                  << "dtype " << dtype << " d " << d << " stride " << stride << " row " << t;
            }
          }
        }
      }
    }
  }
}

// DecodeRows over any window of rows gives those rows of the whole tensor:
// the K outliers' search for the window's first position, the low-rank rows
// and the residual rows, at both levels.
TEST(GearTest, RowWindowsDecodeAsTheWhole) {
  const int64_t shape[] = {2, 150, 64};
  std::vector<float> x = Random(2 * 150 * 64, 23);
  AddOutlierChannels(&x, 64);
  for (const char* setting : {"gear2:r=2:s=0.1:R=6", "gear4:bb=kcvt:s=0.05", "gearl2:r=3"}) {
    SCOPED_TRACE(setting);
    KVT_ASSERT_OK_AND_ASSIGN(CodecConfig c, ParseCodecSetting(setting));
    for (TensorRole role : {TensorRole::kKey, TensorRole::kValue}) {
      KVT_ASSERT_OK_AND_ASSIGN(v1::EncodedTensor t, Encode(c, role, shape, x.data()));
      KVT_ASSERT_OK_AND_ASSIGN(EncodedView v, ParseEncoded(t));
      for (KernelLevel level : {KernelLevel::kReference, KernelLevel::kBest}) {
        for (int64_t s = 0; s < v.slabs; ++s) {
          std::vector<float> whole(static_cast<size_t>(v.tokens * 64));
          DecodeRows(v, s, 0, v.tokens, whole.data(), level);
          for (auto [t0, t1] : {std::pair<int64_t, int64_t>{0, 1},
                                {1, 64},
                                {63, 65},
                                {64, 128},
                                {100, 150},
                                {143, 145},
                                {149, 150},
                                {0, 150}}) {
            std::vector<float> part(static_cast<size_t>((t1 - t0) * 64));
            DecodeRows(v, s, t0, t1, part.data(), level);
            for (size_t i = 0; i < part.size(); ++i) {
              ASSERT_EQ(part[i], whole[t0 * 64 + i]) << t0 << ".." << t1 << " element " << i;
            }
          }
        }
      }
    }
  }
}

// TensorEncoder writes, in place and in one pass, the bytes that Encode's
// tensor serializes to, for every codec, dtype and a residual-only tensor.
TEST(TensorEncoderTest, WritesWhatEncodeSerializes) {
  std::vector<std::string> settings = {
      "raw",        "fp32",  "raw:dt=bf16", "kivi2:g=16", "kivi4:R=8",
      "kivi8:R=64", "kcvt4", "gear2:r=2",   "gearl4:r=1", "gear4:bb=kcvt:s=0.1"};
  const int64_t shape[3] = {2, 40, 16};
  std::vector<float> x = Random(2 * 40 * 16, 11);
  AddOutlierChannels(&x, 16);
  for (const std::string& setting : settings) {
    SCOPED_TRACE(setting);
    auto c = ParseCodecSetting(setting);
    KVT_ASSERT_OK(c.status());
    for (TensorRole role : {TensorRole::kKey, TensorRole::kValue}) {
      auto want = Encode(*c, role, shape, x.data());
      KVT_ASSERT_OK(want.status());
      want->set_layer_begin(7);
      if (want->crc32c() == 0) continue;  // Written out explicitly by EncodeTo.
      const std::string bytes = want->SerializeAsString();
      auto enc = TensorEncoder::Make(*c, role, shape, 7);
      KVT_ASSERT_OK(enc.status());
      ASSERT_EQ(enc->SerializedSize(), bytes.size());
      // Stale bytes in the destination must not leak into the codes.
      std::string out(bytes.size() + 3, '\xff');
      auto end = enc->EncodeTo(x.data(), reinterpret_cast<uint8_t*>(out.data()));
      KVT_ASSERT_OK(end.status());
      EXPECT_EQ(*end, reinterpret_cast<uint8_t*>(out.data()) + bytes.size());
      EXPECT_EQ(out.substr(0, bytes.size()), bytes);
      EXPECT_EQ(out.substr(bytes.size()), "\xff\xff\xff");
    }
  }
  // EncodeTo checks its input as Encode does.
  auto enc = TensorEncoder::Make(Kivi(4, 32, 0), TensorRole::kKey, shape);
  KVT_ASSERT_OK(enc.status());
  std::vector<float> bad = x;
  bad[5] = std::numeric_limits<float>::infinity();
  std::string out(enc->SerializedSize(), '\0');
  EXPECT_THAT(enc->EncodeTo(bad.data(), reinterpret_cast<uint8_t*>(out.data())).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("finite")));
  EXPECT_THAT(TensorEncoder::Make(Kivi(3, 32, 0), TensorRole::kKey, shape).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// The input check rides along with the vectorized quantizer (KIVI/KCVT
// without a residual): a bad element anywhere, in either role, at every
// level and width, is refused by Encode and EncodeTo with its index; a code
// word's padding is zeroed even over stale bytes (2-bit codes of 8-wide rows
// leave half of the last word unused when the token count is odd).
TEST(CodecTest, FusedInputCheckFindsEveryBadElement) {
  const float bads[] = {std::numeric_limits<float>::quiet_NaN(),
                        -std::numeric_limits<float>::infinity(), 65505.0f, -1e30f};
  for (const char* setting : {"kivi2:g=8", "kivi4", "kivi8:g=16", "kcvt4", "kivi4:R=4",
                              "gear2:s=0.3:r=2", "gear4:bb=kcvt:s=0.1"}) {
    for (KernelLevel level : {KernelLevel::kReference, KernelLevel::kBest}) {
      for (TensorRole role : {TensorRole::kKey, TensorRole::kValue}) {
        SCOPED_TRACE(std::string(setting) + (role == TensorRole::kKey ? " K" : " V") +
                     (level == KernelLevel::kBest ? " best" : " reference"));
        auto c = ParseCodecSetting(setting);
        KVT_ASSERT_OK(c.status());
        const int64_t shape[3] = {2, 37, 8};
        const std::vector<float> x = Random(2 * 37 * 8, 21);
        KVT_ASSERT_OK_AND_ASSIGN(v1::EncodedTensor want, Encode(*c, role, shape, x.data(), level));
        const std::string bytes = want.SerializeAsString();
        auto enc = TensorEncoder::Make(*c, role, shape, 0);
        KVT_ASSERT_OK(enc.status());
        std::string out(enc->SerializedSize(), '\xa5');
        KVT_ASSERT_OK(enc->EncodeTo(x.data(), reinterpret_cast<uint8_t*>(out.data()), level));
        if (want.crc32c() != 0) {
          EXPECT_EQ(out, bytes);
        }
        for (int64_t at : {int64_t{0}, int64_t{300}, int64_t{2 * 37 * 8 - 1}}) {
          for (float bad : bads) {
            std::vector<float> y = x;
            y[at] = bad;
            const std::string where = "element " + std::to_string(at) + " is";
            EXPECT_THAT(Encode(*c, role, shape, y.data(), level).status(),
                        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(where)));
            EXPECT_THAT(
                enc->EncodeTo(y.data(), reinterpret_cast<uint8_t*>(out.data()), level).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(where)));
          }
        }
      }
    }
  }
}

// 16-bit input (fp16, bf16) is quantized without a widened copy where the
// vectorized kernel can; the bytes equal those of the widened fp32 input,
// over stale output bytes, at every width, role and level; a non-finite
// element, or a bf16 one beyond fp16 range, is refused with its index.
TEST(TensorEncoderTest, SixteenBitInputEncodesAsItsWidenedValues) {
  const int64_t shape[3] = {3, 37, 16};
  const int64_t n = 3 * 37 * 16;
  const std::vector<float> x = Random(n, 31);
  for (DType dt : {DType::kFp16, DType::kBf16}) {
    std::vector<uint16_t> h(n);
    std::vector<float> wide(n);
    for (int64_t i = 0; i < n; ++i) {
      h[i] = dt == DType::kFp16 ? FloatToHalf(x[i]) : FloatToBf16(x[i]);
      wide[i] = dt == DType::kFp16 ? HalfToFloat(h[i]) : Bf16ToFloat(h[i]);
    }
    for (const char* setting : {"kivi2:g=8", "kivi4", "kivi8:g=16", "kcvt4", "kivi4:R=4"}) {
      for (KernelLevel level : {KernelLevel::kReference, KernelLevel::kBest}) {
        for (TensorRole role : {TensorRole::kKey, TensorRole::kValue}) {
          SCOPED_TRACE(std::string(setting) + (dt == DType::kFp16 ? " fp16" : " bf16") +
                       (role == TensorRole::kKey ? " K" : " V") +
                       (level == KernelLevel::kBest ? " best" : " reference"));
          auto c = ParseCodecSetting(setting);
          KVT_ASSERT_OK(c.status());
          auto enc = TensorEncoder::Make(*c, role, shape, 3);
          KVT_ASSERT_OK(enc.status());
          std::string want(enc->SerializedSize(), '\0'), got(enc->SerializedSize(), '\x5a');
          KVT_ASSERT_OK(enc->EncodeTo(wide.data(), reinterpret_cast<uint8_t*>(want.data()), level));
          std::vector<float> scratch;
          KVT_ASSERT_OK(
              enc->EncodeTo(h.data(), dt, reinterpret_cast<uint8_t*>(got.data()), &scratch, level));
          EXPECT_EQ(got, want);
          std::vector<uint16_t> bad = h;
          const int64_t at = 401;
          bad[at] = dt == DType::kFp16 ? 0x7e00 : 0x7fc0;  // NaN.
          EXPECT_THAT(
              enc->EncodeTo(bad.data(), dt, reinterpret_cast<uint8_t*>(got.data()), &scratch, level)
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("element 401 is")));
          if (dt == DType::kBf16) {
            bad[at] = FloatToBf16(1e6f);  // Finite, beyond fp16.
            EXPECT_THAT(enc->EncodeTo(bad.data(), dt, reinterpret_cast<uint8_t*>(got.data()),
                                      &scratch, level)
                            .status(),
                        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("fp16 range")));
          }
        }
      }
    }
  }
}

TEST(CodecFormatTest, CorruptionIsDetected) {
  const int64_t shape[] = {2, 40, 64};
  const std::vector<float> x = Random(2 * 40 * 64, 5);
  CodecConfig g = Kivi(2, 32, 4);
  g.codec = Codec::kGear;
  g.rank = 2;
  g.outlier_fraction = 0.1f;
  KVT_ASSERT_OK_AND_ASSIGN(v1::EncodedTensor t, Encode(g, TensorRole::kKey, shape, x.data()));
  {
    v1::EncodedTensor c = t;
    (*c.mutable_buffers(0)->mutable_data())[3] ^= 1;
    EXPECT_THAT(ParseEncoded(c), StatusIs(absl::StatusCode::kDataLoss));
  }
  {
    v1::EncodedTensor c = t;
    c.mutable_buffers(1)->mutable_data()->pop_back();
    SealTensor(&c);
    EXPECT_THAT(ParseEncoded(c),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("BUFFER_SCALES")));
  }
  {
    v1::EncodedTensor c = t;
    c.mutable_params()->set_rank(3);
    SealTensor(&c);
    EXPECT_THAT(ParseEncoded(c), StatusIs(absl::StatusCode::kInvalidArgument));
  }
  {
    v1::EncodedTensor c = t;
    c.mutable_buffers()->SwapElements(1, 2);
    SealTensor(&c);
    EXPECT_THAT(Decode(c), StatusIs(absl::StatusCode::kInvalidArgument));
  }
  {
    v1::EncodedTensor c = t;
    const int idx = c.buffers_size() - 2;  // SPARSE_INDEX
    ASSERT_EQ(c.buffers(idx).kind(), v1::BUFFER_SPARSE_INDEX);
    std::string* d = c.mutable_buffers(idx)->mutable_data();
    (*d)[0] = static_cast<char>(0xff);
    (*d)[1] = static_cast<char>(0xff);
    SealTensor(&c);
    EXPECT_THAT(Decode(c),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sparse outlier")));
  }
}

// Random mutations of serialized tensors of every codec: decoding either
// fails with a status or succeeds; it never crashes or reads out of bounds
// (the ASan build runs this too).
TEST(CodecFormatTest, FuzzedTensorsNeverCrash) {
  std::mt19937 rng(99);
  const int64_t shape[] = {2, 37, 16};
  const std::vector<float> x = Random(2 * 37 * 16, 6);
  std::vector<std::string> seeds;
  for (const char* s :
       {"fp16", "kivi2:R=5", "kivi4:g=8", "kcvt8", "gear2:r=2:s=0.1", "gearl4:r=3:bb=kcvt"}) {
    KVT_ASSERT_OK_AND_ASSIGN(CodecConfig c, ParseCodecSetting(s));
    for (TensorRole role : {TensorRole::kKey, TensorRole::kValue}) {
      KVT_ASSERT_OK_AND_ASSIGN(v1::EncodedTensor t, Encode(c, role, shape, x.data()));
      seeds.push_back(t.SerializeAsString());
    }
  }
  int decoded = 0, rejected = 0;
  for (int iter = 0; iter < 4000; ++iter) {
    std::string b = seeds[iter % seeds.size()];
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t pos = rng() % b.size();
      switch (rng() % 3) {
        case 0:
          b[pos] = static_cast<char>(rng());
          break;
        case 1:
          b.erase(pos, 1 + rng() % 8);
          break;
        default:
          b.insert(pos, 1 + rng() % 4, static_cast<char>(rng()));
      }
      if (b.empty()) b = "x";
    }
    v1::EncodedTensor t;
    if (!t.ParseFromString(b)) continue;
    // Reseal half the time so the checks behind the CRC run too.
    if (iter % 2 == 0) SealTensor(&t);
    auto r = Decode(t);
    r.ok() ? ++decoded : ++rejected;
    if (r.ok()) {
      // A well-formed result also goes through attention without trouble.
      KVT_ASSERT_OK_AND_ASSIGN(EncodedView v, ParseEncoded(t));
      if (v.slabs == 2 && v.head_dim == 16 && t.role() == v1::TENSOR_ROLE_KEY) {
        const std::vector<float> q = Random(2 * 16, 1);
        std::vector<float> out(2 * 16);
        const std::vector<float> vals(static_cast<size_t>(2 * v.tokens * 16), 1.0f);
        KvBlock blk{
            v, EncodedView::Raw(DType::kFp32, vals.data(), 2, v.tokens, 16, v.tokens * 16, 16)};
        AttentionShape as{2, 2, 16};
        EXPECT_TRUE(DecodeAttention(as, q.data(), {&blk, 1}, out.data()).ok());
      }
    }
  }
  EXPECT_GT(rejected, 100);
}

// --- Attention ---

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

// Views of a serialized SegmentPayload read the tensors where they lie,
// whatever alignment protobuf's framing left their buffers at, and decode
// exactly as the parsed tensors do.
TEST(SplitPayloadTest, ViewsDecodeLikeParsedTensorsAtAnyAlignment) {
  std::mt19937 rng(21);
  std::normal_distribution<float> nd;
  const int64_t shape[3] = {1, 70, 64};
  std::vector<float> x(70 * 64);
  for (float& v : x) v = nd(rng);
  v1::SegmentPayload p;
  for (const char* setting : {"raw", "fp16", "kivi4", "kivi2:R=16", "kcvt4", "gear2", "gearl2"}) {
    KVT_ASSERT_OK_AND_ASSIGN(CodecConfig c, ParseCodecSetting(setting));
    for (TensorRole role : {TensorRole::kKey, TensorRole::kValue}) {
      KVT_ASSERT_OK_AND_ASSIGN(*p.add_tensors(), Encode(c, role, shape, x.data()));
    }
  }
  const std::string bytes = p.SerializeAsString();
  for (int shift = 0; shift < 4; ++shift) {
    // The payload at every offset from an aligned base.
    std::string buf(shift, 'x');
    buf += bytes;
    const std::string_view payload(buf.data() + shift, bytes.size());
    KVT_ASSERT_OK_AND_ASSIGN(std::vector<TensorParts> parts, SplitPayload(payload));
    ASSERT_EQ(parts.size(), static_cast<size_t>(p.tensors_size()));
    for (size_t i = 0; i < parts.size(); ++i) {
      EXPECT_EQ(parts[i].bytes.size(), p.tensors(static_cast<int>(i)).ByteSizeLong());
      KVT_ASSERT_OK_AND_ASSIGN(EncodedView view, ParseEncoded(parts[i]));
      KVT_ASSERT_OK_AND_ASSIGN(std::vector<float> want, Decode(p.tensors(static_cast<int>(i))));
      for (KernelLevel level : {KernelLevel::kReference, KernelLevel::kBest}) {
        std::vector<float> got(want.size());
        DecodeRows(view, 0, 0, view.tokens, got.data(), level);
        for (size_t j = 0; j < got.size(); ++j) {
          ASSERT_NEAR(got[j], want[j], 1e-5 * (1 + std::fabs(want[j]))) << i << " " << j;
        }
      }
    }
  }
}

TEST(SplitPayloadTest, RejectsBadBytesAndChecksumsOnRequest) {
  std::vector<float> x(8 * 16, 0.5f);
  const int64_t shape[3] = {1, 8, 16};
  KVT_ASSERT_OK_AND_ASSIGN(CodecConfig c, ParseCodecSetting("kivi4"));
  v1::SegmentPayload p;
  KVT_ASSERT_OK_AND_ASSIGN(*p.add_tensors(), Encode(c, TensorRole::kKey, shape, x.data()));
  std::string bytes = p.SerializeAsString();
  EXPECT_THAT(SplitPayload(std::string_view(bytes).substr(0, bytes.size() - 3)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  bytes[bytes.size() - 1] ^= 0x5a;  // A byte of the last buffer.
  EXPECT_THAT(SplitPayload(bytes).status(), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(SplitPayload(bytes, /*verify_crc=*/false).status(), IsOk());
}

}  // namespace
}  // namespace kvtier
