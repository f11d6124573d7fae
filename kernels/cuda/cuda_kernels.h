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

}  // namespace kvtier::cuda

#endif  // KVTIER_KERNELS_CUDA_CUDA_KERNELS_H_
