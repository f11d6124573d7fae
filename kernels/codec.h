// KV codecs (ALGORITHMS.md §3): raw, KIVI-style asymmetric min-max, KCVT,
// GEAR and GEAR-L, serialized as the EncodedTensor of tensor.proto.
//
// A tensor's logical shape is [..., tokens, head_dim]: every leading
// dimension together counts "slabs" (one slab = one KV head of one layer), and
// each slab is a row-major [tokens, head_dim] matrix that the codec encodes on
// its own. Inputs are fp32 in memory; EncodedTensor.dtype is the storage type
// of what stays in full precision (raw elements, residual tokens, sparse
// outlier values).
//
// Buffer layout of format_version 1 (all little-endian; per-slab parts are
// concatenated slab after slab):
//   CODEC_RAW      [BUFFER_RAW]
//   CODEC_KIVI/KCVT [CODES, SCALES, ZEROS] + [RESIDUAL] when the residual is
//                  not empty.
//   CODEC_GEAR     KIVI's buffers + [LOWRANK_A, LOWRANK_B] when rank > 0 +
//                  [SPARSE_INDEX, SPARSE_VALUE].
//   CODEC_GEAR_L   KIVI's buffers + [LOWRANK_A, LOWRANK_B] when rank > 0.
// Of a slab's T tokens the oldest Tq = T - min(R, T) are quantized and the
// newest min(R, T) form the residual (R = params.residual_tokens).
//   CODES    per slab ceil(Tq * D * bits / 32) uint32 words; element i of the
//            slab's row-major [Tq, D] codes sits at bits [(i % n) * bits, ...)
//            of word i / n, n = 32 / bits.
//   SCALES,  fp16. K: [ceil(Tq / G), D] per slab (groups of G tokens in one
//   ZEROS    channel; the last group may be shorter; KCVT: G = Tq).
//            V: [Tq, ceil(D / G)] per slab (groups of G channels in one token;
//            the last may be shorter; KCVT: G = D). x = code * scale + zero.
//   RESIDUAL [R, D] per slab, dtype elements.
//   LOWRANK_A [Tq, r] per slab, fp16; LOWRANK_B [r, D] per slab, fp16.
//   SPARSE_*  rows are channels for K (length Tq) and tokens for V (length D);
//            every row has 2*m outliers, m = round(s * row_len / 2) capped at
//            row_len / 2, stored row after row with strictly increasing
//            in-row positions (uint16 when row_len <= 65536, else uint32) and
//            their exact values (dtype). A decoder writes these values over
//            the reconstruction Q + A*B.
#ifndef KVTIER_KERNELS_CODEC_H_
#define KVTIER_KERNELS_CODEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/encoded_tensor.h"
#include "kvtier/v1/tensor.pb.h"

namespace kvtier {

// Which implementation runs a kernel. kBest picks the fastest one built and
// supported by this CPU (kVectorized when the CPU has AVX2+FMA+F16C).
enum class KernelLevel { kReference, kVectorized, kBest };

// The vectorized level the CPU runs under kBest, e.g. "avx2+fma+f16c+bmi2",
// or "scalar (reference)" without AVX2 (or with KVTIER_SIMD=off).
const char* VectorIsaName();

// What to encode with. Defaults follow ALGORITHMS.md §3.
struct CodecConfig {
  v1::Codec codec = v1::CODEC_KIVI;
  // KIVI/KCVT: 2, 4 or 8. GEAR/GEAR-L: the backbone's bits, 2 or 4.
  int bits = 4;
  // Tokens (K) / channels (V) per group for KIVI and a KIVI backbone.
  int group_size = 32;
  // Newest tokens kept in full precision.
  int residual_tokens = 0;
  // GEAR low-rank rank per slab (0 = none).
  int rank = 4;
  // GEAR outlier fraction s in [0, 0.5].
  float outlier_fraction = 0.02f;
  // GEAR backbone: CODEC_KIVI or CODEC_KCVT.
  v1::Codec backbone = v1::CODEC_KIVI;
  // Storage dtype of raw elements, residual and outlier values.
  v1::DType dtype = v1::DTYPE_FP16;
  // Streaming block length n_b (KvStream); recorded in the tensor.
  int block_tokens = 0;
};

// Parses a setting such as "raw", "fp32", "kivi4", "kivi2:g=64:R=128",
// "kcvt4", "gear2:r=4:s=0.02", "gearl2:r=1", "gear4:bb=kcvt". Keys: g (group),
// R (residual tokens), r (rank), s (outlier fraction), nb (block tokens),
// bb (backbone kivi|kcvt), dt (fp16|bf16|fp32).
absl::StatusOr<CodecConfig> ParseCodecSetting(const std::string& setting);
// The canonical text of a config, parseable by ParseCodecSetting.
std::string CodecSettingName(const CodecConfig& c);

// Checks a config for encoding a [slabs, tokens, head_dim] tensor.
absl::Status ValidateCodecConfig(const CodecConfig& c);

// The params message a config produces (fields a codec does not use are 0).
v1::CodecParams ToParams(const CodecConfig& c);

// Encodes `data` (fp32, row-major `shape`, last two dims [tokens, head_dim]).
// INVALID_ARGUMENT for a bad config or shape, or a non-finite input or one
// beyond fp16 range where fp16 metadata must hold it.
absl::StatusOr<v1::EncodedTensor> Encode(const CodecConfig& c, v1::TensorRole role,
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
  static absl::StatusOr<TensorEncoder> Make(const CodecConfig& c, v1::TensorRole role,
                                            absl::Span<const int64_t> shape,
                                            uint32_t layer_begin = 0);
  size_t SerializedSize() const { return size_; }
  absl::StatusOr<uint8_t*> EncodeTo(const float* data, uint8_t* out,
                                    KernelLevel level = KernelLevel::kBest) const;
  // The same from `data` in `dtype` (fp16, bf16 or fp32). A raw codec whose
  // dtype is the input's stores the elements as they are; any other widens
  // them into `scratch` first (reused across calls by the caller).
  absl::StatusOr<uint8_t*> EncodeTo(const void* data, v1::DType dtype, uint8_t* out,
                                    std::vector<float>* scratch,
                                    KernelLevel level = KernelLevel::kBest) const;

 private:
  TensorEncoder() = default;
  CodecConfig config_;
  v1::TensorRole role_ = v1::TENSOR_ROLE_UNSPECIFIED;
  std::vector<int64_t> shape_;
  std::string meta_;  // Fields 1 to 7, serialized.
  size_t size_ = 0;
};

// Sum of the buffer bytes Encode produces for this config and shape.
absl::StatusOr<int64_t> EncodedBufferBytes(const CodecConfig& c, v1::TensorRole role,
                                           absl::Span<const int64_t> shape);

// A validated, non-owning view of an encoded (or raw in-memory) K or V block.
// Every size and index has been checked, so kernels read it without checks.
struct EncodedView {
  v1::Codec codec = v1::CODEC_RAW;
  v1::TensorRole role = v1::TENSOR_ROLE_UNSPECIFIED;
  v1::DType dtype = v1::DTYPE_FP32;
  int bits = 0;
  int group = 0;  // Effective group: K tokens (KCVT: Tq), V channels (KCVT: D).
  int64_t slabs = 0;
  int64_t tokens = 0;     // T
  int head_dim = 0;       // D
  int64_t quantized = 0;  // Tq
  int64_t residual = 0;   // T - Tq
  // CODEC_RAW: element (s, t, d) sits at raw + s*slab_stride + t*token_stride + d
  // (in dtype elements). Encoded raw tensors are dense.
  const void* raw = nullptr;
  int64_t slab_stride = 0;
  int64_t token_stride = 0;
  // Quantized part.
  const uint8_t* codes = nullptr;  // Per slab words_per_slab uint32 (unaligned).
  int64_t words_per_slab = 0;
  const uint16_t* scales = nullptr;  // fp16, see the layout above.
  const uint16_t* zeros = nullptr;
  int64_t groups_per_slab = 0;          // Scale entries per slab.
  const void* residual_data = nullptr;  // [slabs, residual, D] dtype.
  // GEAR.
  int rank = 0;
  const uint16_t* lowrank_a = nullptr;  // [slabs, Tq, r] fp16.
  const uint16_t* lowrank_b = nullptr;  // [slabs, r, D] fp16.
  int outliers_per_row = 0;             // 2*m.
  int64_t sparse_rows_per_slab = 0;     // K: D, V: Tq.
  int sparse_index_bytes = 0;           // 2 or 4.
  const uint8_t* sparse_index = nullptr;
  const uint8_t* sparse_value = nullptr;  // dtype elements.

  // A dense or strided fp32/fp16/bf16 block that lives in memory.
  static EncodedView Raw(v1::DType dtype, const void* data, int64_t slabs, int64_t tokens,
                         int head_dim, int64_t slab_stride, int64_t token_stride);
};

// Validates `t` fully (format checks, CRC, every buffer's exact size, sparse
// positions) and returns a view into its buffers. `t` must outlive the view.
// INVALID_ARGUMENT for a malformed tensor, DATA_LOSS for a CRC mismatch.
// verify_crc = false: every check but the checksum (see ValidateTensor).
absl::StatusOr<EncodedView> ParseEncoded(const v1::EncodedTensor& t, bool verify_crc = true);
// The same over a tensor split in place by SplitPayload (which validated its
// format): the view points into the payload's bytes, which must outlive it.
absl::StatusOr<EncodedView> ParseEncoded(const TensorParts& t);

// Decodes rows [t0, t1) of slab `s` into out[(t - t0) * D + d].
void DecodeRows(const EncodedView& v, int64_t s, int64_t t0, int64_t t1, float* out,
                KernelLevel level = KernelLevel::kBest);

// Decodes a whole tensor into fp32, row-major over its shape.
absl::StatusOr<std::vector<float>> Decode(const v1::EncodedTensor& t,
                                          KernelLevel level = KernelLevel::kBest);

// Serialized size of the tensor, all metadata included.
int64_t EncodedTotalBytes(const v1::EncodedTensor& t);

}  // namespace kvtier

#endif  // KVTIER_KERNELS_CODEC_H_
