// The codecs' tensors in tensor.proto's form: kernels/codec.h encodes into
// buffers and views buffers; this file frames them as an EncodedTensor (the
// wire's and the store's form), reads one back into a view, and converts the
// kernels' kinds to the proto's enums and back.
#ifndef KVTIER_ENCODED_ENCODE_H_
#define KVTIER_ENCODED_ENCODE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "encoded/encoded_tensor.h"
#include "kernels/codec.h"
#include "kvtier/v1/tensor.pb.h"

namespace kvtier {

// The kernels' kinds and tensor.proto's enums have the same values
// (encode.cc checks each at compile time).
inline v1::DType ToProto(DType d) { return static_cast<v1::DType>(d); }
inline v1::Codec ToProto(Codec c) { return static_cast<v1::Codec>(c); }
inline v1::TensorRole ToProto(TensorRole r) { return static_cast<v1::TensorRole>(r); }
inline v1::BufferKind ToProto(BufferKind k) { return static_cast<v1::BufferKind>(k); }
inline DType FromProto(v1::DType d) { return static_cast<DType>(d); }
inline Codec FromProto(v1::Codec c) { return static_cast<Codec>(c); }
inline TensorRole FromProto(v1::TensorRole r) { return static_cast<TensorRole>(r); }
inline BufferKind FromProto(v1::BufferKind k) { return static_cast<BufferKind>(k); }

// The params message of a config (fields a codec does not use are 0).
v1::CodecParams ToParams(const CodecConfig& c);

// The header of a tensor's fields (no check: ValidateTensor checks them).
TensorHeader HeaderOf(const v1::EncodedTensor& t);

// Encodes `data` (fp32, row-major `shape`, last two dims [tokens, head_dim]).
// INVALID_ARGUMENT for a bad config or shape, or a non-finite input or one
// beyond fp16 range where fp16 metadata must hold it.
absl::StatusOr<v1::EncodedTensor> Encode(const CodecConfig& c, TensorRole role,
                                         absl::Span<const int64_t> shape, const float* data,
                                         KernelLevel level = KernelLevel::kBest);

// Encoding straight into a serialized EncodedTensor, for a caller that lays
// out many tensors in one buffer (a segment payload) and wants each tensor's
// bytes written once. Make() checks the config and shape as Encode does;
// SerializedSize() is exact; EncodeTo(data, out) checks `data` as Encode does
// and writes the tensor at out[0, SerializedSize()), byte for byte what
// Encode, then set_layer_begin(layer_begin), then serialization produce
// (except that a checksum of 0 is written out rather than left implicit), and
// returns the end. When it refuses `data`, what it left at `out` is
// unspecified: the check may run inside the quantizer's pass over the data.
// Encoders are immutable: EncodeTo may run concurrently.
class TensorEncoder {
 public:
  static absl::StatusOr<TensorEncoder> Make(const CodecConfig& c, TensorRole role,
                                            absl::Span<const int64_t> shape,
                                            uint32_t layer_begin = 0);
  size_t SerializedSize() const { return size_; }
  absl::StatusOr<uint8_t*> EncodeTo(const float* data, uint8_t* out,
                                    KernelLevel level = KernelLevel::kBest) const;
  // The same from `data` in `dtype` (fp16, bf16 or fp32), as
  // BlockEncoder::EncodeInto takes it.
  absl::StatusOr<uint8_t*> EncodeTo(const void* data, DType dtype, uint8_t* out,
                                    std::vector<float>* scratch,
                                    KernelLevel level = KernelLevel::kBest) const;

 private:
  explicit TensorEncoder(BlockEncoder block) : block_(std::move(block)) {}
  // Writes the fields up to the buffers' bytes; the buffers' places in `bufs`.
  uint8_t* LayOut(uint8_t* out, std::vector<uint8_t*>* bufs) const;
  // Writes the checksum of the filled buffers at p; returns the tensor's end.
  uint8_t* Seal(const std::vector<uint8_t*>& bufs, uint8_t* p) const;

  BlockEncoder block_;
  std::string meta_;  // Fields 1 to 7, serialized.
  size_t size_ = 0;
};

// Validates `t` fully (format checks, CRC, every buffer's exact size, sparse
// positions) and returns a view into its buffers. `t` must outlive the view.
// INVALID_ARGUMENT for a malformed tensor, DATA_LOSS for a CRC mismatch.
// verify_crc = false: every check but the checksum (see ValidateTensor).
absl::StatusOr<EncodedView> ParseEncoded(const v1::EncodedTensor& t, bool verify_crc = true);
// The same over a tensor split in place by SplitPayload (which validated its
// format): the view points into the payload's bytes, which must outlive it.
absl::StatusOr<EncodedView> ParseEncoded(const TensorParts& t);

// Decodes a whole tensor into fp32, row-major over its shape.
absl::StatusOr<std::vector<float>> Decode(const v1::EncodedTensor& t,
                                          KernelLevel level = KernelLevel::kBest);

// Serialized size of the tensor, all metadata included.
int64_t EncodedTotalBytes(const v1::EncodedTensor& t);

}  // namespace kvtier

#endif  // KVTIER_ENCODED_ENCODE_H_
