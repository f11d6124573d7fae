// Element loads of KIVI/KCVT slabs and of kvtier::cuda::SegKv blocks
// (cuda_kernels.h), written once for the device kernels and the host, where
// worker/device_layout_test.cc checks them against the CPU codec's DecodeRows
// on the same bytes. The byte layouts are kernels/codec.h's: codes packed
// 32/bits per little-endian word, element (t, c) at index t * d + c; K scales
// per (token group, channel), V scales per (token, channel group); residual
// rows dense after the quantized ones.
#ifndef KVTIER_KERNELS_CUDA_SEG_LOAD_H_
#define KVTIER_KERNELS_CUDA_SEG_LOAD_H_

#include <cstdint>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/half.h"  // Host branch; plain C++.
#ifdef __CUDACC__
#include <cuda_fp16.h>
#endif

namespace kvtier::cuda {

KVT_HOST_DEVICE inline float SegHalf(uint16_t h) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(h));
#else
  return ::kvtier::HalfToFloat(h);
#endif
}

KVT_HOST_DEVICE inline float SegBf16(uint16_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
#else
  return ::kvtier::BitsFloat(static_cast<uint32_t>(b) << 16);
#endif
}

// Element i of a fp32 (0), fp16 (1) or bf16 (2) array.
KVT_HOST_DEVICE inline float SegLoadDtype(int dtype, const void* p, int64_t i) {
  if (dtype == 0) return static_cast<const float*>(p)[i];
  const uint16_t bits = static_cast<const uint16_t*>(p)[i];
  return dtype == 1 ? SegHalf(bits) : SegBf16(bits);
}

// Element (t, c) of one KIVI/KCVT slab: K (`key`) groups `group` tokens per
// channel, V groups `group` channels per token. bits: 2, 4 or 8.
KVT_HOST_DEVICE inline float DequantAt(const uint32_t* codes, const uint16_t* scales,
                                       const uint16_t* zeros, bool key, int bits, int group, int d,
                                       int64_t t, int c) {
  const int64_t i = t * d + c;
  // 2, 4 and 8 bits: 16, 8 and 4 codes a word, so shifts, not 64-bit
  // divisions (which cost a GPU tens of instructions an element).
  const int shift = bits == 2 ? 4 : bits == 4 ? 3 : 2;
  const uint32_t code =
      (codes[i >> shift] >> (static_cast<uint32_t>(i & ((1 << shift) - 1)) * bits)) &
      ((1u << bits) - 1u);
  // Group indices in 32 bits: a block's tokens and head_dim are far below 2^32.
  const auto ug = static_cast<uint32_t>(group);
  const int64_t si = key ? static_cast<int64_t>(static_cast<uint32_t>(t) / ug) * d + c
                         : t * static_cast<int64_t>((static_cast<uint32_t>(d) + ug - 1) / ug) +
                               static_cast<uint32_t>(c) / ug;
  return static_cast<float>(code) * SegHalf(scales[si]) + SegHalf(zeros[si]);
}

// Element (t, c) of a block's K or V, t < the block's tokens.
KVT_HOST_DEVICE inline float SegLoad(const SegKv& kv, int d, int64_t t, int c) {
  if (kv.quantized_kind == 0) return SegLoadDtype(kv.dtype, kv.raw, t * kv.token_stride + c);
  if (t >= kv.quantized) return SegLoadDtype(kv.dtype, kv.residual, (t - kv.quantized) * d + c);
  return DequantAt(kv.codes, kv.scales, kv.zeros, kv.key != 0, kv.bits, kv.group, d, t, c);
}

}  // namespace kvtier::cuda

#endif  // KVTIER_KERNELS_CUDA_SEG_LOAD_H_
