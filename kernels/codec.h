// KV codecs (ALGORITHMS.md §3): raw, KIVI-style asymmetric min-max, KCVT,
// GEAR and GEAR-L, into buffers laid out as below. encoded/encode.h puts
// them in tensor.proto's EncodedTensor; nothing here knows protobuf.
//
// A tensor's logical shape is [..., tokens, head_dim]: every leading
// dimension together counts "slabs" (one slab = one KV head of one layer), and
// each slab is a row-major [tokens, head_dim] matrix that the codec encodes on
// its own. Inputs are fp32 in memory; the tensor's dtype is the storage type
// of what stays in full precision (raw elements, residual tokens, sparse
// outlier values).
//
// Buffer layout of format_version 1 (all little-endian; per-slab parts are
// concatenated slab after slab):
//   RAW          [RAW]
//   KIVI/KCVT    [CODES, SCALES, ZEROS] + [RESIDUAL] when the residual is
//                  not empty.
//   GEAR         KIVI's buffers + [LOWRANK_A, LOWRANK_B] when rank > 0 +
//                  [SPARSE_INDEX, SPARSE_VALUE].
//   GEAR_L       KIVI's buffers + [LOWRANK_A, LOWRANK_B] when rank > 0.
// Of a slab's T tokens the oldest Tq = T - min(R, T) are quantized and the
// newest min(R, T) form the residual (R = residual_tokens).
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
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/tensor_kinds.h"

namespace kvtier {

// Which implementation runs a kernel. kBest picks the fastest one built and
// supported by this CPU (kVectorized when the CPU has AVX2+FMA+F16C).
enum class KernelLevel { kReference, kVectorized, kBest };

// The vectorized level the CPU runs under kBest, e.g. "avx2+fma+f16c+bmi2",
// or "scalar (reference)" without AVX2 (or with KVTIER_SIMD=off).
const char* VectorIsaName();

// What to encode with. Defaults follow ALGORITHMS.md §3.
struct CodecConfig {
  Codec codec = Codec::kKivi;
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
  // GEAR backbone: kKivi or kKcvt.
  Codec backbone = Codec::kKivi;
  // Storage dtype of raw elements, residual and outlier values.
  DType dtype = DType::kFp16;
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

// What an encoded tensor says of itself, all that its buffers' layout
// depends on: tensor.proto's EncodedTensor without format_version,
// layer_begin, buffers and checksum. Parameters a codec does not use are 0.
struct TensorHeader {
  Codec codec = Codec::kUnspecified;
  TensorRole role = TensorRole::kUnspecified;
  DType dtype = DType::kUnspecified;
  int bits = 0;
  int group_size = 0;
  int64_t residual_tokens = 0;
  int rank = 0;
  float outlier_fraction = 0;
  Codec backbone = Codec::kUnspecified;
  int block_tokens = 0;
  absl::InlinedVector<int64_t, 8> shape;
};

// The parameters `c` records in a tensor's header: those its codec uses
// (the others 0), the residual as configured (an encoded tensor's is at most
// its tokens). Role, dtype and shape are left unset.
TensorHeader ParamsHeader(const CodecConfig& c);

// One buffer of a tensor, as a view of bytes held elsewhere.
struct BufferView {
  BufferKind kind = BufferKind::kUnspecified;
  std::string_view data;
};

// One buffer a tensor of some header has, and its exact size.
struct BufferSize {
  BufferKind kind = BufferKind::kUnspecified;
  int64_t bytes = 0;
};

// Encodes fp32 (or fp16/bf16) [.., tokens, head_dim] tensors of one config,
// role and shape into buffers the caller places: Make() checks the config,
// role and shape; buffers() lists the buffers in the format's order and
// EncodeInto writes each at its pointer (every byte of it). Immutable:
// EncodeInto may run concurrently. encoded/encode.h frames the buffers as an
// EncodedTensor.
class BlockEncoder {
 public:
  // INVALID_ARGUMENT for a bad config or shape, or a quantized codec whose
  // role is neither key nor value.
  static absl::StatusOr<BlockEncoder> Make(const CodecConfig& c, TensorRole role,
                                           absl::Span<const int64_t> shape);

  // The header the encoded tensor carries (its residual is at most its
  // tokens).
  const TensorHeader& header() const { return header_; }
  const std::vector<BufferSize>& buffers() const { return buffers_; }
  // Sum of buffers()' sizes.
  int64_t buffer_bytes() const;

  // Writes buffer i at out[i] (out.size() == buffers().size()). INVALID_ARGUMENT
  // for a non-finite input, or one beyond fp16 range where fp16 must hold it;
  // then what it left in the buffers is unspecified (the check may run inside
  // the quantizer's pass over the data).
  absl::Status EncodeInto(const float* data, absl::Span<uint8_t* const> out,
                          KernelLevel level = KernelLevel::kBest) const;
  // The same from `data` in `dtype` (fp16, bf16 or fp32). A raw codec whose
  // dtype is the input's stores the elements as they are; any other widens
  // them into `scratch` first (reused across calls by the caller).
  absl::Status EncodeInto(const void* data, DType dtype, absl::Span<uint8_t* const> out,
                          std::vector<float>* scratch,
                          KernelLevel level = KernelLevel::kBest) const;

 private:
  BlockEncoder() = default;
  CodecConfig config_;
  TensorRole role_ = TensorRole::kUnspecified;
  TensorHeader header_;
  std::vector<BufferSize> buffers_;
};

// Sum of the buffer bytes a tensor of this config and shape has.
absl::StatusOr<int64_t> EncodedBufferBytes(const CodecConfig& c, TensorRole role,
                                           absl::Span<const int64_t> shape);

// A validated, non-owning view of an encoded (or raw in-memory) K or V block.
// Every size and index has been checked, so kernels read it without checks.
struct EncodedView {
  Codec codec = Codec::kRaw;
  TensorRole role = TensorRole::kUnspecified;
  DType dtype = DType::kFp32;
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
  static EncodedView Raw(DType dtype, const void* data, int64_t slabs, int64_t tokens, int head_dim,
                         int64_t slab_stride, int64_t token_stride);
};

// A view of the tensor `header` describes over its `buffers`. Checks each
// buffer's kind and exact size against the layout the header gives, and
// GEAR's sparse positions; INVALID_ARGUMENT naming the first mismatch. The
// header's own fields must have passed the format's checks
// (encoded/encoded_tensor.h, ValidateTensor). The buffers must outlive the
// view.
absl::StatusOr<EncodedView> ViewOf(const TensorHeader& header,
                                   absl::Span<const BufferView> buffers);

// Decodes rows [t0, t1) of slab `s` into out[(t - t0) * D + d].
void DecodeRows(const EncodedView& v, int64_t s, int64_t t0, int64_t t1, float* out,
                KernelLevel level = KernelLevel::kBest);

// Decodes a whole view into fp32, [slabs, tokens, head_dim] row-major.
std::vector<float> DecodeAll(const EncodedView& v, KernelLevel level = KernelLevel::kBest);

// An encoded tensor held in memory: its header, its buffers in one
// allocation, and a view of them. Movable; the view stays valid across moves.
class EncodedBlock {
 public:
  // Encodes as BlockEncoder does; its errors.
  static absl::StatusOr<EncodedBlock> Encode(const CodecConfig& c, TensorRole role,
                                             absl::Span<const int64_t> shape, const float* data,
                                             KernelLevel level = KernelLevel::kBest);
  EncodedBlock(EncodedBlock&&) = default;
  EncodedBlock& operator=(EncodedBlock&&) = default;

  const TensorHeader& header() const { return header_; }
  const EncodedView& view() const { return view_; }
  // Each buffer, in the format's order.
  const std::vector<BufferView>& buffers() const { return buffers_; }
  // The buffers, back to back in the format's order.
  std::string_view bytes() const {
    return {reinterpret_cast<const char*>(data_.get()), static_cast<size_t>(size_)};
  }

 private:
  EncodedBlock() = default;
  TensorHeader header_;
  std::unique_ptr<uint8_t[]> data_;
  int64_t size_ = 0;
  std::vector<BufferView> buffers_;  // Into data_.
  EncodedView view_;
};

}  // namespace kvtier

#endif  // KVTIER_KERNELS_CODEC_H_
