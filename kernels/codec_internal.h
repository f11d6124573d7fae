// Per-slab kernels behind kernels/codec.h and kernels/attention.h, one set per
// implementation level. Not part of the public interface.
#ifndef KVTIER_KERNELS_CODEC_INTERNAL_H_
#define KVTIER_KERNELS_CODEC_INTERNAL_H_

#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/codec.h"
#include "kernels/half.h"

namespace kvtier::internal {

// One slab's quantized part: `tq` rows of `d` channels.
struct QuantShape {
  bool key = true;  // K: groups of `group` tokens per channel; V: of `group` channels per token.
  int bits = 4;
  int group = 32;
  int64_t tq = 0;
  int d = 0;
};

inline int64_t CodeWords(const QuantShape& q) { return (q.tq * q.d * q.bits + 31) / 32; }
inline int64_t ScaleCount(const QuantShape& q) {
  if (q.tq == 0) return 0;
  return q.key ? ((q.tq + q.group - 1) / q.group) * q.d : q.tq * ((q.d + q.group - 1) / q.group);
}

// Element (t, c) of a slab's quantized rows, code * scale + zero in fp32 (the
// vectorized dequantizer's arithmetic), for the few elements a kernel needs
// one at a time, such as GEAR's outlier positions. Divisions by the shape
// are resolved once, in the constructor.
class ElementDequantizer {
 public:
  ElementDequantizer(const QuantShape& q, const uint8_t* codes, const uint16_t* scales,
                     const uint16_t* zeros)
      : q_(q), codes_(codes), scales_(scales), zeros_(zeros) {
    word_shift_ = __builtin_ctz(32 / q.bits);  // bits is 2, 4 or 8.
    group_shift_ = (q.group & (q.group - 1)) == 0 ? __builtin_ctz(q.group) : -1;
    v_groups_ = (q.d + q.group - 1) / q.group;
  }
  float operator()(int64_t t, int c) const {
    const int64_t i = t * q_.d + c;
    uint32_t w;
    std::memcpy(&w, codes_ + (i >> word_shift_) * 4, 4);
    const uint32_t code =
        (w >> ((i & ((int64_t{1} << word_shift_) - 1)) * q_.bits)) & ((1u << q_.bits) - 1u);
    const int64_t si = q_.key ? Group(t) * q_.d + c : t * v_groups_ + Group(c);
    uint16_t hs, hz;
    std::memcpy(&hs, reinterpret_cast<const char*>(scales_) + 2 * si, 2);
    std::memcpy(&hz, reinterpret_cast<const char*>(zeros_) + 2 * si, 2);
    return static_cast<float>(code) * HalfToFloat(hs) + HalfToFloat(hz);
  }

 private:
  int64_t Group(int64_t x) const { return group_shift_ >= 0 ? x >> group_shift_ : x / q_.group; }

  QuantShape q_;
  const uint8_t* codes_;
  const uint16_t* scales_;
  const uint16_t* zeros_;
  int word_shift_ = 0;
  int group_shift_ = -1;
  int64_t v_groups_ = 1;
};

// Reference: float64 arithmetic, plain loops. `codes` must be zeroed,
// CodeWords(q) * 4 bytes.
void QuantizeSlabRef(const QuantShape& q, const float* x, uint8_t* codes, uint16_t* scales,
                     uint16_t* zeros);
void DequantRowsRef(const QuantShape& q, const uint8_t* codes, const uint16_t* scales,
                    const uint16_t* zeros, int64_t t0, int64_t t1, float* out);

// Vectorized (AVX2+FMA+F16C+BMI2). They return false, doing nothing, when the
// CPU or the shape is not supported; callers then use the reference.
bool SimdAvailable();
// Whether the CPU has AVX-512 VNNI as the integer attention kernels use it
// (AVX512F/BW/VL/VNNI/VBMI) and KVTIER_VNNI is not "off"; VnniAvailable() is
// that and SetVnni has not turned the VNNI kernels off (tests and benchmarks
// compare both paths in one process). SetVnni returns the previous setting.
bool VnniCpu();
bool VnniAvailable();
bool SetVnni(bool on);
// `max_abs_bits`, when not null, is raised to the largest |x| of the slab's
// quantized rows as float bits (Inf and NaN compare above every finite
// value): the input check of Encode, fused into the pass that reads x.
bool QuantizeSlabSimd(const QuantShape& q, const float* x, uint8_t* codes, uint16_t* scales,
                      uint16_t* zeros, uint32_t* max_abs_bits = nullptr);
// The same over fp16 (or, with `bf16`, bf16) input, read without a widened
// fp32 copy; the codes equal QuantizeSlabSimd's over the widened input.
bool QuantizeSlab16Simd(const QuantShape& q, const uint16_t* x, bool bf16, uint8_t* codes,
                        uint16_t* scales, uint16_t* zeros, uint32_t* max_abs_bits);
bool DequantRowsSimd(const QuantShape& q, const uint8_t* codes, const uint16_t* scales,
                     const uint16_t* zeros, int64_t t0, int64_t t1, float* out);

// Attention pieces for one KV head (slab `s` of a block) and its `n_rep`
// query heads. Scores: scores[r][t] = scale * q[r] . k_t for the block's
// tokens. Accumulate: out[r][:] += sum_t p[r][t] * v_t. `integer`: 2- and
// 4-bit KIVI/KCVT codes (head_dim a multiple of 32) are multiplied as
// integers against q and p rounded to int8 per group (kernels/attention.h);
// otherwise every product is fp32.
bool ScoreBlockSimd(const EncodedView& k, int64_t s, const float* const* q, int n_rep, float scale,
                    float* const* scores, bool integer = false);
bool AccumulateBlockSimd(const EncodedView& v, int64_t s, const float* const* p, int n_rep,
                         float* const* out, bool integer = false);

// The index of the first element of x[0, n) that is not finite or whose
// magnitude passes `limit` (itself finite), or -1 when there is none. False
// without SIMD.
bool FirstOutOfRangeSimd(const float* x, int64_t n, float limit, int64_t* first);

// out[i] = x[i] widened from fp16 (or bf16 when `bf16`). False without SIMD.
bool WidenSimd(const uint16_t* x, bool bf16, int64_t n, float* out);

// y[i] += a * x[i], and *dot = x . y, over n floats. False without SIMD.
bool AxpySimd(float a, const float* x, int64_t n, float* y);
bool DotSimd(const float* x, const float* y, int64_t n, float* dot);

// Softmax in place over n scores (vectorized exp). False without SIMD.
bool SoftmaxSimd(float* x, int64_t n);

// Reads one element of a raw block (dtype element at `ptr[index]`).
float LoadElement(DType dtype, const void* ptr, int64_t index);

// p[i] for fp16 bits that may sit at any address: views of a segment
// payload point into its serialized bytes, where protobuf's framing leaves
// buffers unaligned.
inline uint16_t LoadU16(const uint16_t* p, int64_t i) {
  uint16_t h;
  std::memcpy(&h, reinterpret_cast<const char*>(p) + 2 * i, 2);
  return h;
}

// Entry i of a GEAR sparse-index buffer of 2- or 4-byte positions (at any
// address).
inline int64_t ReadSparseIndex(const uint8_t* p, int bytes, int64_t i) {
  if (bytes == 2) {
    uint16_t v;
    std::memcpy(&v, p + i * 2, 2);
    return v;
  }
  uint32_t v;
  std::memcpy(&v, p + i * 4, 4);
  return v;
}

// Stores element i of a 16-bit array that may be unaligned (buffers encoded
// in place inside a serialized segment sit at any address).
inline void StoreU16(uint16_t* p, int64_t i, uint16_t v) { std::memcpy(p + i, &v, 2); }

// Shared by kernels/codec.cc, codec_decode.cc and codec_setting.cc.
bool IsGear(Codec c);
bool IsQuantized(Codec c);
// The vectorized kernels run at `level` on this CPU.
bool UseSimd(KernelLevel level);

// Everything the sizes of a tensor's buffers depend on.
struct Layout {
  Codec codec = Codec::kRaw;
  Codec backbone = Codec::kRaw;
  bool key = true;
  int dsize = 2;
  int64_t slabs = 0, tokens = 0, tq = 0, res = 0;
  int d = 0;
  QuantShape q;
  int rank = 0;
  int outliers_per_row = 0;
  int64_t sparse_rows = 0, sparse_row_len = 0;
  int index_bytes = 2;

  int64_t code_bytes() const { return slabs * internal::CodeWords(q) * 4; }
  int64_t scale_bytes() const { return slabs * internal::ScaleCount(q) * 2; }
  int64_t residual_bytes() const { return slabs * res * d * dsize; }
  int64_t a_bytes() const { return slabs * tq * rank * 2; }
  int64_t b_bytes() const { return slabs * rank * d * 2; }
  int64_t sparse_count() const { return slabs * sparse_rows * outliers_per_row; }
};

// The layout of a tensor of `shape` under these parameters;
// INVALID_ARGUMENT naming what does not fit.
absl::StatusOr<Layout> MakeLayout(Codec codec, Codec backbone, TensorRole role, DType dtype,
                                  int bits, int group, int64_t residual, int rank,
                                  float outlier_fraction, absl::Span<const int64_t> shape);

// The buffers a tensor of this layout has, in the format's order, with their
// sizes in bytes.
std::vector<BufferSize> BufferList(const Layout& l);

// Rows [t0, t1) of one quantized slab, dequantized into `out`.
void Dequant(const QuantShape& q, const uint8_t* codes, const uint16_t* scales,
             const uint16_t* zeros, int64_t t0, int64_t t1, float* out, KernelLevel level);

}  // namespace kvtier::internal

#endif  // KVTIER_KERNELS_CODEC_INTERNAL_H_
