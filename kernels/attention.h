// Decode-step attention (one query per head) over a layer's K/V held as a
// sequence of blocks, each raw or codec-encoded. One interface for both, so
// a caller attends over whatever mix of encoded history and full-precision
// tail it holds. Encoded blocks are read directly: dequantization is fused
// into q.K^T and P.V (KIVI/KCVT, and GEAR's backbone, whose low-rank term and
// outliers are added as corrections), never into a full-size copy.
#ifndef KVTIER_KERNELS_ATTENTION_H_
#define KVTIER_KERNELS_ATTENTION_H_

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/codec.h"

namespace kvtier {

struct AttentionShape {
  int q_heads = 0;
  int kv_heads =
      0;  // q_heads must be a multiple (GQA: q head h uses kv head h / (q_heads / kv_heads)).
  int head_dim = 0;
  float scale = 0.0f;  // 0 means 1 / sqrt(head_dim).
};

// K and V of the same tokens, each with kv_heads slabs of [tokens, head_dim].
struct KvBlock {
  EncodedView k;
  EncodedView v;
};

// out[h][:] = softmax_t(scale * q[h] . k_t) . v over every block's tokens, in
// order. q and out are [q_heads, head_dim] fp32. INVALID_ARGUMENT when a
// block does not match the shape (slabs, head_dim, K/V token counts or roles)
// or there are no tokens at all.
//
// Levels: kReference computes in float64; kVectorized in fp32 with AVX2;
// kBest is kVectorized except over 2- and 4-bit KIVI/KCVT codes (head_dim a
// multiple of 32), where it multiplies the codes as integers: per K group
// and query head, scale * q * s_k is rounded to int8, and per 16 tokens, V
// group and query head, p * s_v is (llama.cpp's approach for 4-bit weights);
// and over 8-bit codes (head_dim and V groups multiples of 16), where both
// are rounded to int16 and the codes widened to int16 (vpmaddwd). On CPUs
// with AVX-512 VNNI the 2- and 4-bit products use vpdpwssd (q rounded to
// int16) and vpdpbusd instead (IntegerDotIsa()). That rounding adds an error
// well below the codes' own (docs/codecs.md); KVTIER_INT8_ATTENTION=off turns
// it off, KVTIER_VNNI=off keeps the AVX2 kernels.
absl::Status DecodeAttention(const AttentionShape& shape, const float* q,
                             absl::Span<const KvBlock> blocks, float* out,
                             KernelLevel level = KernelLevel::kBest);

// Whether kBest multiplies 2- and 4-bit codes as integers (AVX2 present and
// KVTIER_INT8_ATTENTION is not "off").
bool Int8AttentionEnabled();

// The instructions of those integer products here: "avx512-vnni" (vpdpbusd,
// on CPUs with AVX512F/BW/VL/VNNI/VBMI: Ice Lake, Zen 4 and later, unless
// KVTIER_VNNI=off) or "avx2" (vpmaddubsw); "none" when kBest keeps fp32
// products.
const char* IntegerDotIsa();

// Restricts a view to `count` slabs starting at `first` (e.g. one layer of a
// [layers, kv_heads, tokens, head_dim] tensor).
EncodedView SliceSlabs(const EncodedView& v, int64_t first, int64_t count);

}  // namespace kvtier

#endif  // KVTIER_KERNELS_ATTENTION_H_
