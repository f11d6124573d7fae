// The device working set's byte layout, on the host: a tensor encoded by the
// CPU codec, staged as UploadLayer stages it, and read with the very element
// loads the GPU kernel uses (kernels/cuda/seg_load.h) must decode to what
// DecodeRows gives, for every codec the device path reads, K and V, with and
// without residual rows. Runs on every machine; the GPU test
// (tests/worker_device_test.cc) covers the rest of the device path.
#include "worker/device_layout.h"

#include <cmath>
#include <random>
#include <string>

#include "gtest/gtest.h"
#include "kernels/cuda/seg_load.h"
#include "tests/util/status_matchers.h"

namespace kvtier::worker {
namespace {

using ::kvtier::testing::StatusIs;

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = nd(rng) + (i % 7 == 0 ? 4.0f : 0.0f);  // Outlier channels.
  return x;
}

TEST(DeviceLayoutTest, StagedTensorsDecodeLikeTheCpuCodec) {
  const char* settings[] = {"fp32",
                            "raw",
                            "bf16",
                            "kivi2",
                            "kivi4",
                            "kivi8",
                            "kcvt4",
                            "kcvt2:R=5",
                            "kivi4:g=16:R=8",
                            "kivi2:g=64",
                            "kivi8:dt=bf16:R=3"};
  int cases = 0;
  for (const char* setting : settings) {
    KVT_ASSERT_OK_AND_ASSIGN(CodecConfig codec, ParseCodecSetting(setting));
    for (int d : {8, 64, 128}) {
      for (int64_t t : {1, 7, 33, 64, 100}) {
        for (v1::TensorRole role : {v1::TENSOR_ROLE_KEY, v1::TENSOR_ROLE_VALUE}) {
          SCOPED_TRACE(std::string(setting) + " d=" + std::to_string(d) +
                       " t=" + std::to_string(t) + (role == v1::TENSOR_ROLE_KEY ? " K" : " V"));
          const std::vector<float> x = Random(static_cast<size_t>(t) * d, t * 131 + d);
          const int64_t shape[3] = {1, t, d};
          KVT_ASSERT_OK_AND_ASSIGN(v1::EncodedTensor enc,
                                   Encode(codec, role, shape, x.data(), KernelLevel::kReference));
          KVT_ASSERT_OK_AND_ASSIGN(EncodedView view, ParseEncoded(enc));
          std::vector<float> want(x.size());
          DecodeRows(view, 0, 0, t, want.data(), KernelLevel::kReference);
          // Something staged before it, so offsets are not all zero.
          std::vector<uint8_t> host(3, 0xab);
          KVT_ASSERT_OK_AND_ASSIGN(StagedKv staged, StageView(view, d, &host));
          const cuda::SegKv kv = PlaceStaged(staged, host.data());
          double worst = 0;
          for (int64_t i = 0; i < t; ++i) {
            for (int c = 0; c < d; ++c) {
              const float got = cuda::SegLoad(kv, d, i, c);
              worst = std::max(worst, std::fabs(double(got) - want[i * d + c]) /
                                          (1e-6 + std::fabs(double(want[i * d + c]))));
            }
          }
          EXPECT_LT(worst, 1e-6);
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 11 * 3 * 5 * 2);
}

TEST(DeviceLayoutTest, GearAndMisshapenTensorsAreRefused) {
  const std::vector<float> x = Random(40 * 64, 1);
  const int64_t shape[3] = {1, 40, 64};
  KVT_ASSERT_OK_AND_ASSIGN(CodecConfig gear, ParseCodecSetting("gear2"));
  KVT_ASSERT_OK_AND_ASSIGN(v1::EncodedTensor enc, Encode(gear, v1::TENSOR_ROLE_KEY, shape, x.data(),
                                                         KernelLevel::kReference));
  KVT_ASSERT_OK_AND_ASSIGN(EncodedView view, ParseEncoded(enc));
  std::vector<uint8_t> host;
  EXPECT_THAT(StageView(view, 64, &host), StatusIs(absl::StatusCode::kUnimplemented));
  KVT_ASSERT_OK_AND_ASSIGN(CodecConfig kivi, ParseCodecSetting("kivi4"));
  KVT_ASSERT_OK_AND_ASSIGN(
      enc, Encode(kivi, v1::TENSOR_ROLE_KEY, shape, x.data(), KernelLevel::kReference));
  KVT_ASSERT_OK_AND_ASSIGN(view, ParseEncoded(enc));
  EXPECT_THAT(StageView(view, 128, &host), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace kvtier::worker
