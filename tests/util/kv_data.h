// Random K/V data for the kernel tests: Gaussian values, and the large
// outlier channels real keys have.
#ifndef KVTIER_TESTS_UTIL_KV_DATA_H_
#define KVTIER_TESTS_UTIL_KV_DATA_H_

#include <cstdint>
#include <random>
#include <vector>

namespace kvtier::testing {

inline std::vector<float> Random(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = nd(rng);
  return x;
}

// Adds a few large-magnitude channels, as real keys have.
inline void AddOutlierChannels(std::vector<float>* x, int d) {
  for (size_t i = 0; i < x->size(); ++i) {
    if (i % d == 3 || i % d == 5) (*x)[i] = (*x)[i] * 8.0f + 4.0f;
  }
}

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_UTIL_KV_DATA_H_
