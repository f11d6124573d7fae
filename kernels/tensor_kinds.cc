#include "kernels/tensor_kinds.h"

#include <ostream>

namespace kvtier {

int DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFp32:
      return 4;
    case DType::kFp16:
    case DType::kBf16:
      return 2;
    default:
      return 0;
  }
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFp32:
      return "fp32";
    case DType::kFp16:
      return "fp16";
    case DType::kBf16:
      return "bf16";
    default:
      return "unknown";
  }
}

const char* CodecName(Codec codec) {
  switch (codec) {
    case Codec::kRaw:
      return "CODEC_RAW";
    case Codec::kKivi:
      return "CODEC_KIVI";
    case Codec::kKcvt:
      return "CODEC_KCVT";
    case Codec::kGear:
      return "CODEC_GEAR";
    case Codec::kGearL:
      return "CODEC_GEAR_L";
    default:
      return "unknown";
  }
}

const char* BufferKindName(BufferKind kind) {
  switch (kind) {
    case BufferKind::kRaw:
      return "BUFFER_RAW";
    case BufferKind::kCodes:
      return "BUFFER_CODES";
    case BufferKind::kScales:
      return "BUFFER_SCALES";
    case BufferKind::kZeros:
      return "BUFFER_ZEROS";
    case BufferKind::kResidual:
      return "BUFFER_RESIDUAL";
    case BufferKind::kLowrankA:
      return "BUFFER_LOWRANK_A";
    case BufferKind::kLowrankB:
      return "BUFFER_LOWRANK_B";
    case BufferKind::kSparseIndex:
      return "BUFFER_SPARSE_INDEX";
    case BufferKind::kSparseValue:
      return "BUFFER_SPARSE_VALUE";
    default:
      return "unknown";
  }
}

std::ostream& operator<<(std::ostream& os, DType dtype) { return os << DTypeName(dtype); }
std::ostream& operator<<(std::ostream& os, Codec codec) { return os << CodecName(codec); }
std::ostream& operator<<(std::ostream& os, TensorRole role) {
  switch (role) {
    case TensorRole::kKey:
      return os << "KEY";
    case TensorRole::kValue:
      return os << "VALUE";
    default:
      return os << "unspecified";
  }
}
std::ostream& operator<<(std::ostream& os, BufferKind kind) { return os << BufferKindName(kind); }

}  // namespace kvtier
