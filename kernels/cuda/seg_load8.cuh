// Eight consecutive elements of a SegKv block's row at a time, and the L2
// prefetch of what they read (device code for the span kernels,
// span_kernels.cuh): SegLoad's values (seg_load.h), with 16-byte loads where
// the layout allows.
#ifndef KVTIER_KERNELS_CUDA_SEG_LOAD8_CUH_
#define KVTIER_KERNELS_CUDA_SEG_LOAD8_CUH_

#include <cstdint>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/seg_load.h"

namespace kvtier::cuda {
namespace {

// Elements [i, i + 8) of a fp32 (0), fp16 (1) or bf16 (2) array; 16-byte
// loads where the address allows.
__device__ __forceinline__ void LoadDtype8(int dtype, const void* p, int64_t i, float* x) {
  if (dtype == 0) {
    const float* f = static_cast<const float*>(p) + i;
    if ((reinterpret_cast<uintptr_t>(f) & 15) == 0) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(f));
      const float4 b = __ldg(reinterpret_cast<const float4*>(f) + 1);
      x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
      x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
      return;
    }
  } else {
    const uint16_t* h = static_cast<const uint16_t*>(p) + i;
    if ((reinterpret_cast<uintptr_t>(h) & 15) == 0) {
      const uint4 u = __ldg(reinterpret_cast<const uint4*>(h));
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint16_t lo = static_cast<uint16_t>(w[e] & 0xffffu);
        const uint16_t hi = static_cast<uint16_t>(w[e] >> 16);
        x[2 * e] = dtype == 1 ? SegHalf(lo) : SegBf16(lo);
        x[2 * e + 1] = dtype == 1 ? SegHalf(hi) : SegBf16(hi);
      }
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) x[e] = SegLoadDtype(dtype, p, i + e);
}

// t / group, with a shift for the usual power-of-two group (a 32-bit
// division costs a GPU tens of instructions a row).
__device__ __forceinline__ uint32_t TokenGroup(int64_t t, uint32_t group) {
  return (group & (group - 1)) == 0 ? static_cast<uint32_t>(t) >> (__ffs(group) - 1)
                                    : static_cast<uint32_t>(t) / group;
}

// Elements (t, c0 .. c0 + 7) of a block's K or V: SegLoad's values, c0 and d
// multiples of 8.
__device__ __forceinline__ void SegLoad8(const SegKv& kv, int d, int64_t t, int c0, float* x) {
  if (kv.quantized_kind == 0) {
    LoadDtype8(kv.dtype, kv.raw, t * kv.token_stride + c0, x);
    return;
  }
  if (t >= kv.quantized) {
    LoadDtype8(kv.dtype, kv.residual, (t - kv.quantized) * d + c0, x);
    return;
  }
  const int64_t i = t * d + c0;  // A multiple of 8: the codes sit in whole words.
  uint32_t lo, hi = 0;
  if (kv.bits == 4) {
    lo = __ldg(kv.codes + (i >> 3));
  } else if (kv.bits == 2) {
    lo = __ldg(kv.codes + (i >> 4)) >> ((i & 15) * 2);
  } else {
    lo = __ldg(kv.codes + (i >> 2));
    hi = __ldg(kv.codes + (i >> 2) + 1);
  }
  float code[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const uint32_t c = kv.bits == 4   ? (lo >> (4 * e)) & 15u
                       : kv.bits == 2 ? (lo >> (2 * e)) & 3u
                                      : ((e < 4 ? lo : hi) >> (8 * (e & 3))) & 255u;
    // The code in the low mantissa bits of 2^23, less 2^23: exact, and two
    // full-rate operations where an integer conversion is quarter-rate.
    code[e] = __uint_as_float(0x4B000000u | c) - 8388608.0f;
  }
  const auto ug = static_cast<uint32_t>(kv.group);
  if (kv.key != 0) {
    // Scales and zeros per (token group, channel): 8 consecutive halves.
    const int64_t si = static_cast<int64_t>(TokenGroup(t, ug)) * d + c0;
    float sc[8], ze[8];
    LoadDtype8(1, kv.scales, si, sc);
    LoadDtype8(1, kv.zeros, si, ze);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = code[e] * sc[e] + ze[e];
    return;
  }
  // V: per (token, channel group); one group for all 8 when groups are
  // multiples of 8 channels.
  const int64_t row = t * static_cast<int64_t>((static_cast<uint32_t>(d) + ug - 1) / ug);
  if (ug % 8 == 0) {
    const int64_t si = row + static_cast<uint32_t>(c0) / ug;
    const float sc = SegHalf(__ldg(kv.scales + si)), ze = SegHalf(__ldg(kv.zeros + si));
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = code[e] * sc + ze;
    return;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int64_t si = row + static_cast<uint32_t>(c0 + e) / ug;
    x[e] = code[e] * SegHalf(__ldg(kv.scales + si)) + SegHalf(__ldg(kv.zeros + si));
  }
}

// Asks L2 for the lines holding what SegLoad8(kv, d, t, c0, .) reads:
// prefetch.global.L2 neither holds a register nor waits.
__device__ __forceinline__ void PrefetchL2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
__device__ __forceinline__ void SegPrefetch8(const SegKv& kv, int d, int64_t t, int c0) {
  const int64_t size = kv.dtype == 0 ? 4 : 2;
  if (kv.quantized_kind == 0) {
    PrefetchL2(static_cast<const char*>(kv.raw) + (t * kv.token_stride + c0) * size);
    return;
  }
  if (t >= kv.quantized) {
    PrefetchL2(static_cast<const char*>(kv.residual) + ((t - kv.quantized) * d + c0) * size);
    return;
  }
  PrefetchL2(kv.codes + (((t * d + c0) * kv.bits) >> 5));
  const auto ug = static_cast<uint32_t>(kv.group);
  const int64_t si = kv.key != 0
                         ? static_cast<int64_t>(TokenGroup(t, ug)) * d + c0
                         : t * static_cast<int64_t>((static_cast<uint32_t>(d) + ug - 1) / ug) +
                               static_cast<uint32_t>(c0) / ug;
  PrefetchL2(kv.scales + si);
  PrefetchL2(kv.zeros + si);
}

}  // namespace
}  // namespace kvtier::cuda

#endif  // KVTIER_KERNELS_CUDA_SEG_LOAD8_CUH_
