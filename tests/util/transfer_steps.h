// What the hand-off tests share: a small fp16 model (4 layers, 4 query and
// 2 KV heads of 16), one step's random inputs for every layer, running a
// step on an engine, bit-exact comparison, and the engine's hand-off half.
#ifndef KVTIER_TESTS_UTIL_TRANSFER_STEPS_H_
#define KVTIER_TESTS_UTIL_TRANSFER_STEPS_H_

#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/half.h"
#include "worker/engine.h"
#include "worker/transfer.h"

namespace kvtier::testing {

// The hand-off half of an engine's API (worker/transfer.h).
inline worker::SessionTransfer Handoff(worker::Engine& e) { return worker::SessionTransfer(&e); }

inline constexpr worker::ModelShape kShape{4, 4, 2, 16, DType::kFp16};

// One step's inputs for every layer.
struct Step {
  int64_t n = 0;
  std::vector<std::vector<float>> q, k, v;
};

inline Step MakeStep(int64_t n, std::mt19937* rng) {
  std::normal_distribution<float> nd;
  auto draw = [&](int64_t count) {
    std::vector<float> x(static_cast<size_t>(count));
    for (float& e : x) e = HalfToFloat(FloatToHalf(nd(*rng)));
    return x;
  };
  Step s;
  s.n = n;
  for (int l = 0; l < kShape.layers; ++l) {
    s.q.push_back(draw(n * kShape.q_heads * kShape.head_dim));
    s.k.push_back(draw(n * kShape.kv_heads * kShape.head_dim));
    s.v.push_back(draw(n * kShape.kv_heads * kShape.head_dim));
  }
  return s;
}

// Runs `step` on `e`; `after_layer(l)` runs after each layer. Returns the
// outputs of every layer, concatenated.
inline std::vector<float> RunStep(worker::Engine& e, const std::string& id, const Step& step,
                                  bool prefill,
                                  const std::function<void(int)>& after_layer = nullptr) {
  std::vector<float> all;
  for (int l = 0; l < kShape.layers; ++l) {
    std::vector<float> out(step.q[l].size());
    if (prefill) {
      auto r = e.PrefillLayer(id, l, step.n, 0, step.q[l].data(), step.k[l].data(),
                              step.v[l].data(), out.data());
      EXPECT_TRUE(r.ok()) << r.status();
    } else {
      absl::Status st =
          e.DecodeLayer(id, l, step.q[l].data(), step.k[l].data(), step.v[l].data(), out.data());
      EXPECT_TRUE(st.ok()) << st;
    }
    all.insert(all.end(), out.begin(), out.end());
    if (after_layer) after_layer(l);
  }
  return all;
}

inline bool Same(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_UTIL_TRANSFER_STEPS_H_
