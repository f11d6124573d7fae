#include "model/qmatrix.h"

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/half.h"

namespace kvtier::model {
namespace {

const GgmlType kTypes[] = {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0,
                           GgmlType::kQ5_1, GgmlType::kQ8_0, GgmlType::kQ2_K,
                           GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K};

// Random rows of type t: random codes, finite fp16 scales.
std::string Rows(GgmlType t, int rows, int cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(static_cast<size_t>(RowBytes(t, cols) * rows), '\0');
  for (char& c : s) c = static_cast<char>(rng());
  std::vector<int> halves;
  switch (t) {
    case GgmlType::kQ4_0:
    case GgmlType::kQ5_0:
    case GgmlType::kQ8_0:
      halves = {0};
      break;
    case GgmlType::kQ2_K:
      halves = {80, 82};
      break;
    case GgmlType::kQ6_K:
      halves = {208};
      break;
    default:
      halves = {0, 2};
  }
  std::uniform_real_distribution<float> u(-0.05f, 0.05f);
  for (size_t b = 0; b < s.size() / BlockBytes(t); ++b) {
    for (int off : halves) {
      const uint16_t h = FloatToHalf(u(rng));
      std::memcpy(&s[b * BlockBytes(t) + off], &h, 2);
    }
  }
  return s;
}

// The codes hold every weight exactly: s * q + b is DequantizeRow's value.
TEST(QMatrixTest, HoldsEveryTypeExactly) {
  for (GgmlType t : kTypes) {
    SCOPED_TRACE(GgmlTypeName(static_cast<uint32_t>(t)));
    const int rows = 3, cols = 512;
    const std::string bytes = Rows(t, rows, cols, 11);
    const QMatrix m = ToQMatrix(t, bytes.data(), rows, cols);
    std::vector<float> want(cols), got(cols);
    for (int r = 0; r < rows; ++r) {
      DequantizeRow(t, bytes.data() + RowBytes(t, cols) * r, want.data(), cols);
      m.Row(r, got.data());
      for (int i = 0; i < cols; ++i) ASSERT_EQ(got[i], want[i]) << "row " << r << " weight " << i;
    }
  }
}

// Both paths agree with float64 over the dequantized weights, and batching
// does not change a token's bits.
TEST(QMatrixTest, MulAgreesWithDequantizedProductsOnEveryPath) {
  std::mt19937 rng(3);
  std::normal_distribution<float> g;
  for (GgmlType t : kTypes) {
    SCOPED_TRACE(GgmlTypeName(static_cast<uint32_t>(t)));
    const int rows = 5, cols = 768, n = 6;
    const std::string bytes = Rows(t, rows, cols, 17);
    const QMatrix m = ToQMatrix(t, bytes.data(), rows, cols);
    std::vector<float> x(static_cast<size_t>(n) * cols), w(cols);
    for (float& v : x) v = g(rng);
    for (KernelLevel level : {KernelLevel::kReference, KernelLevel::kBest}) {
      std::vector<float> all(static_cast<size_t>(n) * rows), one(rows);
      QMatMul(x.data(), n, m, all.data(), level);
      for (int tok = 0; tok < n; ++tok) {
        QMatMul(x.data() + static_cast<size_t>(tok) * cols, 1, m, one.data(), level);
        for (int r = 0; r < rows; ++r) {
          ASSERT_EQ(one[r], all[static_cast<size_t>(tok) * rows + r]);
          m.Row(r, w.data());
          double want = 0, mag = 0;
          for (int j = 0; j < cols; ++j) {
            want += static_cast<double>(w[j]) * x[static_cast<size_t>(tok) * cols + j];
            mag += std::fabs(static_cast<double>(w[j]) * x[static_cast<size_t>(tok) * cols + j]);
          }
          ASSERT_NEAR(one[r], want, 1e-5 * mag + 1e-6) << "row " << r;
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvtier::model
