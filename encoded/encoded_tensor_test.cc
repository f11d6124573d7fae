#include "encoded/encoded_tensor.h"

#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/crc32c.h"
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

// A payload of `n` tensors: raw ones and KIVI-4 ones of three buffers, each
// buffer of random bytes and length (empty ones too).
std::string RandomPayload(std::mt19937_64& rng, int n) {
  v1::SegmentPayload p;
  for (int i = 0; i < n; ++i) {
    v1::EncodedTensor& t = *p.add_tensors();
    t.set_dtype(v1::DTYPE_FP16);
    t.add_shape(1 + static_cast<int64_t>(rng() % 4));
    t.add_shape(16);
    const int buffers = i % 2 == 0 ? 1 : 3;
    if (buffers == 1) {
      t.set_codec(v1::CODEC_RAW);
    } else {
      t.set_codec(v1::CODEC_KIVI);
      t.mutable_params()->set_bits(4);
      t.mutable_params()->set_group_size(32);
      t.set_role(v1::TENSOR_ROLE_KEY);
    }
    for (int b = 0; b < buffers; ++b) {
      v1::Buffer* buf = t.add_buffers();
      buf->set_kind(buffers == 1 ? v1::BUFFER_RAW : static_cast<v1::BufferKind>(b + 2));
      const size_t len = buffers == 1 ? static_cast<size_t>(t.shape(0)) * 16 * 2 : rng() % 40;
      std::string d(len, '\0');
      for (char& c : d) c = static_cast<char>(rng());
      buf->set_data(d);
    }
    SealTensor(&t);
  }
  return p.SerializeAsString();
}

// Longhand: CRC-32C of the payload's bytes outside its buffers' data, from
// SplitPayload's views.
uint32_t LonghandOutsideCrc(std::string_view payload) {
  auto split = SplitPayload(payload, /*verify_crc=*/false);
  EXPECT_TRUE(split.ok()) << split.status();
  std::string outside;
  size_t at = 0;
  for (const TensorParts& t : *split) {
    for (const BufferView& b : t.buffers) {
      if (b.data.empty()) continue;  // Not serialized at all (proto3).
      const size_t begin = static_cast<size_t>(b.data.data() - payload.data());
      outside.append(payload.substr(at, begin - at));
      at = begin + b.data.size();
    }
  }
  outside.append(payload.substr(at));
  return Crc32c(outside);
}

// The transfer's check (TransferHeader.tensor_checksums): the CRC outside
// the buffers' data, computed over the whole payload or tensor by tensor,
// equals the longhand one; with each tensor's own crc32c, every single-bit
// flip anywhere in the payload is caught.
TEST(EncodedTensor, CrcOutsideBufferDataWithTensorCrcsCatchesEveryBitFlip) {
  std::mt19937_64 rng(7);
  EXPECT_THAT(Crc32cOutsidePayloadBufferData(0, "\xff\xff garbage"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(Crc32cOutsideBufferData(0, "\x42\x09short"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(Crc32cOutsidePayloadBufferData(5, "").value_or(0), 5u);
  for (int iter = 0; iter < 20; ++iter) {
    const std::string payload = RandomPayload(rng, 1 + iter % 4);
    const uint32_t want = LonghandOutsideCrc(payload);
    absl::StatusOr<uint32_t> whole = Crc32cOutsidePayloadBufferData(0, payload);
    ASSERT_TRUE(whole.ok()) << whole.status();
    EXPECT_EQ(*whole, want);
    // Framing, then each tensor, as a sender holds them.
    auto split = SplitPayload(payload);
    ASSERT_TRUE(split.ok()) << split.status();
    // In the same pass as the split and the checks (a transfer's receiver).
    uint32_t in_pass = 0;
    ASSERT_TRUE(SplitPayload(payload, true, &in_pass).ok());
    EXPECT_EQ(in_pass, want);
    uint32_t crc = 0;
    size_t at = 0;
    for (const TensorParts& t : *split) {
      const size_t begin = static_cast<size_t>(t.bytes.data() - payload.data());
      crc = Crc32cExtend(crc, payload.data() + at, begin - at);
      absl::StatusOr<uint32_t> c = Crc32cOutsideBufferData(crc, t.bytes);
      ASSERT_TRUE(c.ok()) << c.status();
      crc = *c;
      at = begin + t.bytes.size();
      // What the split kept of the tensor: its own part from 0 and its
      // length, which the longhand counts as everything but buffer data.
      absl::StatusOr<uint32_t> own = Crc32cOutsideBufferData(0, t.bytes);
      ASSERT_TRUE(own.ok()) << own.status();
      EXPECT_EQ(t.outside.crc, *own);
      size_t data_bytes = 0;
      for (const BufferView& b : t.buffers) data_bytes += b.data.size();
      EXPECT_EQ(t.outside.len, t.bytes.size() - data_bytes);
    }
    EXPECT_EQ(crc, want);
    // The same from the kept parts alone, as a hand-off's sender does.
    uint32_t kept = 0;
    at = 0;
    for (const TensorParts& t : *split) {
      const size_t begin = static_cast<size_t>(t.bytes.data() - payload.data());
      kept = Crc32cExtend(kept, payload.data() + at, begin - at);
      kept = Crc32cCombine(kept, t.outside.crc, t.outside.len);
      at = begin + t.bytes.size();
    }
    EXPECT_EQ(Crc32cExtend(kept, payload.data() + at, payload.size() - at), want);
    if (iter >= 4) continue;
    for (size_t i = 0; i < payload.size(); ++i) {
      for (int bit = 0; bit < 8; ++bit) {
        std::string flipped = payload;
        flipped[i] ^= static_cast<char>(1 << bit);
        absl::StatusOr<uint32_t> outside = Crc32cOutsidePayloadBufferData(0, flipped);
        const bool caught = !outside.ok() || *outside != want || !SplitPayload(flipped).ok();
        ASSERT_TRUE(caught) << "byte " << i << " bit " << bit << " of " << payload.size();
      }
    }
  }
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
