#include "kernels/encoded_tensor.h"

#include "absl/strings/str_cat.h"
#include "kernels/crc32c.h"

namespace kvtier {

int DTypeSize(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FP32:
      return 4;
    case v1::DTYPE_FP16:
    case v1::DTYPE_BF16:
      return 2;
    default:
      return 0;
  }
}

uint32_t ComputeTensorCrc(const v1::EncodedTensor& t) {
  uint32_t crc = 0;
  for (const auto& b : t.buffers()) crc = Crc32cExtend(crc, b.data().data(), b.data().size());
  return crc;
}

void SealTensor(v1::EncodedTensor* t) {
  t->set_format_version(kEncodedTensorFormatVersion);
  t->set_crc32c(ComputeTensorCrc(*t));
}

namespace {

absl::Status ValidateParams(const v1::EncodedTensor& t) {
  const v1::CodecParams& p = t.params();
  switch (t.codec()) {
    case v1::CODEC_RAW:
      if (p.bits() != 0 || p.group_size() != 0 || p.rank() != 0 || p.outlier_fraction() != 0) {
        return absl::InvalidArgumentError("CODEC_RAW takes no quantization parameters");
      }
      return absl::OkStatus();
    case v1::CODEC_KIVI:
    case v1::CODEC_KCVT:
      if (p.bits() != 2 && p.bits() != 4 && p.bits() != 8) {
        return absl::InvalidArgumentError(absl::StrCat("bits must be 2, 4 or 8, got ", p.bits()));
      }
      if (t.codec() == v1::CODEC_KIVI && p.group_size() == 0) {
        return absl::InvalidArgumentError("CODEC_KIVI needs group_size >= 1");
      }
      break;
    case v1::CODEC_GEAR:
    case v1::CODEC_GEAR_L:
      if (p.bits() != 2 && p.bits() != 4) {
        return absl::InvalidArgumentError(absl::StrCat("GEAR bits must be 2 or 4, got ", p.bits()));
      }
      if (p.backbone() != v1::CODEC_KIVI && p.backbone() != v1::CODEC_KCVT) {
        return absl::InvalidArgumentError("GEAR backbone must be CODEC_KIVI or CODEC_KCVT");
      }
      if (!(p.outlier_fraction() >= 0.0f && p.outlier_fraction() <= 0.5f)) {
        return absl::InvalidArgumentError("outlier_fraction must be in [0, 0.5]");
      }
      if (t.codec() == v1::CODEC_GEAR_L && p.outlier_fraction() != 0.0f) {
        return absl::InvalidArgumentError("GEAR-L has no sparse outliers");
      }
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown codec ", t.codec()));
  }
  if (t.role() != v1::TENSOR_ROLE_KEY && t.role() != v1::TENSOR_ROLE_VALUE) {
    return absl::InvalidArgumentError("a quantized tensor must say whether it holds K or V");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateTensor(const v1::EncodedTensor& t) {
  if (t.format_version() == 0 || t.format_version() > kEncodedTensorFormatVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported EncodedTensor format_version ", t.format_version()));
  }
  const int dsize = DTypeSize(t.dtype());
  if (dsize == 0) return absl::InvalidArgumentError("tensor dtype is unspecified or unknown");
  if (t.shape_size() < 1 || t.shape_size() > 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor shape must have 1 to 8 dimensions, got ", t.shape_size()));
  }
  uint64_t elements = 1;
  for (int64_t d : t.shape()) {
    if (d < 1 || d >= (int64_t{1} << 31)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor dimension ", d, " out of range"));
    }
    elements *= static_cast<uint64_t>(d);
    if (elements >= (uint64_t{1} << 40)) {
      return absl::InvalidArgumentError("tensor has too many elements");
    }
  }
  if (auto s = ValidateParams(t); !s.ok()) return s;
  if (t.buffers_size() == 0) return absl::InvalidArgumentError("tensor has no buffers");
  if (t.codec() == v1::CODEC_RAW) {
    if (t.buffers_size() != 1 || t.buffers(0).kind() != v1::BUFFER_RAW) {
      return absl::InvalidArgumentError("CODEC_RAW needs exactly one BUFFER_RAW");
    }
    const uint64_t want = elements * static_cast<uint64_t>(dsize);
    if (t.buffers(0).data().size() != want) {
      return absl::InvalidArgumentError(absl::StrCat("raw buffer holds ", t.buffers(0).data().size(),
                                                     " bytes, shape needs ", want));
    }
  }
  if (ComputeTensorCrc(t) != t.crc32c()) {
    return absl::DataLossError("tensor crc32c does not match its buffers");
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::SegmentPayload> ParseAndValidatePayload(std::string_view bytes) {
  v1::SegmentPayload payload;
  if (!payload.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::InvalidArgumentError("segment payload is not a serialized SegmentPayload");
  }
  if (payload.tensors_size() == 0) {
    return absl::InvalidArgumentError("segment payload holds no tensors");
  }
  for (int i = 0; i < payload.tensors_size(); ++i) {
    absl::Status s = ValidateTensor(payload.tensors(i));
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("tensor ", i, ": ", s.message()));
    }
  }
  return payload;
}

}  // namespace kvtier
