#include "model/matmul.h"

#include <atomic>
#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvtier::model {
namespace {

// Both paths this CPU can run agree with float64, and each gives the same
// bits for a token whatever the batch around it (Forward::Step vs Run).
TEST(MatMulTest, PathsAgreeAndBatchingDoesNotChangeBits) {
  std::mt19937 rng(5);
  std::normal_distribution<float> g;
  for (auto [rows, cols, n] : {std::tuple{37, 172, 9}, std::tuple{64, 640, 70}, {3, 5, 4}}) {
    std::vector<float> w(static_cast<size_t>(rows) * cols), x(static_cast<size_t>(n) * cols);
    for (float& v : w) v = g(rng);
    for (float& v : x) v = g(rng);
    for (KernelLevel level : {KernelLevel::kReference, KernelLevel::kBest}) {
      SCOPED_TRACE(level == KernelLevel::kBest ? VectorIsaName() : "scalar");
      std::vector<float> all(static_cast<size_t>(n) * rows), one(rows);
      MatMul(x.data(), n, w.data(), rows, cols, all.data(), level);
      for (int t = 0; t < n; ++t) {
        MatMul(x.data() + static_cast<size_t>(t) * cols, 1, w.data(), rows, cols, one.data(),
               level);
        for (int r = 0; r < rows; ++r) {
          ASSERT_EQ(one[r], all[static_cast<size_t>(t) * rows + r]) << t << " " << r;
          double want = 0;
          for (int j = 0; j < cols; ++j) {
            want += static_cast<double>(w[static_cast<size_t>(r) * cols + j]) *
                    x[static_cast<size_t>(t) * cols + j];
          }
          ASSERT_NEAR(one[r], want, 1e-4 * std::sqrt(static_cast<double>(cols)));
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvtier::model

namespace kvtier::model {
namespace {

// Rows split over a pool of threads give the bits of one thread, float32
// and 8-bit codes alike.
TEST(MatMulTest, ThreadsDoNotChangeBits) {
  std::mt19937 rng(9);
  std::normal_distribution<float> g;
  const int rows = 1000, cols = 256, n = 5;
  std::vector<float> w(static_cast<size_t>(rows) * cols), x(static_cast<size_t>(n) * cols);
  for (float& v : w) v = g(rng);
  for (float& v : x) v = g(rng);
  ThreadPool pool(3);
  std::vector<float> one(static_cast<size_t>(n) * rows), three(one.size());
  MatMul(x.data(), n, w.data(), rows, cols, one.data());
  for (int rep = 0; rep < 20; ++rep) {
    std::fill(three.begin(), three.end(), 0.0f);
    MatMul(x.data(), n, w.data(), rows, cols, three.data(), KernelLevel::kBest, &pool);
    ASSERT_EQ(one, three);
  }
  // Every index of a loop runs exactly once, whatever the count.
  for (int count : {0, 1, 2, 7, 64}) {
    std::vector<std::atomic<int>> hits(count);
    pool.ParallelFor(count, [&](int i) { hits[i].fetch_add(1); });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  }
}

}  // namespace
}  // namespace kvtier::model
