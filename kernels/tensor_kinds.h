// The kinds a K/V tensor is described by: its element type, its codec, its
// role and the kinds of its buffers. The kernels own these; tensor.proto's
// enums have the same values, and encoded/encode.h converts between them
// (checked there at compile time).
#ifndef KVTIER_KERNELS_TENSOR_KINDS_H_
#define KVTIER_KERNELS_TENSOR_KINDS_H_

#include <iosfwd>

namespace kvtier {

// Storage type of full-precision elements.
enum class DType : int {
  kUnspecified = 0,  // Invalid for any tensor.
  kFp32 = 1,         // IEEE-754 binary32, little-endian.
  kFp16 = 2,         // IEEE-754 binary16, little-endian.
  kBf16 = 3,         // bfloat16 (upper half of fp32), little-endian.
};

enum class Codec : int {
  kUnspecified = 0,
  kRaw = 1,
  kKivi = 2,
  kKcvt = 3,
  kGear = 4,
  kGearL = 5,
};

enum class TensorRole : int {
  kUnspecified = 0,  // Allowed only for Codec::kRaw.
  kKey = 1,
  kValue = 2,
};

// One buffer of an encoded tensor (the layout is in kernels/codec.h).
enum class BufferKind : int {
  kUnspecified = 0,
  kRaw = 1,
  kCodes = 2,
  kScales = 3,
  kZeros = 4,
  kResidual = 5,
  kLowrankA = 6,
  kLowrankB = 7,
  kSparseIndex = 8,
  kSparseValue = 9,
};

// Bytes per element of `dtype`; 0 for kUnspecified or an unknown value.
int DTypeSize(DType dtype);

// Names for messages, as tensor.proto spells them: "fp16", "CODEC_KIVI",
// "BUFFER_SCALES"; "unknown" for other values.
const char* DTypeName(DType dtype);
const char* CodecName(Codec codec);
const char* BufferKindName(BufferKind kind);

// The names above, for logs and test failures.
std::ostream& operator<<(std::ostream& os, DType dtype);
std::ostream& operator<<(std::ostream& os, Codec codec);
std::ostream& operator<<(std::ostream& os, TensorRole role);
std::ostream& operator<<(std::ostream& os, BufferKind kind);

}  // namespace kvtier

#endif  // KVTIER_KERNELS_TENSOR_KINDS_H_
