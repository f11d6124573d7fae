#include "encoded/encode.h"

#include <algorithm>
#include <utility>

#include "base/status_macros.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "kernels/crc32c.h"

namespace kvtier {

#define KVT_SAME_VALUE(kernel, proto) \
  static_assert(static_cast<int>(kernel) == static_cast<int>(proto), #kernel " != " #proto)
KVT_SAME_VALUE(DType::kUnspecified, v1::DTYPE_UNSPECIFIED);
KVT_SAME_VALUE(DType::kFp32, v1::DTYPE_FP32);
KVT_SAME_VALUE(DType::kFp16, v1::DTYPE_FP16);
KVT_SAME_VALUE(DType::kBf16, v1::DTYPE_BF16);
KVT_SAME_VALUE(Codec::kUnspecified, v1::CODEC_UNSPECIFIED);
KVT_SAME_VALUE(Codec::kRaw, v1::CODEC_RAW);
KVT_SAME_VALUE(Codec::kKivi, v1::CODEC_KIVI);
KVT_SAME_VALUE(Codec::kKcvt, v1::CODEC_KCVT);
KVT_SAME_VALUE(Codec::kGear, v1::CODEC_GEAR);
KVT_SAME_VALUE(Codec::kGearL, v1::CODEC_GEAR_L);
KVT_SAME_VALUE(TensorRole::kUnspecified, v1::TENSOR_ROLE_UNSPECIFIED);
KVT_SAME_VALUE(TensorRole::kKey, v1::TENSOR_ROLE_KEY);
KVT_SAME_VALUE(TensorRole::kValue, v1::TENSOR_ROLE_VALUE);
KVT_SAME_VALUE(BufferKind::kUnspecified, v1::BUFFER_KIND_UNSPECIFIED);
KVT_SAME_VALUE(BufferKind::kRaw, v1::BUFFER_RAW);
KVT_SAME_VALUE(BufferKind::kCodes, v1::BUFFER_CODES);
KVT_SAME_VALUE(BufferKind::kScales, v1::BUFFER_SCALES);
KVT_SAME_VALUE(BufferKind::kZeros, v1::BUFFER_ZEROS);
KVT_SAME_VALUE(BufferKind::kResidual, v1::BUFFER_RESIDUAL);
KVT_SAME_VALUE(BufferKind::kLowrankA, v1::BUFFER_LOWRANK_A);
KVT_SAME_VALUE(BufferKind::kLowrankB, v1::BUFFER_LOWRANK_B);
KVT_SAME_VALUE(BufferKind::kSparseIndex, v1::BUFFER_SPARSE_INDEX);
KVT_SAME_VALUE(BufferKind::kSparseValue, v1::BUFFER_SPARSE_VALUE);
static_assert(v1::DType_MAX == v1::DTYPE_BF16 && v1::Codec_MAX == v1::CODEC_GEAR_L &&
                  v1::TensorRole_MAX == v1::TENSOR_ROLE_VALUE &&
                  v1::BufferKind_MAX == v1::BUFFER_SPARSE_VALUE,
              "tensor.proto has a value the kernels do not know");
#undef KVT_SAME_VALUE

namespace {

// The params message of a header.
v1::CodecParams ParamsOf(const TensorHeader& h) {
  v1::CodecParams p;
  p.set_bits(h.bits);
  p.set_group_size(h.group_size);
  p.set_residual_tokens(static_cast<uint32_t>(h.residual_tokens));
  p.set_rank(h.rank);
  p.set_outlier_fraction(h.outlier_fraction);
  p.set_backbone(ToProto(h.backbone));
  p.set_block_tokens(h.block_tokens);
  return p;
}

// Every field of the tensor but its buffers and checksum.
v1::EncodedTensor MetaOf(const TensorHeader& h, uint32_t layer_begin) {
  v1::EncodedTensor t;
  t.set_format_version(kEncodedTensorFormatVersion);
  t.set_codec(ToProto(h.codec));
  *t.mutable_params() = ParamsOf(h);
  t.set_role(ToProto(h.role));
  t.set_dtype(ToProto(h.dtype));
  for (int64_t s : h.shape) t.add_shape(s);
  t.set_layer_begin(layer_begin);
  return t;
}

}  // namespace

v1::CodecParams ToParams(const CodecConfig& c) { return ParamsOf(ParamsHeader(c)); }

TensorHeader HeaderOf(const v1::EncodedTensor& t) {
  TensorHeader h;
  const v1::CodecParams& p = t.params();
  h.codec = FromProto(t.codec());
  h.role = FromProto(t.role());
  h.dtype = FromProto(t.dtype());
  h.bits = static_cast<int>(p.bits());
  h.group_size = static_cast<int>(p.group_size());
  h.residual_tokens = p.residual_tokens();
  h.rank = static_cast<int>(p.rank());
  h.outlier_fraction = p.outlier_fraction();
  h.backbone = FromProto(p.backbone());
  h.block_tokens = static_cast<int>(p.block_tokens());
  h.shape.assign(t.shape().begin(), t.shape().end());
  return h;
}

absl::StatusOr<v1::EncodedTensor> Encode(const CodecConfig& c, TensorRole role,
                                         absl::Span<const int64_t> shape, const float* data,
                                         KernelLevel level) {
  KVT_ASSIGN_OR_RETURN(BlockEncoder enc, BlockEncoder::Make(c, role, shape));
  v1::EncodedTensor t = MetaOf(enc.header(), 0);
  std::vector<uint8_t*> out;
  for (const BufferSize& b : enc.buffers()) {
    v1::Buffer* buf = t.add_buffers();
    buf->set_kind(ToProto(b.kind));
    buf->mutable_data()->assign(static_cast<size_t>(b.bytes), '\0');
    out.push_back(reinterpret_cast<uint8_t*>(buf->mutable_data()->data()));
  }
  KVT_RETURN_IF_ERROR(enc.EncodeInto(data, out, level));
  SealTensor(&t);
  return t;
}

namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedOutputStream;

constexpr uint32_t kBuffersTag = (8 << 3) | 2;  // EncodedTensor.buffers
constexpr uint32_t kKindTag = (1 << 3) | 0;     // Buffer.kind
constexpr uint32_t kDataTag = (2 << 3) | 2;     // Buffer.data
constexpr uint32_t kCrcTag = (9 << 3) | 5;      // EncodedTensor.crc32c

// Serialized size of a Buffer message holding `bytes` bytes of `kind`.
size_t BufferMessageSize(BufferKind kind, int64_t bytes) {
  size_t n = 1 + CodedOutputStream::VarintSize32SignExtended(static_cast<int32_t>(kind));
  if (bytes > 0) n += 1 + CodedOutputStream::VarintSize64(bytes) + static_cast<size_t>(bytes);
  return n;
}

}  // namespace

absl::StatusOr<TensorEncoder> TensorEncoder::Make(const CodecConfig& c, TensorRole role,
                                                  absl::Span<const int64_t> shape,
                                                  uint32_t layer_begin) {
  KVT_ASSIGN_OR_RETURN(BlockEncoder block, BlockEncoder::Make(c, role, shape));
  TensorEncoder e(std::move(block));
  e.meta_ = MetaOf(e.block_.header(), layer_begin).SerializeAsString();
  e.size_ = e.meta_.size();
  for (const BufferSize& b : e.block_.buffers()) {
    const size_t m = BufferMessageSize(b.kind, b.bytes);
    e.size_ += 1 + CodedOutputStream::VarintSize64(m) + m;
  }
  e.size_ += 1 + 4;  // The checksum, always written.
  return e;
}

uint8_t* TensorEncoder::LayOut(uint8_t* out, std::vector<uint8_t*>* bufs) const {
  uint8_t* p = std::copy(meta_.begin(), meta_.end(), out);
  for (const BufferSize& b : block_.buffers()) {
    p = CodedOutputStream::WriteVarint32ToArray(kBuffersTag, p);
    p = CodedOutputStream::WriteVarint64ToArray(BufferMessageSize(b.kind, b.bytes), p);
    p = CodedOutputStream::WriteVarint32ToArray(kKindTag, p);
    p = CodedOutputStream::WriteVarint32SignExtendedToArray(static_cast<int32_t>(b.kind), p);
    if (b.bytes > 0) {
      p = CodedOutputStream::WriteVarint32ToArray(kDataTag, p);
      p = CodedOutputStream::WriteVarint64ToArray(static_cast<uint64_t>(b.bytes), p);
    }
    bufs->push_back(p);
    p += b.bytes;
  }
  return p;
}

uint8_t* TensorEncoder::Seal(const std::vector<uint8_t*>& bufs, uint8_t* p) const {
  uint32_t crc = 0;
  for (size_t i = 0; i < bufs.size(); ++i) {
    crc = Crc32cExtend(crc, bufs[i], static_cast<size_t>(block_.buffers()[i].bytes));
  }
  p = CodedOutputStream::WriteVarint32ToArray(kCrcTag, p);
  return WireFormatLite::WriteFixed32NoTagToArray(crc, p);
}

absl::StatusOr<uint8_t*> TensorEncoder::EncodeTo(const float* data, uint8_t* out,
                                                 KernelLevel level) const {
  std::vector<uint8_t*> bufs;
  uint8_t* p = LayOut(out, &bufs);
  KVT_RETURN_IF_ERROR(block_.EncodeInto(data, bufs, level));
  return Seal(bufs, p);
}

absl::StatusOr<uint8_t*> TensorEncoder::EncodeTo(const void* data, DType dtype, uint8_t* out,
                                                 std::vector<float>* scratch,
                                                 KernelLevel level) const {
  std::vector<uint8_t*> bufs;
  uint8_t* p = LayOut(out, &bufs);
  KVT_RETURN_IF_ERROR(block_.EncodeInto(data, dtype, bufs, scratch, level));
  return Seal(bufs, p);
}

absl::StatusOr<EncodedView> ParseEncoded(const v1::EncodedTensor& t, bool verify_crc) {
  KVT_RETURN_IF_ERROR(ValidateTensor(t, verify_crc));
  std::vector<BufferView> bufs;
  bufs.reserve(t.buffers_size());
  for (const auto& b : t.buffers()) bufs.push_back({FromProto(b.kind()), b.data()});
  return ViewOf(HeaderOf(t), bufs);
}

absl::StatusOr<EncodedView> ParseEncoded(const TensorParts& t) {
  return ViewOf(HeaderOf(t.meta), t.buffers);
}

absl::StatusOr<std::vector<float>> Decode(const v1::EncodedTensor& t, KernelLevel level) {
  KVT_ASSIGN_OR_RETURN(EncodedView v, ParseEncoded(t));
  return DecodeAll(v, level);
}

int64_t EncodedTotalBytes(const v1::EncodedTensor& t) {
  return static_cast<int64_t>(t.ByteSizeLong());
}

}  // namespace kvtier
