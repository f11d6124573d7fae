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
#include "kernels/encoded_tensor.h"
#include "kernels/half.h"
#include "tests/util/status_matchers.h"
#include "worker/session.h"

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

// Every codec setting the device path reads, with and without residual rows.
constexpr const char* kSettings[] = {"fp32",
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

TEST(DeviceLayoutTest, StagedTensorsDecodeLikeTheCpuCodec) {
  int cases = 0;
  for (const char* setting : kSettings) {
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

// A hand-off of a device working set reads each layer's staged array back
// and rebuilds the serialized tensors from it and the bytes kept on the
// host: byte for byte the tensors that were staged, for every codec the
// device path reads. A rebuilt tensor whose region lies outside the staged
// array is refused.
TEST(DeviceLayoutTest, UnstagingRebuildsTheSerializedTensorExactly) {
  int cases = 0;
  for (const char* setting : kSettings) {
    KVT_ASSERT_OK_AND_ASSIGN(CodecConfig codec, ParseCodecSetting(setting));
    for (int64_t t : {1, 33, 100}) {
      const int d = 64;
      SCOPED_TRACE(std::string(setting) + " t=" + std::to_string(t));
      // K and V of one head in a segment payload, as a RoundLayer holds them.
      v1::SegmentPayload payload;
      const int64_t shape[3] = {1, t, d};
      for (v1::TensorRole role : {v1::TENSOR_ROLE_KEY, v1::TENSOR_ROLE_VALUE}) {
        const std::vector<float> x = Random(static_cast<size_t>(t) * d, t * 17 + role);
        KVT_ASSERT_OK_AND_ASSIGN(*payload.add_tensors(),
                                 Encode(codec, role, shape, x.data(), KernelLevel::kReference));
      }
      const std::string bytes = payload.SerializeAsString();
      KVT_ASSERT_OK_AND_ASSIGN(std::vector<TensorParts> parts, SplitPayload(bytes));
      ASSERT_EQ(parts.size(), 2u);
      std::vector<uint8_t> host(5, 0xcd);
      std::vector<Unstaging> plans;
      for (const TensorParts& tp : parts) {
        KVT_ASSERT_OK_AND_ASSIGN(EncodedView view, ParseEncoded(tp));
        KVT_ASSERT_OK_AND_ASSIGN(StagedKv staged, StageView(view, d, &host));
        KVT_ASSERT_OK_AND_ASSIGN(Unstaging u, PlanUnstaging(tp.bytes, staged));
        EXPECT_EQ(u.bytes(), tp.bytes.size());
        EXPECT_LT(u.rest.size(), 256u);  // Metadata and framing only.
        plans.push_back(std::move(u));
      }
      // What a download gives: the staged array, here a copy of it.
      const std::vector<uint8_t> downloaded = host;
      for (size_t i = 0; i < parts.size(); ++i) {
        std::string rebuilt = "x";
        ASSERT_THAT(Unstage(plans[i], downloaded.data(), downloaded.size(), &rebuilt),
                    ::kvtier::testing::IsOk());
        EXPECT_EQ(rebuilt.substr(1), parts[i].bytes);
        std::string truncated;
        EXPECT_THAT(Unstage(plans[i], downloaded.data(), 100, &truncated),
                    StatusIs(absl::StatusCode::kInternal));
        ++cases;
      }
      // A view whose buffers are not the tensor's (a copy elsewhere).
      KVT_ASSERT_OK_AND_ASSIGN(EncodedView view, ParseEncoded(payload.tensors(0)));
      std::vector<uint8_t> other;
      KVT_ASSERT_OK_AND_ASSIGN(StagedKv staged, StageView(view, d, &other));
      EXPECT_THAT(PlanUnstaging(parts[0].bytes, staged), StatusIs(absl::StatusCode::kInternal));
    }
  }
  EXPECT_EQ(cases, 11 * 3 * 2);
}

// The open round of a session arriving in a hand-off goes into the GPU's
// mirror token-major in fp32: each row of each head, widened from the
// model's dtype, at (row, head), whatever room the open round has beyond
// its rows.
TEST(DeviceLayoutTest, OpenRowsComeOutTokenMajor) {
  const int hkv = 3, d = 8;
  const int64_t rows = 5, cap = 7;
  for (v1::DType dtype : {v1::DTYPE_FP16, v1::DTYPE_BF16, v1::DTYPE_FP32}) {
    SCOPED_TRACE(v1::DType_Name(dtype));
    const int es = DTypeSize(dtype);
    OpenLayer o;
    o.cap = cap;
    o.rows = rows;
    o.k.assign(static_cast<size_t>(hkv) * cap * d * es, 0xee);  // Room past `rows` is junk.
    o.v = o.k;
    // Row t of head h, channel c, holds t + h / 4 + c / 32 (K) or its negative
    // (V): exact in every dtype.
    auto value = [](int64_t t, int h, int c) { return t + h / 4.0f + c / 32.0f; };
    for (int h = 0; h < hkv; ++h) {
      for (int64_t t = 0; t < rows; ++t) {
        for (int c = 0; c < d; ++c) {
          const size_t at = (static_cast<size_t>(h) * cap + t) * d + c;
          const float kx = value(t, h, c), vx = -value(t, h, c);
          if (dtype == v1::DTYPE_FP32) {
            std::memcpy(o.k.data() + at * 4, &kx, 4);
            std::memcpy(o.v.data() + at * 4, &vx, 4);
          } else {
            const uint16_t kb = dtype == v1::DTYPE_FP16 ? FloatToHalf(kx) : FloatToBf16(kx);
            const uint16_t vb = dtype == v1::DTYPE_FP16 ? FloatToHalf(vx) : FloatToBf16(vx);
            std::memcpy(o.k.data() + at * 2, &kb, 2);
            std::memcpy(o.v.data() + at * 2, &vb, 2);
          }
        }
      }
    }
    std::vector<float> k, v;
    OpenRowsTokenMajor(o, hkv, d, dtype, rows, &k, &v);
    ASSERT_EQ(k.size(), static_cast<size_t>(rows) * hkv * d);
    ASSERT_EQ(v.size(), k.size());
    for (int64_t t = 0; t < rows; ++t) {
      for (int h = 0; h < hkv; ++h) {
        for (int c = 0; c < d; ++c) {
          const size_t at = (static_cast<size_t>(t) * hkv + h) * d + c;
          ASSERT_EQ(k[at], value(t, h, c)) << "row " << t << " head " << h << " channel " << c;
          ASSERT_EQ(v[at], -value(t, h, c)) << "row " << t << " head " << h << " channel " << c;
        }
      }
    }
  }
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
