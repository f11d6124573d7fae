// Format-level checks of EncodedTensor (proto/kvtier/v1/tensor.proto): the
// parts every holder of encoded bytes must enforce, independent of how a
// codec decodes them.
#ifndef KVTIER_ENCODED_ENCODED_TENSOR_H_
#define KVTIER_ENCODED_ENCODED_TENSOR_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/codec.h"
#include "kvtier/v1/tensor.pb.h"

namespace kvtier {

// The newest EncodedTensor.format_version this build understands.
inline constexpr uint32_t kEncodedTensorFormatVersion = 1;

// Bytes per element of `dtype`; 0 for DTYPE_UNSPECIFIED or unknown values.
int DTypeSize(v1::DType dtype);

// CRC-32C over the tensor's buffers' data, in order.
uint32_t ComputeTensorCrc(const v1::EncodedTensor& t);

// Sets format_version and crc32c from the current buffers.
void SealTensor(v1::EncodedTensor* t);

// One tensor of a serialized SegmentPayload, split where it lies: its
// metadata (every field but the buffers, parsed) and views of its buffers'
// bytes. Valid while the payload's bytes are.
// What Crc32cOutsideBufferData covers of one tensor: its CRC (from 0) and
// how many bytes it covered. Kept beside a tensor, it lets a CRC over many
// tensors' framing and metadata be extended without reading them again
// (Crc32cCombine(crc, outside.crc, outside.len)).
struct OutsideCrc {
  uint32_t crc = 0;
  uint64_t len = 0;
};

struct TensorParts {
  v1::EncodedTensor meta;           // Its `buffers` are empty.
  std::vector<BufferView> buffers;  // In order (kernels/codec.h).
  std::string_view bytes;           // The tensor's whole serialized form.
  OutsideCrc outside;               // Of `bytes` (SplitPayload).
};

// Splits every tensor of a serialized SegmentPayload in place, copying no
// buffer bytes, and validates each as ValidateTensor does (the checksum only
// with verify_crc). OK and the tensors in order; INVALID_ARGUMENT for bytes
// that are no SegmentPayload or a malformed tensor; DATA_LOSS for a checksum
// mismatch. Each tensor's `outside` is computed as it is checked. With
// `outside_crc`, it also extends *outside_crc over what
// Crc32cOutsidePayloadBufferData covers, tensor by tensor (one pass instead
// of two while the bytes are in cache; the value is the same). On an error
// *outside_crc is not defined.
absl::StatusOr<std::vector<TensorParts>> SplitPayload(std::string_view payload,
                                                      bool verify_crc = true,
                                                      uint32_t* outside_crc = nullptr);

// CRC-32C: `crc` extended over the serialized EncodedTensor `tensor`, in
// order, leaving out the data of its buffers (Buffer.data), which the
// tensor's own crc32c covers. Together the two check every byte once, and
// this one reads only the framing and metadata. INVALID_ARGUMENT when the
// bytes do not parse as an EncodedTensor.
absl::StatusOr<uint32_t> Crc32cOutsideBufferData(uint32_t crc, std::string_view tensor);

// The same over a serialized SegmentPayload: the framing of its tensors,
// and each tensor as above. It checks no tensor (SplitPayload does).
absl::StatusOr<uint32_t> Crc32cOutsidePayloadBufferData(uint32_t crc, std::string_view payload);

// Checks a tensor. Returns:
//   OK                 well-formed, checksum matches.
//   INVALID_ARGUMENT   unknown version/codec/dtype, bad shape (0 or > 8 dims,
//                      a dimension outside [1, 2^31), over 2^40 elements),
//                      bad codec parameters, or a CODEC_RAW buffer whose size
//                      is not elements * dtype size.
//   DATA_LOSS          crc32c does not match the buffers.
// verify_crc = false skips the checksum (only the checksum): for bytes whose
// integrity is already established on this hop (just sealed here, or inside
// a segment payload whose own crc32c was checked on arrival).
absl::Status ValidateTensor(const v1::EncodedTensor& t, bool verify_crc = true);

// Validates a serialized SegmentPayload in place: the same checks as
// ParseAndValidatePayload, but buffer bytes are checksummed where they lie
// instead of being copied into protobuf objects. Returns the tensor count.
absl::StatusOr<int> ValidatePayloadBytes(std::string_view bytes);

// Parses a serialized SegmentPayload and validates every tensor. Returns the
// payload, or INVALID_ARGUMENT (does not parse, no tensors) / the first
// tensor's error.
absl::StatusOr<v1::SegmentPayload> ParseAndValidatePayload(std::string_view bytes);

}  // namespace kvtier

#endif  // KVTIER_ENCODED_ENCODED_TENSOR_H_
