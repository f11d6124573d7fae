// The span kernel's tensor-core passes (device code, included by
// cuda_kernels.cu): a span's scores and its weighted sum of V over the rows
// of a block that are fp16 or 2/4-bit KIVI, 16 tokens a tile, with
// mma.sync.m16n8k16 (fp16 operands, fp32 sums) and the fragments of
// mma_frag.h. The query heads of a GQA group are the 8 columns of every
// product (up to 8 per KV head), so K and V are read once for all of them.
//
// Scores. q . k = sum_c q_c k_c over a permutation of the channels (each
// lane loads whole words of its two rows). KIVI's K has a scale and a zero
// per (token group, channel), so for a group's rows
//   q . k_t = sum_c (q_c * scale_c) * code_tc + sum_c q_c * zero_c:
// the first factor is the B operand, rebuilt once per 32 rows (groups are 32
// tokens or more), the codes the A operand, exact in fp16; the second sum is
// one number per query head and group.
//
// Output. sum_t p_t v_tc over a permutation of the tokens: m-tiles of 16
// channels, each lane gives 2 channels of 4 tokens a tile. KIVI's V has a
// scale and a zero per (token, group of G channels); with every m-tile inside
// one group and mid half the largest code,
//   sum_t p_t v_tc = sum_t (p_t * scale_t) * (code_tc - mid)
//                    + sum_t p_t * (zero_t + scale_t * mid),
// the first factor the B operand (per group), the second one number per query
// head and group, added when the block's rows are done. Centred codes keep
// the two sums from cancelling when the softmax is flat over many tokens.
//
// fp32 operands (queries, weights) go as hi + lo fp16 pairs (mma_frag.h): two
// products each, so the sums keep about 22 bits of them.
#ifndef KVTIER_KERNELS_CUDA_MMA_TILES_CUH_
#define KVTIER_KERNELS_CUDA_MMA_TILES_CUH_

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/mma_frag.h"
#include "kernels/cuda/seg_load.h"

namespace kvtier::cuda {

// c += a . b for one warp's fragments (mma_frag.h's layout).
__device__ __forceinline__ void Mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// N words from p: 16-byte loads when N is a multiple of 4 (p 16-byte
// aligned), 8-byte when 2, else one.
template <int N>
__device__ __forceinline__ void LoadWords(const uint32_t* p, uint32_t* w) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const uint4 u = __ldg(reinterpret_cast<const uint4*>(p) + i);
      w[4 * i] = u.x, w[4 * i + 1] = u.y, w[4 * i + 2] = u.z, w[4 * i + 3] = u.w;
    }
  } else if constexpr (N == 2) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = u.x, w[1] = u.y;
  } else {
    w[0] = __ldg(p);
  }
}

// Runs add() in each warp of the thread block in turn, warp 0 first, with a
// barrier after each: the warps' sums reach shared memory in one order
// whatever their timing, so a launch returns the same bits every time
// (shared atomics from several warps add in the order they arrive). Every
// thread of the block must call it.
template <int kWarps, typename F>
__device__ __forceinline__ void InWarpOrder(int warp, F add) {
  for (int w = 0; w < kWarps; ++w) {
    if (warp == w) add();
    __syncthreads();
  }
}

// The rows the tiles take: fp16 only, or fp16 and 2/4-bit KIVI codes.
enum TileRows { kNoTiles = 0, kFp16Tiles = 1, kAllTiles = 2 };

// What the tiles can take of a block's K under `rows`: 16 (fp16 rows,
// 16-byte aligned), 4 or 2 (KIVI codes in groups of 32 tokens or more, a
// power of two, with aligned codes, scales and zeros), or 0.
__device__ __forceinline__ int KeyTileBits(const SegKv& kv, int rows) {
  const auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  if (kv.quantized_kind == 0) {
    return rows != kNoTiles && kv.dtype == 1 && aligned(kv.raw) && kv.token_stride % 8 == 0 ? 16
                                                                                            : 0;
  }
  const auto ug = static_cast<uint32_t>(kv.group);
  const bool ok = rows == kAllTiles && kv.quantized_kind == 1 && kv.key != 0 &&
                  (kv.bits == 2 || kv.bits == 4) && ug >= 32 && (ug & (ug - 1)) == 0 &&
                  aligned(kv.codes) && aligned(kv.scales) && aligned(kv.zeros);
  return ok ? kv.bits : 0;
}

// Where the tiles stop in the span's part [a, e) of a block at `off`: all of
// it for fp16 rows, its quantized rows for codes; a when they take none.
__device__ __forceinline__ int64_t KeyTileEnd(const SegKv& kv, int rows, int64_t off, int64_t a,
                                              int64_t e) {
  const int bits = KeyTileBits(kv, rows);
  if (bits == 0) return a;
  const int64_t end = bits == 16 ? e : min(e, off + kv.quantized);
  return end > a ? end : a;
}

// The B operands of the scores for this lane's column (query head gid; the
// lanes past the group's heads give zeros), as hi + lo pairs in the lane's
// channel order. fp16 K: q from qs [REP, D]. Codes: q from qt, the queries
// lane-major (qt[j * 32 + lane] = channel tid * D / 4 + j of head gid, zero
// past the heads: one bank a lane), times the group's scales sc; *bias gets
// sum_c q_c zero_c over the whole head (the column's four lanes summed).
template <int D, int REP, int BITS>
__device__ __forceinline__ void KeyB(const float* qs, const float* qt, int lane, const uint16_t* sc,
                                     const uint16_t* ze, uint32_t (*bh)[2], uint32_t (*bl)[2],
                                     float* bias) {
  constexpr int kSteps = D / 16;
  const int gid = lane >> 2, tid = lane & 3;
  if constexpr (BITS == 16) {
    const float* qg = qs + (gid < REP ? gid : 0) * D;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      float x[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) x[e] = gid < REP ? qg[mma::KeyChannel(16, D, s, tid, e)] : 0.0f;
      mma::Split(x[0], x[1], &bh[s][0], &bl[s][0]);
      mma::Split(x[2], x[3], &bh[s][1], &bl[s][1]);
    }
    *bias = 0.0f;
  } else {
    // The lane's channels are tid * D / 4 + [0, D / 4): their scales and
    // zeros are D / 8 words each.
    constexpr int kHalfWords = D / 8;
    uint32_t scw[kHalfWords], zew[kHalfWords];
    LoadWords<kHalfWords>(reinterpret_cast<const uint32_t*>(sc + tid * (D / 4)), scw);
    LoadWords<kHalfWords>(reinterpret_cast<const uint32_t*>(ze + tid * (D / 4)), zew);
    float part = 0.0f;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      float x[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = mma::KeyChannel(BITS, D, s, 0, e);  // The lane's own index.
        const float q = qt[j * 32 + lane];
        part += q * SegHalf(static_cast<uint16_t>(zew[j / 2] >> (16 * (j % 2))));
        x[e] = q * SegHalf(static_cast<uint16_t>(scw[j / 2] >> (16 * (j % 2))));
      }
      mma::Split(x[0], x[1], &bh[s][0], &bl[s][0]);
      mma::Split(x[2], x[3], &bh[s][1], &bl[s][1]);
    }
    part += __shfl_xor_sync(0xffffffffu, part, 1);
    part += __shfl_xor_sync(0xffffffffu, part, 2);
    *bias = part;
  }
}

// The scores of block rows [la, lq) (block-local; all fp16 or all codes) into
// s[r * stride + pos0 + t] for query head r < REP, scaled (qs, qt as for
// KeyB). Warps take a unit of rows at a time, kWarps apart: 16 rows of fp16,
// 32 of codes (one B operand a K group). Every lane of a warp runs the same
// iterations (the products are warp-wide); rows past the range load the
// range's last row and are not written.
template <int D, int REP, int BITS, int kWarps>
__device__ __forceinline__ void KeyTiles(const SegKv& kv, int64_t la, int64_t lq, int64_t pos0,
                                         float scale, int warp, int lane, const float* qs,
                                         const float* qt, float* s, int stride) {
  constexpr int kSteps = D / 16;
  constexpr int kWords = mma::KeyWords(BITS, D);
  constexpr int kUnitShift = BITS == 16 ? 4 : 5;
  const int gid = lane >> 2, tid = lane & 3;
  const int64_t row_words = BITS == 16 ? kv.token_stride / 2 : D * BITS / 32;
  const uint32_t* base = BITS == 16 ? static_cast<const uint32_t*>(kv.raw) : kv.codes;
  uint32_t bh[kSteps][2], bl[kSteps][2];
  float bias = 0.0f;
  if constexpr (BITS == 16) KeyB<D, REP, 16>(qs, qt, lane, nullptr, nullptr, bh, bl, &bias);
  const int gshift = __ffs(kv.group) - 1;
  for (int64_t k = (la >> kUnitShift) + warp; k <= (lq - 1) >> kUnitShift; k += kWarps) {
    const int64_t r0 = k << kUnitShift;
    if constexpr (BITS != 16) {
      const int64_t at = (r0 >> gshift) * D;
      KeyB<D, REP, BITS>(qs, qt, lane, kv.scales + at, kv.zeros + at, bh, bl, &bias);
    }
    // Columns 2 tid and 2 tid + 1 are query heads 2 tid, 2 tid + 1: their
    // biases sit in the lanes of groups 2 tid and 2 tid + 1.
    const float bias0 = __shfl_sync(0xffffffffu, bias, 8 * tid);
    const float bias1 = __shfl_sync(0xffffffffu, bias, 8 * tid + 4);
#pragma unroll
    for (int half = 0; half < (BITS == 16 ? 1 : 2); ++half) {
      const int64_t ta = r0 + 16 * half + gid, tb = ta + 8;
      const bool oka = ta >= la && ta < lq, okb = tb >= la && tb < lq;
      const int64_t ra = min(max(ta, la), lq - 1), rb = min(max(tb, la), lq - 1);
      uint32_t wa[kWords], wb[kWords];
      if constexpr (BITS == 16) {
#pragma unroll
        for (int x = 0; x < kWords / 4; ++x) {
          LoadWords<4>(base + ra * row_words + 16 * x + 4 * tid, wa + 4 * x);
          LoadWords<4>(base + rb * row_words + 16 * x + 4 * tid, wb + 4 * x);
        }
      } else {
        LoadWords<kWords>(base + ra * row_words + tid * kWords, wa);
        LoadWords<kWords>(base + rb * row_words + tid * kWords, wb);
      }
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int st = 0; st < kSteps; ++st) {
        uint32_t a[4];
        mma::KeyA<BITS>(wa, st, &a[0], &a[2]);
        mma::KeyA<BITS>(wb, st, &a[1], &a[3]);
        Mma16816(c, a, bh[st][0], bh[st][1]);
        Mma16816(c, a, bl[st][0], bl[st][1]);
      }
      const int h0 = 2 * tid, h1 = 2 * tid + 1;
      if (oka) {
        if (h0 < REP) s[h0 * stride + pos0 + ta] = (c[0] + bias0) * scale;
        if (h1 < REP) s[h1 * stride + pos0 + ta] = (c[1] + bias1) * scale;
      }
      if (okb) {
        if (h0 < REP) s[h0 * stride + pos0 + tb] = (c[2] + bias0) * scale;
        if (h1 < REP) s[h1 * stride + pos0 + tb] = (c[3] + bias1) * scale;
      }
    }
  }
}

// What the tiles can take of a block's V under `rows`: 16 (fp16 rows,
// 16-byte aligned), or the bits (4 or 2) of KIVI codes whose channel groups
// are 32 or 64 channels (dividing head_dim; scales and zeros 8-byte
// aligned), or 0.
template <int D>
__device__ __forceinline__ int ValueTileBits(const SegKv& kv, int rows) {
  if (kv.quantized_kind == 0) {
    return rows != kNoTiles && kv.dtype == 1 && (reinterpret_cast<uintptr_t>(kv.raw) & 15) == 0 &&
                   kv.token_stride % 8 == 0
               ? 16
               : 0;
  }
  const auto aligned8 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7) == 0; };
  const bool ok = rows == kAllTiles && kv.quantized_kind == 1 && kv.key == 0 &&
                  (kv.bits == 2 || kv.bits == 4) && (kv.group == 32 || kv.group == 64) &&
                  D % kv.group == 0 && aligned8(kv.scales) && aligned8(kv.zeros);
  return ok ? kv.bits : 0;
}

// KeyTileEnd's counterpart for V.
template <int D>
__device__ __forceinline__ int64_t ValueTileEnd(const SegKv& kv, int rows, int64_t off, int64_t a,
                                                int64_t e) {
  const int bits = ValueTileBits<D>(kv, rows);
  if (bits == 0) return a;
  const int64_t end = bits == 16 ? e : min(e, off + kv.quantized);
  return end > a ? end : a;
}

// N fp16 values from p as floats: 8-byte loads when N is a multiple of 4
// (p 8-byte aligned), 4-byte when 2, else one.
template <int N>
__device__ __forceinline__ void LoadHalves(const uint16_t* p, float* x) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const uint2 u = __ldg(reinterpret_cast<const uint2*>(p) + i);
      mma::Unpack(u.x, &x[4 * i], &x[4 * i + 1]);
      mma::Unpack(u.y, &x[4 * i + 2], &x[4 * i + 3]);
    }
  } else if constexpr (N == 2) {
    mma::Unpack(__ldg(reinterpret_cast<const uint32_t*>(p)), &x[0], &x[1]);
  } else {
    x[0] = SegHalf(__ldg(p));
  }
}

// Adds sum_t p[r, t] v[t, :] over block rows [la, lv) (block-local; all fp16
// or all codes) to red[r * D + c] for query head r < REP, p the span's
// weights s[r * stride + pos0 + t]. Warps take 16 rows at a time, kWarps
// apart, and add their sums to red in warp order (InWarpOrder): every thread
// of the block calls it. Rows past the range load the range's last row with
// weight 0.
template <int D, int REP, int BITS, int G, int kWarps>
__device__ __forceinline__ void ValueTiles(const SegKv& kv, int64_t la, int64_t lv, int64_t pos0,
                                           int warp, int lane, const float* s, int stride,
                                           float* red) {
  constexpr int kTiles = D / 16;
  constexpr int kGroups = BITS == 16 ? 1 : D / G;
  const int gid = lane >> 2, tid = lane & 3;
  const bool head = gid < REP;
  const float* sg = s + (head ? gid : 0) * stride + pos0;
  float acc[kTiles][4];
#pragma unroll
  for (int m = 0; m < kTiles; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.0f;
  float zsum[kGroups];  // sum_t p_t zero_t, head gid, per group: this lane's tokens.
#pragma unroll
  for (int grp = 0; grp < kGroups; ++grp) zsum[grp] = 0.0f;
  bool any = false;
  for (int64_t k = (la >> 4) + warp; k <= (lv - 1) >> 4; k += kWarps) {
    any = true;
    int64_t row[4];
    float p[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t t = (k << 4) + 4 * tid + u;
      row[u] = min(max(t, la), lv - 1);
      const float w = sg[row[u]];
      p[u] = t >= la && t < lv && head ? w : 0.0f;
    }
    if constexpr (BITS == 16) {
      const auto* base = static_cast<const uint32_t*>(kv.raw);
      const int64_t row_words = kv.token_stride / 2;
      uint32_t w[4][kTiles];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int x = 0; x < kTiles / 4; ++x)
          LoadWords<4>(base + row[u] * row_words + 32 * x + 4 * gid, w[u] + 4 * x);
      }
      uint32_t bh0, bl0, bh1, bl1;
      mma::Split(p[0], p[1], &bh0, &bl0);
      mma::Split(p[2], p[3], &bh1, &bl1);
#pragma unroll
      for (int m = 0; m < kTiles; ++m) {
        uint32_t a[4];
        mma::ValueA16(w[0][m], w[1][m], w[2][m], w[3][m], a);
        Mma16816(acc[m], a, bh0, bh1);
        Mma16816(acc[m], a, bl0, bl1);
      }
    } else {
      constexpr int kRowWords = D * BITS / 32;
      const int word = mma::ValueWordQ(BITS, G, 0, gid), shift = mma::ValueShiftQ(BITS, G, gid);
      float sc[4][kGroups], ze[4][kGroups];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        LoadHalves<kGroups>(kv.scales + row[u] * kGroups, sc[u]);
        LoadHalves<kGroups>(kv.zeros + row[u] * kGroups, ze[u]);
      }
#pragma unroll
      for (int grp = 0; grp < kGroups; ++grp) {
        uint32_t w[4];
        float x[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          w[u] = __ldg(kv.codes + row[u] * kRowWords + grp * (G * BITS / 32) + word) >> shift;
          // The codes go less their midpoint (mma_frag.h's ValueAQ), the
          // zero term gains scale * mid.
          x[u] = p[u] * sc[u][grp];
          zsum[grp] += p[u] * fmaf(sc[u][grp], mma::CodeMid(BITS), ze[u][grp]);
        }
        uint32_t bh0, bl0, bh1, bl1;
        mma::Split(x[0], x[1], &bh0, &bl0);
        mma::Split(x[2], x[3], &bh1, &bl1);
#pragma unroll
        for (int h = 0; h < G / 16; ++h) {
          uint32_t a[4];
          mma::ValueAQ<BITS>(w[0], w[1], w[2], w[3], h, a);
          Mma16816(acc[grp * (G / 16) + h], a, bh0, bh1);
          Mma16816(acc[grp * (G / 16) + h], a, bl0, bl1);
        }
      }
    }
  }
  // Each group's zero term summed over the column's four lanes (every lane
  // takes part in the shuffles).
#pragma unroll
  for (int grp = 0; grp < kGroups; ++grp) {
    zsum[grp] += __shfl_xor_sync(0xffffffffu, zsum[grp], 1);
    zsum[grp] += __shfl_xor_sync(0xffffffffu, zsum[grp], 2);
  }
  InWarpOrder<kWarps>(warp, [&] {
    if (!any) return;
#pragma unroll
    for (int m = 0; m < kTiles; ++m) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int hd = 2 * tid + r % 2;
        const int c =
            BITS == 16 ? mma::ValueChannel16(m, gid, r / 2) : mma::ValueChannelQ(G, m, gid, r / 2);
        if (hd < REP) red[hd * D + c] += acc[m][r];
      }
    }
    if constexpr (BITS != 16) {
      __syncwarp();  // Lanes of the warp add to the same sums below.
      // A quarter of each group's channels a lane.
      if (head) {
#pragma unroll
        for (int grp = 0; grp < kGroups; ++grp)
          for (int c = tid; c < G; c += 4) red[gid * D + grp * G + c] += zsum[grp];
      }
    }
  });
}

}  // namespace kvtier::cuda

#endif  // KVTIER_KERNELS_CUDA_MMA_TILES_CUH_
