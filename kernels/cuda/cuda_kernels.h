// CUDA versions of the KIVI/KCVT quantize and dequantize kernels and of
// fused decode attention over KIVI-encoded or raw fp16 K/V. Same layouts as
// kernels/codec.h (per-slab word-aligned codes, fp16 scales and zeros), so a
// tensor encoded on the GPU decodes on the CPU and the other way round.
//
// Plain C++ interface (no CUDA or Abseil types) so that nvcc compiles the .cu
// file alone. All pointers are device pointers; functions return 0 or a
// cudaError_t value, and run on `stream` (a cudaStream_t, or null).
#ifndef KVTIER_KERNELS_CUDA_CUDA_KERNELS_H_
#define KVTIER_KERNELS_CUDA_CUDA_KERNELS_H_

#include <cstdint>

#ifdef __CUDACC__
#define KVT_HOST_DEVICE __host__ __device__
#else
#define KVT_HOST_DEVICE
#endif

namespace kvtier::cuda {

// True when the CUDA runtime sees at least one device.
bool DeviceAvailable();
// The runtime's text for an error code.
const char* ErrorString(int err);

struct QuantDims {
  bool key = true;  // K: groups of `group` tokens per channel; V: of `group` channels per token.
  int bits = 4;     // 2, 4 or 8.
  int group = 32;   // Effective group (KCVT: tq for K, d for V).
  int64_t tq = 0;   // Quantized tokens per slab.
  int d = 0;        // head_dim, <= 1024.
  int64_t slabs = 0;
  KVT_HOST_DEVICE int64_t WordsPerSlab() const { return (tq * d * bits + 31) / 32; }
  KVT_HOST_DEVICE int64_t GroupsPerSlab() const {
    return key ? ((tq + group - 1) / group) * d : tq * ((d + group - 1) / group);
  }
};

// x: [slabs, tq, d] fp32 -> codes [slabs, WordsPerSlab] (zeroed here first),
// scales/zeros [slabs, GroupsPerSlab] fp16 bits.
int Quantize(const QuantDims& q, const float* x, uint32_t* codes, uint16_t* scales, uint16_t* zeros,
             void* stream);
// The inverse: out [slabs, tq, d] fp32.
int Dequantize(const QuantDims& q, const uint32_t* codes, const uint16_t* scales,
               const uint16_t* zeros, float* out, void* stream);

// One layer's K or V on the device: KIVI/KCVT-encoded (bits > 0, role as in
// QuantDims) or raw fp16 [kv_heads, tokens, d] (bits == 0).
struct DeviceKv {
  int bits = 0;
  int group = 0;
  const uint16_t* raw = nullptr;
  const uint32_t* codes = nullptr;
  const uint16_t* scales = nullptr;
  const uint16_t* zeros = nullptr;
};

struct AttnDims {
  int q_heads = 0;
  int kv_heads = 0;
  int d = 0;  // <= 256.
  int64_t tokens = 0;
  float scale = 0.0f;
};

// out[q_heads, d] = softmax(scale * q K^T) V, GQA aware, dequantizing inside
// both products. scratch: q_heads * tokens floats.
int DecodeAttention(const AttnDims& a, const float* q, const DeviceKv& k, const DeviceKv& v,
                    float* scratch, float* out, void* stream);

// The Ada-KV flattened per-head cache on the device (kernels/flat_cache.h):
// one fp16 K and one fp16 V tensor [rows, d] per layer; head h's tokens are
// rows [offsets[h], offsets[h] + lens[h]). offsets, lens and cu_len live on
// the device; cu_len[h] is the packed prefix sum of lens (H + 1 entries).
struct FlatDims {
  int q_heads = 0;
  int kv_heads = 0;
  int d = 0;            // <= 256.
  int64_t max_len = 0;  // >= every lens[h]: sizes the grids.
  float scale = 0.0f;
};

// Gathers kept tokens from dense fp32 K or V [kv_heads, tokens, d]: idx holds
// every head's kept token indices, packed by cu_len (cu_len[kv_heads] in
// total, passed as `kept`), and row i of head h goes to offsets[h] + i.
int FlatGather(const FlatDims& f, int64_t tokens, int64_t kept, const float* src,
               const int64_t* idx, const int64_t* cu_len, const int64_t* offsets, uint16_t* dst,
               void* stream);

// Appends one token per head (k, v [kv_heads, d] fp32) at row
// offsets[h] + lens[h], then increments lens[h]. The caller guarantees the
// capacity (re-packing when a head is full, as the CPU cache does).
int FlatAppend(const FlatDims& f, const float* k, const float* v, const int64_t* offsets,
               int64_t* lens, uint16_t* k_flat, uint16_t* v_flat, void* stream);

// Decode attention over the flat cache: out [q_heads, d] for q [q_heads, d];
// query head j uses KV head j / (q_heads / kv_heads) and only its lens[h]
// tokens. A head with no tokens gives zeros. scratch: q_heads * max_len floats.
int FlatDecodeAttention(const FlatDims& f, const float* q, const uint16_t* k_flat,
                        const uint16_t* v_flat, const int64_t* offsets, const int64_t* lens,
                        float* scratch, float* out, void* stream);

// Attention over a list of blocks per KV head, each in its own encoding: the
// worker's device working set (worker/device/attention.h). One K or V of one
// block: raw (fp32/fp16/bf16 elements at raw + t * token_stride + c) or
// KIVI/KCVT-quantized (one slab as in QuantDims, then `tokens - quantized`
// dense residual rows of `dtype`).
struct SegKv {
  int quantized_kind = 0;  // 0: raw; 1: KIVI/KCVT.
  int dtype = 0;           // 0: fp32, 1: fp16, 2: bf16 (raw and residual rows).
  int bits = 0;
  int group = 0;  // Effective group, as in QuantDims.
  int key = 1;    // Quantized K (groups of tokens per channel) or V.
  int64_t quantized = 0;
  int64_t token_stride = 0;  // Raw only.
  const void* raw = nullptr;
  const uint32_t* codes = nullptr;
  const uint16_t* scales = nullptr;
  const uint16_t* zeros = nullptr;
  const void* residual = nullptr;
};

struct SegBlock {
  int64_t tokens = 0;
  // The open round: query i of the call sees its first base + i + 1 tokens.
  int causal = 0;
  SegKv k, v;
};

struct SegDims {
  int n = 0;  // Queries (new tokens) in the call.
  int q_heads = 0;
  int kv_heads = 0;
  int d = 0;               // <= 1024.
  int64_t base = 0;        // Position of query 0 in the causal block.
  int64_t max_tokens = 0;  // >= every KV head's total tokens: sizes scratch.
  float scale = 0.0f;      // 0: 1 / sqrt(d).
  // 0: the fastest kernel that fits; 1: one block per query and query head
  // over all its tokens (the general kernel); 2: spans with a channel a lane
  // (what path 0 runs when head_dim is not 64, 128 or 256 or the group not 1,
  // 2, 4 or 8 query heads); 3: spans with 8 channels a lane on the CUDA cores
  // only; 4: path 0 with only fp16 rows on the tensor cores. Path 0 takes
  // fp16 and 2/4-bit KIVI rows on the tensor cores for head_dim 64 and 128
  // (kernels/cuda/mma_tiles.cuh). Tests and benchmarks compare them.
  int path = 0;
  // The 8-channel span kernel's L2 prefetch distance, in loop iterations
  // (each a lane's next two rows): 0 turns it off, -1 takes the default.
  int prefetch = -1;
};

// out[i, j, :] = softmax over the blocks of KV head j / rep (blocks
// [head_first[h], head_first[h + 1]) of `blocks`) of scale * q[i, j] . k, times
// v. q and out are [n, q_heads, d] fp32; blocks and head_first (kv_heads + 1
// entries) live on the device; scratch holds SegmentedScratchFloats(dims)
// floats. A head with no visible token gives zeros.
//
// Up to 8 query heads per KV head and d <= 256, the tokens are split in spans
// (flash-decoding: a block per span, KV head and query, then a merge), read 8
// channels a lane for head_dim 64/128/256 and 1/2/4/8 query heads per KV
// head; otherwise one block per query and query head walks them all.
int SegmentedAttention(const SegDims& dims, const SegBlock* blocks, const int* head_first,
                       const float* q, float* scratch, float* out, void* stream);
// The scratch SegmentedAttention needs for `dims`, in floats.
int64_t SegmentedScratchFloats(const SegDims& dims);

// InfiniGen's speculation on the device: kernels/speculation.h's Speculate
// on the same inputs, after the skew. Query head j reads KV head
// h = j / (q_heads / kv_heads), whose partial keys are the fp16 rows
// [offsets[h], offsets[h] + lens[h]) of pk, r columns each; qp [q_heads, r] is
// each query head's skewed partial query. Then
//   scores[j, t] = scale * qp[j] . pk_h[t] (products and sums in order, no
//                  fused multiply-add, as the CPU reference),
//   counts[j]    = the tokens within alpha of head j's best score,
//   *n_out       = round(mean of counts), capped at budget when it is above 0,
//                  clamped to [1, max(1, max lens)],
//   idx row j    = the head's top min(n, lens[h]) tokens under the order
//                  (score, then earlier token), ascending.
// offsets, lens, counts, n_out live on the device; scores and idx are
// [q_heads, max_tokens], max_tokens >= every lens[h].
struct SpecDims {
  int q_heads = 0;
  int kv_heads = 0;
  int r = 0;  // Partial columns, <= 1024.
  int64_t max_tokens = 0;
  float scale = 0.0f;
  float alpha = 4.0f;
  int budget = 0;
};

int SpeculateSelect(const SpecDims& s, const float* qp, const uint16_t* pk, const int64_t* offsets,
                    const int64_t* lens, float* scores, int* counts, int* n_out, int32_t* idx,
                    void* stream);

}  // namespace kvtier::cuda

#endif  // KVTIER_KERNELS_CUDA_CUDA_KERNELS_H_
