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

}  // namespace kvtier::cuda

#endif  // KVTIER_KERNELS_CUDA_CUDA_KERNELS_H_
