// The worker engine tests' fixture: an engine with the reference kernels
// over an in-memory store (worker/memory_store.h), a small fp16 model, its
// random inputs, and the full-attention ground truth to compare rounds with.
#ifndef KVTIER_TESTS_UTIL_ENGINE_FIXTURE_H_
#define KVTIER_TESTS_UTIL_ENGINE_FIXTURE_H_

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/half.h"
#include "kernels/recall.h"
#include "tests/util/status_matchers.h"
#include "worker/engine.h"
#include "worker/memory_store.h"
#include "worker/transfer.h"

namespace kvtier::engine_test {

using worker::Engine;
using worker::ModelShape;

// The hand-off half of an engine's API (worker/transfer.h).
inline worker::SessionTransfer Handoff(Engine& e) { return worker::SessionTransfer(&e); }

// Engine options with the reference (float64) kernels, everything else at
// its default.
inline worker::EngineOptions ReferenceKernels() {
  worker::EngineOptions o;
  o.level = KernelLevel::kReference;
  return o;
}

inline const worker::ModelShape kShape{
    .layers = 4, .q_heads = 4, .kv_heads = 2, .head_dim = 16, .dtype = DType::kFp16, .window = {}};

inline std::vector<float> Random(size_t n, std::mt19937* rng, float bias_dim = -1) {
  std::normal_distribution<float> nd;
  std::vector<float> x(n);
  // Values of the model's dtype (fp16), which the open round holds exactly.
  for (size_t i = 0; i < n; ++i)
    x[i] = HalfToFloat(FloatToHalf(nd(*rng) + (static_cast<int>(i % 16) == bias_dim ? 2.f : 0.f)));
  return x;
}

// Full attention over a whole token-major history, within each layer's
// sliding window where it has one: the ground truth.
class LocalCache {
 public:
  explicit LocalCache(const ModelShape& s) : s_(s), k_(s.layers), v_(s.layers) {}
  // n new tokens at `layer`: appends k/v, writes out.
  void Layer(int layer, int64_t n, const float* q, const float* k, const float* v, float* out) {
    const int d = s_.head_dim, kvr = s_.kv_heads * d, qr = s_.q_heads * d;
    const int64_t base = static_cast<int64_t>(k_[layer].size()) / kvr;
    k_[layer].insert(k_[layer].end(), k, k + n * kvr);
    v_[layer].insert(v_[layer].end(), v, v + n * kvr);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = base + i + 1;
      const int w = s_.layer_window(layer);
      const int64_t from = w > 0 ? std::max<int64_t>(0, t - w) : 0;
      const KvBlock b{EncodedView::Raw(DType::kFp32, k_[layer].data() + from * kvr, s_.kv_heads,
                                       t - from, d, d, kvr),
                      EncodedView::Raw(DType::kFp32, v_[layer].data() + from * kvr, s_.kv_heads,
                                       t - from, d, d, kvr)};
      ASSERT_TRUE(DecodeAttention({s_.q_heads, s_.kv_heads, d}, q + i * qr, {&b, 1}, out + i * qr,
                                  KernelLevel::kReference)
                      .ok());
    }
  }

 private:
  ModelShape s_;
  std::vector<std::vector<float>> k_, v_;
};

class WorkerEngineTest : public ::testing::Test {
 protected:
  void SetUp() override { engine_ = std::make_unique<Engine>(&store_, ReferenceKernels()); }

  // Opens session "s" recalling every round at L_w = 1 and stores `rounds`
  // rounds (released from the working set after EndRound, so a recall
  // fetches them). Fails the test (ASSERT) on an error.
  void StoredRounds(int rounds, std::mt19937* rng) {
    worker::SessionPolicy p;
    KVT_ASSERT_OK_AND_ASSIGN(p.recall, ParseRecall("all"));
    p.watershed_layer = 1;
    KVT_ASSERT_OK(engine_->OpenSession("s", kShape, p));
    for (int r = 0; r < rounds; ++r) {
      Round("s", 6, 2, 0, rng, nullptr);
      KVT_ASSERT_OK(engine_->EndRound("s").status());
    }
  }

  // One round: prefill of n tokens (question_tokens of them the question),
  // then `decode` single-token steps, each through every layer, compared with
  // the local cache when `local` is set. Returns the max abs difference.
  // `per_layer`, when set, gets each layer's max abs difference too.
  double Round(const std::string& id, int64_t n, int64_t question, int decode, std::mt19937* rng,
               LocalCache* local, int topic = -1, Engine* engine = nullptr,
               std::vector<double>* per_layer = nullptr) {
    const ModelShape& s = shape_;
    if (engine == nullptr) engine = engine_.get();
    const int d = s.head_dim;
    double worst = 0;
    auto step = [&](int64_t m, bool prefill) {
      for (int l = 0; l < s.layers; ++l) {
        const auto q = Random(m * s.q_heads * d, rng, topic),
                   k = Random(m * s.kv_heads * d, rng, topic), v = Random(m * s.kv_heads * d, rng);
        std::vector<float> out(q.size()), ref(q.size());
        if (prefill) {
          auto r =
              engine->PrefillLayer(id, l, m, question, q.data(), k.data(), v.data(), out.data());
          EXPECT_TRUE(r.ok()) << r.status();
        } else {
          EXPECT_TRUE(engine->DecodeLayer(id, l, q.data(), k.data(), v.data(), out.data()).ok());
        }
        if (local != nullptr) {
          local->Layer(l, m, q.data(), k.data(), v.data(), ref.data());
          for (size_t i = 0; i < out.size(); ++i) {
            const double e = std::fabs(double(out[i]) - ref[i]);
            worst = std::max(worst, e);
            if (per_layer != nullptr) {
              per_layer->resize(s.layers);
              (*per_layer)[l] = std::max((*per_layer)[l], e);
            }
          }
        }
      }
    };
    step(n, true);
    for (int i = 0; i < decode; ++i) step(1, false);
    return worst;
  }

  ModelShape shape_ = kShape;  // Round's shape.
  // The store outlives every engine over it.
  worker::MemorySegmentStore store_;
  std::unique_ptr<Engine> engine_;
};

}  // namespace kvtier::engine_test

#endif  // KVTIER_TESTS_UTIL_ENGINE_FIXTURE_H_
