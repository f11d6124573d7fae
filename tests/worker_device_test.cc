// The GPU working set (label gpu): a device session and a host session get
// the same rounds, and every layer's attention output must agree, for each
// codec the device path reads, with eviction, with recall fetching upper
// segments from a real kvtier-store and with rounds kept resident. Without a
// CUDA device (or without CUDA in the build) it skips with a message; the
// placement rules themselves are checked either way.
#include <cmath>
#include <random>

#include "client/store_segments.h"
#include "gtest/gtest.h"
#include "kernels/half.h"
#include "tests/util/status_matchers.h"
#include "tests/util/worker_stack.h"
#include "worker/device_attention.h"
#include "worker/engine.h"

namespace kvtier {
namespace {

using ::kvtier::testing::IsOk;
using ::kvtier::testing::StatusIs;
using worker::Engine;
using worker::EngineOptions;
using worker::ModelShape;
using worker::SessionPolicy;
using Placement = worker::EngineOptions::Placement;
#define KVT_ASSERT_OK(expr) ASSERT_THAT((expr), IsOk())

constexpr ModelShape kShape{6, 8, 2, 64, v1::DTYPE_FP16};

#define SKIP_WITHOUT_GPU()                                                         \
  if (absl::Status st_ = worker::DeviceStatus(); !st_.ok()) {                      \
    GTEST_SKIP() << "GPU working-set tests need a CUDA device: " << st_.message(); \
  }

class WorkerDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVT_ASSERT_OK(stack_.Start());
    segments_ = stack_.segments();
    EngineOptions host_opts, dev_opts;
    host_opts.placement = Placement::kHost;
    dev_opts.placement = Placement::kDevice;
    host_ = std::make_unique<Engine>(segments_, host_opts);
    device_ = std::make_unique<Engine>(segments_, dev_opts);
  }

  // Runs `rounds` rounds (prefill of a topical question plus answer, then
  // decode steps) through both engines and returns the largest output
  // difference relative to the host output's scale.
  double RunBoth(const SessionPolicy& p, const std::string& tag, int rounds) {
    const std::string hs = "host-" + tag, ds = "dev-" + tag;
    EXPECT_THAT(host_->OpenSession(hs, kShape, p), IsOk());
    EXPECT_THAT(device_->OpenSession(ds, kShape, p), IsOk());
    std::mt19937 rng(42);
    std::normal_distribution<float> nd;
    const int d = kShape.head_dim;
    double worst = 0;
    auto layer = [&](int l, int64_t n, bool prefill, int topic) {
      std::vector<float> q(n * kShape.q_heads * d), k(n * kShape.kv_heads * d), v(k.size());
      for (size_t i = 0; i < q.size(); ++i) q[i] = nd(rng) + (int(i % d) == topic ? 3.f : 0.f);
      for (size_t i = 0; i < k.size(); ++i) k[i] = nd(rng) + (int(i % d) == topic ? 3.f : 0.f);
      for (float& x : v) x = nd(rng);
      // Values of the model's dtype (fp16): the host's open round holds
      // them exactly, as the device's (fp32) does.
      for (float& x : k) x = HalfToFloat(FloatToHalf(x));
      for (float& x : v) x = HalfToFloat(FloatToHalf(x));
      std::vector<float> ho(q.size()), dout(q.size());
      if (prefill) {
        auto a = host_->PrefillLayer(hs, l, n, n / 2, q.data(), k.data(), v.data(), ho.data());
        auto b = device_->PrefillLayer(ds, l, n, n / 2, q.data(), k.data(), v.data(), dout.data());
        EXPECT_TRUE(a.ok()) << a.status();
        EXPECT_TRUE(b.ok()) << b.status();
        if (a.ok() && b.ok() && a->has_value()) {
          EXPECT_TRUE(b->has_value());
          if (b->has_value()) {
            EXPECT_EQ((*a)->selected, (*b)->selected) << "layer " << l;
          }
        }
      } else {
        EXPECT_THAT(host_->DecodeLayer(hs, l, q.data(), k.data(), v.data(), ho.data()), IsOk());
        EXPECT_THAT(device_->DecodeLayer(ds, l, q.data(), k.data(), v.data(), dout.data()), IsOk());
      }
      double scale = 1e-6;
      for (float x : ho) scale = std::max(scale, double(std::fabs(x)));
      for (size_t i = 0; i < ho.size(); ++i)
        worst = std::max(worst, std::fabs(double(ho[i]) - dout[i]) / scale);
    };
    for (int r = 0; r < rounds; ++r) {
      const int topic = (r * 7) % d;
      for (int l = 0; l < kShape.layers; ++l) layer(l, 9 + r, true, topic);
      for (int t = 0; t < 3; ++t) {
        for (int l = 0; l < kShape.layers; ++l) layer(l, 1, false, -1);
      }
      auto he = host_->EndRound(hs);
      auto de = device_->EndRound(ds);
      EXPECT_TRUE(he.ok()) << he.status();
      EXPECT_TRUE(de.ok()) << de.status();
      if (he.ok() && de.ok()) {
        EXPECT_EQ(he->stored_bytes, de->stored_bytes);
        EXPECT_EQ(he->working_set_bytes, de->working_set_bytes);
      }
    }
    auto hst = host_->Stats(hs);
    auto dst = device_->Stats(ds);
    EXPECT_TRUE(hst.ok() && dst.ok());
    if (hst.ok() && dst.ok()) {
      EXPECT_FALSE(hst->on_device);
      EXPECT_TRUE(dst->on_device);
      EXPECT_EQ(hst->device_bytes, 0u);
      EXPECT_GT(dst->device_bytes, 0u);
      EXPECT_EQ(hst->working_set_bytes, dst->working_set_bytes);
    }
    EXPECT_THAT(host_->CloseSession(hs, true), IsOk());
    EXPECT_THAT(device_->CloseSession(ds, true), IsOk());
    return worst;
  }

  testing::StoreStack stack_;
  StoreSegments* segments_ = nullptr;
  std::unique_ptr<Engine> host_, device_;
};

TEST_F(WorkerDeviceTest, PlacementFollowsTheBuildAndTheDevice) {
  SessionPolicy p;
  if (!worker::DeviceUsable()) {
    // kAuto falls back to host memory; kDevice says why it cannot.
    Engine automatic(segments_);
    KVT_ASSERT_OK(automatic.OpenSession("a", kShape, p));
    KVT_ASSERT_OK_AND_ASSIGN(auto st, automatic.Stats("a"));
    EXPECT_FALSE(st.on_device);
    EXPECT_THAT(device_->OpenSession("d", kShape, p),
                StatusIs(absl::StatusCode::kFailedPrecondition));
    return;
  }
  Engine automatic(segments_);
  KVT_ASSERT_OK(automatic.OpenSession("a", kShape, p));
  KVT_ASSERT_OK_AND_ASSIGN(auto st, automatic.Stats("a"));
  EXPECT_TRUE(st.on_device);
  // GEAR is not read on the device: kAuto keeps it on the host, kDevice refuses.
  KVT_ASSERT_OK_AND_ASSIGN(p.codec, ParseCodecSetting("gear2"));
  KVT_ASSERT_OK(automatic.OpenSession("g", kShape, p));
  KVT_ASSERT_OK_AND_ASSIGN(st, automatic.Stats("g"));
  EXPECT_FALSE(st.on_device);
  EXPECT_THAT(device_->OpenSession("g", kShape, p),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(WorkerDeviceTest, DeviceAttentionMatchesHostForEveryCodec) {
  SKIP_WITHOUT_GPU();
  struct Case {
    const char* codec;
    const char* recall;
    bool release;
    const char* evict;
  };
  const Case cases[] = {
      {"fp32", "all", true, nullptr},
      {"raw", "topk:2", true, nullptr},
      {"bf16", "topk:2", false, nullptr},
      {"kivi4", "adaptive:1", true, nullptr},
      {"kivi2:g=16:R=8", "all", false, nullptr},
      {"kcvt4", "topk:1", true, nullptr},
      {"kivi8", "topk:2", true, "snapkv:12:w=4"},
  };
  int i = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.codec) + " " + c.recall);
    SessionPolicy p;
    KVT_ASSERT_OK_AND_ASSIGN(p.codec, ParseCodecSetting(c.codec));
    KVT_ASSERT_OK_AND_ASSIGN(p.recall, ParseRecall(c.recall));
    p.watershed_layer = 2;
    p.release_after_end_round = c.release;
    if (c.evict != nullptr) {
      KVT_ASSERT_OK_AND_ASSIGN(p.eviction, evict::ParsePolicy(c.evict));
    }
    // Both sessions decode the same bytes, so only summation order differs.
    EXPECT_LT(RunBoth(p, std::to_string(i++), 5), 2e-4);
  }
}

}  // namespace
}  // namespace kvtier
