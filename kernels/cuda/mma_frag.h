// Tensor-core fragments for decode attention: which K, V, query and weight
// values each lane of a warp hands to mma.sync.m16n8k16 (fp16 inputs, fp32
// sums), written once for the span kernel (cuda_kernels.cu) and for the host,
// where mma_frag_test emulates the warp's products on the same registers.
//
// The products (lane = 4 * gid + tid, gid in [0, 8), tid in [0, 4)):
//   scores: C[16 tokens x 8 heads] += K[16 tokens x 16 ch] . Q^T[16 ch x 8 heads]
//   output: C[16 ch x 8 heads]     += V^T[16 ch x 16 tokens] . P^T[16 tokens x 8 heads]
// A sum runs over channels (scores) or tokens (output), so each may be taken
// in any order as long as both operands agree on it: the fragments below
// permute them so that a lane's loads are whole words of its own rows, and
// its codes become fp16 pairs with a few bit operations. Query heads are the
// 8 columns (up to 8 per KV head; columns past them are zero).
//
// Exactness: 2- and 4-bit codes and fp16 K/V are exact in fp16. The fp32
// operands (queries, with KIVI's K scale folded in; attention weights, with
// KIVI's V scale folded in) go as two fp16 parts, hi + lo, each multiplied,
// so a product keeps about 22 bits of its fp32 operand.
#ifndef KVTIER_KERNELS_CUDA_MMA_FRAG_H_
#define KVTIER_KERNELS_CUDA_MMA_FRAG_H_

#include <cstdint>

#include "kernels/cuda/cuda_kernels.h"  // KVT_HOST_DEVICE
#include "kernels/half.h"               // Host branch; plain C++.
#ifdef __CUDACC__
#include <cuda_fp16.h>
#endif

namespace kvtier::cuda::mma {

// ---- Bit operations, the same on the device and the host ----

// Bytes of {b, a} picked by the four selector nibbles (PTX prmt, default
// mode): byte i of the result is byte sel_i of the pair, 0-3 from a, 4-7 from b.
KVT_HOST_DEVICE inline uint32_t Prmt(uint32_t a, uint32_t b, uint32_t sel) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, sel);
#else
  const uint64_t pair = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t s = (sel >> (4 * i)) & 7u;
    r |= static_cast<uint32_t>((pair >> (8 * s)) & 0xffu) << (8 * i);
  }
  return r;
#endif
}

// a, less c in both halves, an fp16 pair (exact for the values below).
KVT_HOST_DEVICE inline uint32_t SubPair(uint32_t a, float c) {
#ifdef __CUDA_ARCH__
  union {
    uint32_t u;
    __half2 h;
  } v;
  v.u = a;
  v.h = __hsub2(v.h, __float2half2_rn(c));
  return v.u;
#else
  const auto lo = static_cast<uint16_t>(a & 0xffffu);
  const auto hi = static_cast<uint16_t>(a >> 16);
  return static_cast<uint32_t>(::kvtier::FloatToHalf(::kvtier::HalfToFloat(lo) - c)) |
         (static_cast<uint32_t>(::kvtier::FloatToHalf(::kvtier::HalfToFloat(hi) - c)) << 16);
#endif
}

// Two codes, the low bits of x's halves under `mask` (0x000f000f for 4-bit
// codes, 0x00030003 for 2-bit), as a pair of fp16 values: placed in the
// mantissa of 1024.0 (0x6400), then 1024 taken away, both exact.
KVT_HOST_DEVICE inline uint32_t CodePair(uint32_t x, uint32_t mask) {
  return SubPair((x & mask) | 0x64006400u, 1024.0f);
}

// CodePair's codes less `mid` (half the largest code: 7.5 for 4 bits, 1.5
// for 2), exact in fp16: values centred on zero, so that the sums over many
// tokens do not cancel against the zero-point term (ValueAQ).
KVT_HOST_DEVICE inline uint32_t CenteredCodePair(uint32_t x, uint32_t mask, float mid) {
  return SubPair(CodePair(x, mask), mid);
}

// Half the largest code of `bits`: what CenteredCodePair takes away.
KVT_HOST_DEVICE constexpr float CodeMid(int bits) { return ((1 << bits) - 1) * 0.5f; }

// a and b rounded to fp16, a in the low half.
KVT_HOST_DEVICE inline uint32_t Pack(float a, float b) {
#ifdef __CUDA_ARCH__
  union {
    uint32_t u;
    __half2 h;
  } v;
  v.h = __floats2half2_rn(a, b);
  return v.u;
#else
  return static_cast<uint32_t>(::kvtier::FloatToHalf(a)) |
         (static_cast<uint32_t>(::kvtier::FloatToHalf(b)) << 16);
#endif
}

// The fp16 pair's values.
KVT_HOST_DEVICE inline void Unpack(uint32_t p, float* a, float* b) {
#ifdef __CUDA_ARCH__
  union {
    uint32_t u;
    __half2 h;
  } v;
  v.u = p;
  const float2 f = __half22float2(v.h);
  *a = f.x;
  *b = f.y;
#else
  *a = ::kvtier::HalfToFloat(static_cast<uint16_t>(p & 0xffffu));
  *b = ::kvtier::HalfToFloat(static_cast<uint16_t>(p >> 16));
#endif
}

// (a, b) as hi + lo fp16 pairs: hi the rounded values, lo what they missed.
KVT_HOST_DEVICE inline void Split(float a, float b, uint32_t* hi, uint32_t* lo) {
  *hi = Pack(a, b);
  float ha, hb;
  Unpack(*hi, &ha, &hb);
  *lo = Pack(a - ha, b - hb);
}

// ---- Scores: K as the A operand (rows: 16 tokens; columns: 16 channels a
// step, head_dim / 16 steps) ----
//
// A lane loads words of tokens gid and gid + 8 of the tile: `bits` 16 is fp16
// K (head_dim / 8 words a row, the lane's KeyWords() of them), 4 and 2 are
// KIVI codes (head_dim * bits / 32 words a row, little-endian, channel c of a
// row at bits (c * bits) % 32 of word c * bits / 32).

// Words of a K row a lane loads.
KVT_HOST_DEVICE constexpr int KeyWords(int bits, int d) {
  return bits == 16 ? d / 8 : d * bits / 128;
}

// Word w of the lane's KeyWords(bits, d) of a row is word KeyWordAt(...) of
// the row: fp16 lanes read 16-byte pieces 32 channels apart (a token's row is
// 4 lanes' consecutive 16 bytes), code lanes one run of words.
KVT_HOST_DEVICE constexpr int KeyWordAt(int bits, int d, int tid, int w) {
  return bits == 16 ? 16 * (w / 4) + 4 * tid + w % 4 : tid * KeyWords(bits, d) + w;
}

// The channel of K step s's slot e (0, 1: the lane's low A register's
// halves; 2, 3: its high one's) for lane tid of its group.
KVT_HOST_DEVICE constexpr int KeyChannel(int bits, int d, int s, int tid, int e) {
  if (bits == 16) return 32 * (s / 2) + 8 * tid + 4 * (s % 2) + e;
  if (bits == 4) {
    const int u = s % 2;
    return tid * (d / 4) + 8 * (s / 2) + 2 * u + (e == 0 ? 0 : e == 1 ? 4 : e == 2 ? 1 : 5);
  }
  const int u = s % 4;  // 2 bits
  return tid * (d / 4) + 16 * (s / 4) +
         (e == 0   ? 2 * u
          : e == 1 ? 2 * u + 8
          : e == 2 ? 2 * u + 1
                   : 2 * u + 9);
}

// Step s's A registers from one row's words (the lane's KeyWords of it):
// *lo holds slots 0 and 1, *hi slots 2 and 3.
template <int BITS>
KVT_HOST_DEVICE inline void KeyA(const uint32_t* w, int s, uint32_t* lo, uint32_t* hi) {
  if constexpr (BITS == 16) {
    *lo = w[2 * s];
    *hi = w[2 * s + 1];
  } else if constexpr (BITS == 4) {
    const uint32_t x = w[s / 2] >> (8 * (s % 2));
    *lo = CodePair(x, 0x000f000fu);
    *hi = CodePair(x >> 4, 0x000f000fu);
  } else {
    const uint32_t x = w[s / 4] >> (4 * (s % 4));
    *lo = CodePair(x, 0x00030003u);
    *hi = CodePair(x >> 2, 0x00030003u);
  }
}

// ---- Output: V^T as the A operand (rows: 16 channels an m-tile, head_dim /
// 16 tiles; columns: 16 tokens), weights P^T as B ----
//
// Lane (gid, tid) takes tokens 4 tid .. 4 tid + 3 of the 16 (slots 2tid,
// 2tid + 1 are its first two, 2tid + 8, 2tid + 9 its last two), and gives
// rows gid and gid + 8 of every m-tile.

// fp16 V: the lane loads 16-byte pieces at channels 64x + 8 gid (x <
// head_dim / 64) of each of its tokens, head_dim / 8 channels: word m of them
// holds m-tile m's two channels, the row gid one in its low half.
KVT_HOST_DEVICE constexpr int ValueWords16(int d) { return d / 16; }
KVT_HOST_DEVICE constexpr int ValueChannel16(int m, int gid, int upper) {
  return 64 * (m / 4) + 8 * gid + 2 * (m % 4) + upper;
}
// Word m of the lane's ValueWords16 of a row is word ValueWordAt16(...) of it.
KVT_HOST_DEVICE constexpr int ValueWordAt16(int gid, int m) {
  return 32 * (m / 4) + 4 * gid + m % 4;
}

// m-tile m's A registers from the lane's word m of its four tokens' rows.
KVT_HOST_DEVICE inline void ValueA16(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3,
                                     uint32_t* a) {
  a[0] = Prmt(w0, w1, 0x5410u);  // Row gid: low halves of tokens 0, 1.
  a[1] = Prmt(w0, w1, 0x7632u);  // Row gid + 8: high halves.
  a[2] = Prmt(w2, w3, 0x5410u);
  a[3] = Prmt(w2, w3, 0x7632u);
}

// KIVI V (codes of `BITS`, scales and zeros per token and group of G
// channels): m-tile m lies in group m / (G / 16), so that one weight per
// token (the attention weight times the token's scale for the group) serves
// all its rows. Lane gid gives the group's channels G/8 gid .. G/8 gid + G/8
// - 1, two a tile: the h-th tile of a group holds G/8 gid + 2h (row gid) and
// + 1 (row gid + 8).
KVT_HOST_DEVICE constexpr int ValueChannelQ(int g_size, int m, int gid, int upper) {
  return (m / (g_size / 16)) * g_size + (g_size / 8) * gid + 2 * (m % (g_size / 16)) + upper;
}
// The lane's codes of group grp in one word: the row's word index (from the
// row's start) and the right shift that brings its first code to bit 0.
KVT_HOST_DEVICE constexpr int ValueWordQ(int bits, int g_size, int grp, int gid) {
  return (grp * g_size + (g_size / 8) * gid) * bits / 32;
}
KVT_HOST_DEVICE constexpr int ValueShiftQ(int bits, int g_size, int gid) {
  return ((g_size / 8) * gid * bits) % 32;
}

// m-tile m's A registers from the lane's shifted code word of the tile's
// group in each of its four tokens (h = m % (G / 16), the tile's place in its
// group): the codes less CodeMid(BITS), so v = scale * (code - mid) + (zero +
// scale * mid).
template <int BITS>
KVT_HOST_DEVICE inline void ValueAQ(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3, int h,
                                    uint32_t* a) {
  constexpr uint32_t kMask = BITS == 4 ? 0x000f000fu : 0x00030003u;
  const int byte = 2 * h * BITS / 8, shift = (2 * h * BITS) % 8;
  const uint32_t sel = static_cast<uint32_t>(byte) | (static_cast<uint32_t>(4 + byte) << 8);
  const uint32_t x01 = Prmt(w0, w1, sel) >> shift;
  const uint32_t x23 = Prmt(w2, w3, sel) >> shift;
  constexpr float kMid = CodeMid(BITS);
  a[0] = CenteredCodePair(x01, kMask, kMid);
  a[1] = CenteredCodePair(x01 >> BITS, kMask, kMid);
  a[2] = CenteredCodePair(x23, kMask, kMid);
  a[3] = CenteredCodePair(x23 >> BITS, kMask, kMid);
}

// ---- Accumulators (both products) ----
// c[0], c[1]: row gid, columns (heads) 2 tid and 2 tid + 1; c[2], c[3]: row
// gid + 8, the same columns.

}  // namespace kvtier::cuda::mma

#endif  // KVTIER_KERNELS_CUDA_MMA_FRAG_H_
