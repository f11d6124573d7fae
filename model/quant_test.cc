#include "model/quant.h"

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/half.h"

namespace kvtier::model {
namespace {

const GgmlType kTypes[] = {GgmlType::kF32,  GgmlType::kF16,  GgmlType::kBF16, GgmlType::kQ4_0,
                           GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kQ8_0,
                           GgmlType::kQ2_K, GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K};

// Byte offsets of each block's fp16 scale fields.
std::vector<int> HalfFields(GgmlType t) {
  switch (t) {
    case GgmlType::kQ4_0:
    case GgmlType::kQ5_0:
    case GgmlType::kQ8_0:
      return {0};
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_1:
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
      return {0, 2};
    case GgmlType::kQ2_K:
      return {80, 82};
    case GgmlType::kQ6_K:
      return {208};
    default:
      return {};
  }
}

// A row of n weights of type t: random code bytes, finite random scales.
std::string RandomRow(GgmlType t, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::string row(static_cast<size_t>(RowBytes(t, n)), '\0');
  for (char& c : row) c = static_cast<char>(rng());
  auto put16 = [&](size_t at, uint16_t h) { std::memcpy(&row[at], &h, 2); };
  if (t == GgmlType::kF32) {
    for (int64_t i = 0; i < n; ++i) {
      const float f = u(rng);
      std::memcpy(&row[4 * i], &f, 4);
    }
  } else if (t == GgmlType::kF16) {
    for (int64_t i = 0; i < n; ++i) put16(2 * i, FloatToHalf(u(rng)));
  } else if (t == GgmlType::kBF16) {
    for (int64_t i = 0; i < n; ++i) put16(2 * i, FloatToBf16(u(rng)));
  } else {
    for (int64_t b = 0; b < n / BlockWeights(t); ++b) {
      for (int off : HalfFields(t)) put16(b * BlockBytes(t) + off, FloatToHalf(u(rng) * 0.05f));
    }
  }
  return row;
}

TEST(QuantTest, EveryTypeAgreesWithItsFloat64Reference) {
  for (GgmlType t : kTypes) {
    SCOPED_TRACE(GgmlTypeName(static_cast<uint32_t>(t)));
    const int64_t n = 4 * 256;
    const std::string row = RandomRow(t, n, static_cast<uint64_t>(t) + 7);
    std::vector<float> got(n);
    std::vector<double> want(n);
    DequantizeRow(t, row.data(), got.data(), n);
    DequantizeRowReference(t, row.data(), want.data(), n);
    double scale = 0;
    for (double w : want) scale = std::max(scale, std::abs(w));
    ASSERT_GT(scale, 0);
    int distinct = 0;
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(got[i], want[i], 1e-6 * scale) << "weight " << i;
      distinct += i > 0 && want[i] != want[i - 1];
    }
    EXPECT_GT(distinct, n / 4);  // Not a row of one value.
  }
}

TEST(QuantTest, KnownBlocks) {
  // Q8_0: d = 0.5, codes -3 and 5.
  std::string q8(34, '\0');
  uint16_t d = FloatToHalf(0.5f);
  std::memcpy(&q8[0], &d, 2);
  q8[2] = static_cast<char>(-3);
  q8[3] = 5;
  std::vector<float> y(32);
  DequantizeRow(GgmlType::kQ8_0, q8.data(), y.data(), 32);
  EXPECT_EQ(y[0], -1.5f);
  EXPECT_EQ(y[1], 2.5f);
  EXPECT_EQ(y[2], 0.0f);

  // Q4_0: d = 2, byte 0 = 0x9A: weight 0 is (0xA - 8) * 2 = 4, weight 16 is
  // (0x9 - 8) * 2 = 2; every other code 0 gives -16.
  std::string q4(18, '\0');
  d = FloatToHalf(2.0f);
  std::memcpy(&q4[0], &d, 2);
  q4[2] = static_cast<char>(0x9A);
  DequantizeRow(GgmlType::kQ4_0, q4.data(), y.data(), 32);
  EXPECT_EQ(y[0], 4.0f);
  EXPECT_EQ(y[16], 2.0f);
  EXPECT_EQ(y[1], -16.0f);

  // Q4_K: d = 1, dmin = 0.5; sub-block 0 scale 3, min 2; sub-block 5
  // scale 1 | (1 << 4) = 17 through the high bits, min 0. Code of weight 0
  // is 7: 3 * 7 - 0.5 * 2 = 20.
  std::string q4k(144, '\0');
  d = FloatToHalf(1.0f);
  uint16_t dmin = FloatToHalf(0.5f);
  std::memcpy(&q4k[0], &d, 2);
  std::memcpy(&q4k[2], &dmin, 2);
  uint8_t* sc = reinterpret_cast<uint8_t*>(&q4k[4]);
  sc[0] = 3;
  sc[4] = 2;
  sc[9] = 1;            // Sub-block 5: low 4 bits of its scale.
  sc[1] |= 1u << 6;     // ... and bits 4-5 from byte 1's top bits.
  q4k[16] = 7;          // Weight 0 (low nibble of byte 0 of pair 0).
  q4k[16 + 64] = 0x20;  // Weight 160 + 0 (pair 2, high nibble = 2): sub-block 5.
  std::vector<float> yk(256);
  DequantizeRow(GgmlType::kQ4_K, q4k.data(), yk.data(), 256);
  EXPECT_EQ(yk[0], 20.0f);
  EXPECT_EQ(yk[160], 34.0f);  // 17 * 2.
  EXPECT_EQ(yk[1], -1.0f);    // Code 0: -dmin * min.
}

TEST(QuantTest, SizesAndNames) {
  EXPECT_EQ(RowBytes(GgmlType::kQ4_K, 512), 288);
  EXPECT_EQ(RowBytes(GgmlType::kQ6_K, 256), 210);
  EXPECT_EQ(RowBytes(GgmlType::kQ8_0, 640), 680);
  EXPECT_STREQ(GgmlTypeName(14), "Q6_K");
  EXPECT_STREQ(GgmlTypeName(16), "IQ2_XXS");
  EXPECT_FALSE(GgmlTypeSupported(16));
  EXPECT_FALSE(GgmlTypeSupported(4));  // Removed from ggml (Q4_2).
  EXPECT_TRUE(GgmlTypeSupported(30));
}

}  // namespace
}  // namespace kvtier::model
