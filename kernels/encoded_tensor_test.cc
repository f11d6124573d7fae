#include "kernels/encoded_tensor.h"

#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/status_matchers.h"

namespace kvtier {
namespace {

using ::kvtier::testing::IsOk;
using ::kvtier::testing::StatusIs;

v1::EncodedTensor RawTensor(std::vector<int64_t> shape) {
  v1::EncodedTensor t;
  t.set_codec(v1::CODEC_RAW);
  t.set_dtype(v1::DTYPE_BF16);
  int64_t n = 1;
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= d;
  }
  auto* b = t.add_buffers();
  b->set_kind(v1::BUFFER_RAW);
  b->set_data(std::string(static_cast<size_t>(n) * 2, 'x'));
  SealTensor(&t);
  return t;
}

TEST(EncodedTensor, RawRoundTripValidates) {
  v1::EncodedTensor t = RawTensor({2, 4, 3, 64});
  EXPECT_THAT(ValidateTensor(t), IsOk());
  v1::EncodedTensor back;
  ASSERT_TRUE(back.ParseFromString(t.SerializeAsString()));
  EXPECT_THAT(ValidateTensor(back), IsOk());
  EXPECT_EQ(back.SerializeAsString(), t.SerializeAsString());
}

TEST(EncodedTensor, CorruptBufferIsDataLoss) {
  v1::EncodedTensor t = RawTensor({8});
  (*t.mutable_buffers(0)->mutable_data())[3] ^= 1;
  EXPECT_THAT(ValidateTensor(t), StatusIs(absl::StatusCode::kDataLoss));
}

TEST(EncodedTensor, BadShapesAreInvalidArgument) {
  v1::EncodedTensor t = RawTensor({8});
  t.set_shape(0, 9);  // Buffer no longer matches.
  EXPECT_THAT(ValidateTensor(t), StatusIs(absl::StatusCode::kInvalidArgument));
  t.set_shape(0, 0);
  EXPECT_THAT(ValidateTensor(t), StatusIs(absl::StatusCode::kInvalidArgument));
  t.set_shape(0, -3);
  EXPECT_THAT(ValidateTensor(t), StatusIs(absl::StatusCode::kInvalidArgument));
  t.clear_shape();
  EXPECT_THAT(ValidateTensor(t), StatusIs(absl::StatusCode::kInvalidArgument));
  v1::EncodedTensor huge = RawTensor({8});
  for (int i = 0; i < 5; ++i) huge.add_shape(1 << 30);
  EXPECT_THAT(ValidateTensor(huge), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(EncodedTensor, BadHeaderFieldsAreInvalidArgument) {
  v1::EncodedTensor t = RawTensor({8});
  t.set_format_version(99);
  EXPECT_THAT(ValidateTensor(t), StatusIs(absl::StatusCode::kInvalidArgument));
  t = RawTensor({8});
  t.set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_THAT(ValidateTensor(t), StatusIs(absl::StatusCode::kInvalidArgument));
  t = RawTensor({8});
  t.set_codec(v1::CODEC_KIVI);
  t.mutable_params()->set_bits(3);
  EXPECT_THAT(ValidateTensor(t), StatusIs(absl::StatusCode::kInvalidArgument));
  t.mutable_params()->set_bits(4);
  t.mutable_params()->set_group_size(32);
  EXPECT_THAT(ValidateTensor(t), StatusIs(absl::StatusCode::kInvalidArgument));  // No role.
  t.set_role(v1::TENSOR_ROLE_KEY);
  EXPECT_THAT(ValidateTensor(t), IsOk());
}

TEST(EncodedTensor, PayloadParsing) {
  EXPECT_THAT(ParseAndValidatePayload("\xff\xff garbage"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseAndValidatePayload(""), StatusIs(absl::StatusCode::kInvalidArgument));
  v1::SegmentPayload p;
  *p.add_tensors() = RawTensor({4, 8});
  *p.add_tensors() = RawTensor({4, 8});
  EXPECT_THAT(ParseAndValidatePayload(p.SerializeAsString()), IsOk());
  (*p.mutable_tensors(1)->mutable_buffers(0)->mutable_data())[0] ^= 1;
  EXPECT_THAT(ParseAndValidatePayload(p.SerializeAsString()),
              StatusIs(absl::StatusCode::kDataLoss));
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

// A short fuzz run in the default suite: the in-place validator must accept
// exactly what parse-then-validate accepts, on valid payloads and on random
// corruptions of them (bit flips, truncations, splices).
TEST(EncodedTensorFuzz, InPlaceValidatorAgreesWithParser) {
  std::mt19937_64 rng(42);
  int accepted = 0, rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    v1::SegmentPayload p;
    int n = 1 + static_cast<int>(rng() % 3);
    for (int i = 0; i < n; ++i) {
      v1::EncodedTensor t;
      t.set_codec(v1::CODEC_RAW);
      t.set_dtype(rng() % 2 ? v1::DTYPE_FP16 : v1::DTYPE_FP32);
      int64_t a = 1 + rng() % 5, b = 1 + rng() % 9;
      t.add_shape(a);
      t.add_shape(b);
      auto* buf = t.add_buffers();
      buf->set_kind(v1::BUFFER_RAW);
      std::string d(a * b * DTypeSize(t.dtype()), '\0');
      for (char& c : d) c = static_cast<char>(rng());
      buf->set_data(d);
      SealTensor(&t);
      *p.add_tensors() = t;
    }
    std::string bytes = p.SerializeAsString();
    switch (iter % 4) {
      case 0:
        break;  // Valid.
      case 1:
        bytes[rng() % bytes.size()] ^= static_cast<char>(1 << (rng() % 8));
        break;
      case 2:
        bytes.resize(rng() % bytes.size());
        break;
      case 3:
        bytes.insert(rng() % bytes.size(), std::string(1 + rng() % 4, static_cast<char>(rng())));
        break;
    }
    const bool fast = ValidatePayloadBytes(bytes).ok();
    const bool slow = ParseAndValidatePayload(bytes).ok();
    ASSERT_EQ(fast, slow) << "iteration " << iter;
    (fast ? accepted : rejected)++;
  }
  EXPECT_GT(accepted, 750);
  EXPECT_GT(rejected, 500);
}

}  // namespace
}  // namespace kvtier
