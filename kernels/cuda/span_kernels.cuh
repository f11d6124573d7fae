// SegmentedAttention's span kernels (device code and their host-side
// choice, included by cuda_kernels.cu): flash-decoding over spans of a KV
// head's blocks, 8 channels a lane or a channel a lane, with the tensor-core
// tiles of mma_tiles.cuh, and the merge of the spans.
#ifndef KVTIER_KERNELS_CUDA_SPAN_KERNELS_CUH_
#define KVTIER_KERNELS_CUDA_SPAN_KERNELS_CUH_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/mma_tiles.cuh"
#include "kernels/cuda/seg_load.h"
#include "kernels/cuda/seg_load8.cuh"

namespace kvtier::cuda {
namespace {

// The tokens of block b that query i of the call sees.
__device__ __forceinline__ int64_t Visible(const SegBlock& b, const SegDims& g, int i) {
  return b.causal ? min(b.tokens, g.base + i + 1) : b.tokens;
}

// ---- Split attention (flash-decoding): the fast path of SegmentedAttention ----
//
// The old kernel above gives one block to each (query, query head) and one
// thread to each token's whole dot product, then one thread to each channel
// over every token: reads are strided by head_dim, K and V are read once per
// query head of a GQA group, and a decode step over 4K tokens has 32 blocks.
// Here one block takes a span of kSplit tokens of one KV head for one query,
// with all the group's query heads (K and V read once for them); a warp takes
// a token at a time and its lanes the channels (consecutive lanes read
// consecutive elements); each block leaves its unnormalized output, max and
// sum, and SplitCombineKernel merges the spans (the log-sum-exp rescale).

constexpr int kSplitWarps = 8;
constexpr int kSplitMaxRep = 8;     // Query heads per KV head.
constexpr int kSplitMaxLaneCh = 8;  // d <= 256.
// Floats of a query group's table (query heads x head_dim) up to which the
// 8-channel kernel computes quantized K's scores a token a lane (KeyChunks).
constexpr int kChunkTable = 512;
// SegDims::prefetch when it is left at -1 (docs/gpu.md has the sweep).
constexpr int kDefaultPrefetch = 1;

// The span of visible tokens [lo, hi) of KV head h for query i, as (block,
// token) pairs: calls f(blk, t, pos) for each, pos = index in the span, with
// token t of `blk`, warp w taking tokens w, w + warps, ...
template <typename F>
__device__ __forceinline__ void ForSpan(const SegDims& g, const SegBlock* blocks,
                                        const int* head_first, int h, int i, int64_t lo, int64_t hi,
                                        int warp, F f) {
  int64_t off = 0;
  for (int b = head_first[h]; b < head_first[h + 1] && off < hi; ++b) {
    const SegBlock& blk = blocks[b];
    const int64_t len = Visible(blk, g, i);
    const int64_t a = max(lo, off), e = min(hi, off + len);
    for (int64_t p = a + warp; p < e; p += kSplitWarps) f(blk, p - off, p - lo);
    off += len;
  }
}

__device__ __forceinline__ float WarpSum(float x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float WarpMax(float x) {
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// The softmax numerators of a span's scores s [rep, split], in place; query
// head r's max and sum go to ml[2r] and ml[2r + 1] (a sum of 0: the span
// holds no token, it runs past the head's end). Warp r takes query head r.
__device__ void SpanSoftmax(const SegDims& g, const SegBlock* blocks, const int* head_first, int h,
                            int i, int64_t lo, int64_t hi, int rep, int split, float* s,
                            float* ml) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int64_t total = 0;
  for (int b = head_first[h]; b < head_first[h + 1]; ++b) total += Visible(blocks[b], g, i);
  const int count = static_cast<int>(max(int64_t{0}, min(hi, total) - lo));
  for (int r = warp; r < rep; r += kSplitWarps) {
    float m = -FLT_MAX;
    for (int p = lane; p < count; p += 32) m = fmaxf(m, s[r * split + p]);
    m = WarpMax(m);
    float l = 0.0f;
    for (int p = lane; p < count; p += 32) {
      const float e = __expf(s[r * split + p] - m);
      s[r * split + p] = e;
      l += e;
    }
    l = WarpSum(l);
    if (lane == 0) {
      ml[r * 2] = m;
      ml[r * 2 + 1] = l;
    }
  }
}

// Grid (spans, n, kv_heads), kSplitWarps warps. Shared: q [rep, d], the
// span's scores [rep, split], the output sums [rep, d]. part_o is [spans, n,
// q_heads, d]; part_ml [spans, n, q_heads, 2] (max, sum; an empty span has
// sum 0).
__global__ void SplitAttentionKernel(SegDims g, const SegBlock* blocks, const int* head_first,
                                     const float* q, int split, float* part_o, float* part_ml) {
  extern __shared__ float sh[];
  const int span = blockIdx.x, i = blockIdx.y, h = blockIdx.z;
  const int rep = g.q_heads / g.kv_heads;
  const int d = g.d;
  const int nch = (d + 31) / 32;
  float* qs = sh;
  float* s = qs + rep * d;
  float* red = s + rep * split;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* qrow = q + (static_cast<int64_t>(i) * g.q_heads + h * rep) * d;
  for (int x = threadIdx.x; x < rep * d; x += blockDim.x) {
    qs[x] = qrow[x];
    red[x] = 0.0f;
  }
  __syncthreads();
  const int64_t lo = static_cast<int64_t>(span) * split, hi = lo + split;
  // Scores: a warp per token, lanes over channels, every query head at once.
  ForSpan(g, blocks, head_first, h, i, lo, hi, warp,
          [&](const SegBlock& blk, int64_t t, int64_t pos) {
            float acc[kSplitMaxRep];
#pragma unroll
            for (int r = 0; r < kSplitMaxRep; ++r) acc[r] = 0.0f;
#pragma unroll
            for (int ch = 0; ch < kSplitMaxLaneCh; ++ch) {
              const int c = ch * 32 + lane;
              if (ch < nch && c < d) {
                const float kv = SegLoad(blk.k, d, t, c);
#pragma unroll
                for (int r = 0; r < kSplitMaxRep; ++r)
                  if (r < rep) acc[r] += qs[r * d + c] * kv;
              }
            }
#pragma unroll
            for (int r = 0; r < kSplitMaxRep; ++r) {
              if (r < rep) {
                const float v = WarpSum(acc[r]);
                if (lane == 0) s[r * split + pos] = v * g.scale;
              }
            }
          });
  __syncthreads();
  SpanSoftmax(g, blocks, head_first, h, i, lo, hi, rep, split, s,
              part_ml + ((static_cast<int64_t>(span) * g.n + i) * g.q_heads + h * rep) * 2);
  __syncthreads();
  // p . v: a warp per token again, each lane its channels for every head.
  float acc[kSplitMaxRep][kSplitMaxLaneCh];
#pragma unroll
  for (int r = 0; r < kSplitMaxRep; ++r)
#pragma unroll
    for (int ch = 0; ch < kSplitMaxLaneCh; ++ch) acc[r][ch] = 0.0f;
  ForSpan(g, blocks, head_first, h, i, lo, hi, warp,
          [&](const SegBlock& blk, int64_t t, int64_t pos) {
#pragma unroll
            for (int ch = 0; ch < kSplitMaxLaneCh; ++ch) {
              const int c = ch * 32 + lane;
              if (ch < nch && c < d) {
                const float vv = SegLoad(blk.v, d, t, c);
#pragma unroll
                for (int r = 0; r < kSplitMaxRep; ++r)
                  if (r < rep) acc[r][ch] += s[r * split + pos] * vv;
              }
            }
          });
  // The warps' sums in warp order: the same bits every launch.
  InWarpOrder<kSplitWarps>(warp, [&] {
#pragma unroll
    for (int r = 0; r < kSplitMaxRep; ++r) {
#pragma unroll
      for (int ch = 0; ch < kSplitMaxLaneCh; ++ch) {
        const int c = ch * 32 + lane;
        if (r < rep && ch < nch && c < d) red[r * d + c] += acc[r][ch];
      }
    }
  });
  float* o = part_o + ((static_cast<int64_t>(span) * g.n + i) * g.q_heads + h * rep) * d;
  for (int x = threadIdx.x; x < rep * d; x += blockDim.x) o[x] = red[x];
}

// One block per (query, query head), kCombineThreads threads: the spans
// merged. The largest span max comes from a block reduction; then the
// threads form groups of d, thread c of group k summing channel c over spans
// k, k + groups, ... (independent loads, several spans in flight), and the
// groups' sums meet in shared memory. One thread per channel walking every
// span, one dependent load at a time, took about 40 us at 65 spans on an
// H100 (docs/gpu.md).
constexpr int kCombineThreads = 512;
__global__ void __launch_bounds__(kCombineThreads)
    SplitCombineKernel(SegDims g, int spans, const float* part_o, const float* part_ml,
                       float* out) {
  __shared__ float red[kCombineThreads];
  __shared__ float wide[kCombineThreads];  // Warps' maxes, then groups' sums (d may be < 32).
  const int64_t row = blockIdx.x;          // i * q_heads + j
  const int64_t stride = static_cast<int64_t>(g.n) * g.q_heads;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  float m = -FLT_MAX;
  for (int sp = tid; sp < spans; sp += kCombineThreads) {
    const float* ml = part_ml + (sp * stride + row) * 2;
    if (ml[1] > 0.0f) m = fmaxf(m, ml[0]);
  }
  m = WarpMax(m);
  if (lane == 0) wide[warp] = m;
  __syncthreads();
  m = wide[0];
  for (int w = 1; w < kCombineThreads / 32; ++w) m = fmaxf(m, wide[w]);
  const int groups = kCombineThreads / g.d;  // d <= 256: at least 2.
  const int c = tid % g.d, k = tid / g.d;
  float num = 0.0f, den = 0.0f;
  if (k < groups) {
#pragma unroll 4
    for (int sp = k; sp < spans; sp += groups) {
      const int64_t at = sp * stride + row;
      const float l = part_ml[at * 2 + 1];
      // An empty span (sum 0) weighs nothing; its output sums are zeros.
      const float w = l > 0.0f ? __expf(part_ml[at * 2] - m) : 0.0f;
      num += w * part_o[at * g.d + c];
      den += w * l;
    }
  }
  __syncthreads();  // wide[] read by all before it is reused below.
  red[tid] = num;
  if (c == 0 && k < groups) wide[k] = den;
  __syncthreads();
  if (tid < g.d) {
    float n = 0.0f, dn = 0.0f;
    for (int x = 0; x < groups; ++x) {
      n += red[x * g.d + tid];
      dn += wide[x];
    }
    out[row * g.d + tid] = dn > 0.0f ? n / dn : 0.0f;
  }
}

// ---- The span kernel with 8 channels a lane ----
//
// For head_dim 64, 128 or 256 and 1, 2, 4 or 8 query heads per KV head: a
// token's row is read by L = head_dim / 8 lanes, 8 consecutive channels each
// (one 16-byte load of fp16, one code word of KIVI-4), so a warp reads 32 / L
// tokens a pass, two passes at a time. The lane keeps its channels of the
// group's queries in registers and sums its part of each dot product, then L
// lanes add theirs with shuffles; for p . v each lane accumulates its 8
// channels of every query head over its tokens. Same spans, same merge.

// Reads the lane's 8 channels (from c0, head_dim D) of each row of K (`key`)
// or V and calls use(x, pos, valid) for the span [lo, hi) of KV head h's
// visible tokens for query i: each warp pass, token slot `slot` of warp
// `warp` takes one token, U passes at a time (their loads first, then their
// arithmetic, so that U rows are in flight per lane). Every lane
// calls `use` the same number of times (valid false past the end), as its
// shuffles need.
//
// With g.prefetch = A > 0, each lane also asks L2 for the rows it will load A
// iterations later (SegPrefetch8: no registers held, nothing waited on),
// after asking for its first A iterations' rows on entering each block: a
// lane's own loads are then mostly L2 hits, so more of device memory's
// latency overlaps work than the U rows in flight alone allow.
//
// prefix(kv, off, a, e) may take the first rows of a block's range itself
// (KeyChunks does, for quantized K): it returns where this loop starts.
template <int T, int U, int D, typename Use, typename Prefix>
__device__ __forceinline__ void ForSpanVec(const SegDims& g, const SegBlock* blocks,
                                           const int* head_first, int h, int i, int64_t lo,
                                           int64_t hi, int warp, int slot, int c0, bool key,
                                           Use use, Prefix prefix) {
  constexpr int kStride = kSplitWarps * T;
  const int64_t ahead = static_cast<int64_t>(g.prefetch) * U * kStride;  // In tokens.
  int64_t off = 0;
  for (int b = head_first[h]; b < head_first[h + 1] && off < hi; ++b) {
    const SegBlock& blk = blocks[b];
    const int64_t len = Visible(blk, g, i);
    int64_t a = max(lo, off);
    const int64_t e = min(hi, off + len);
    // The pass's description, copied: its fields stay in registers over the
    // loop instead of being loaded again for every row.
    const SegKv kv = key ? blk.k : blk.v;
    if (a < e) a = prefix(kv, off, a, e);
    const int64_t first = a + warp * T + slot;
    for (int64_t p = first; p < min(e, first + ahead); p += kStride) {
      SegPrefetch8(kv, D, p - off, c0);
    }
    for (int64_t p0 = a + warp * T; p0 < e; p0 += U * kStride) {
      if (ahead > 0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t p = p0 + ahead + u * kStride + slot;
          if (p < e) SegPrefetch8(kv, D, p - off, c0);
        }
      }
      float x[U][8];
      bool valid[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t p = p0 + u * kStride + slot;
        valid[u] = p < e;
        if (valid[u]) {
          SegLoad8(kv, D, p - off, c0, x[u]);
        } else {
#pragma unroll
          for (int k = 0; k < 8; ++k) x[u][k] = 0.0f;
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) use(x[u], p0 + u * kStride + slot - lo, valid[u]);
    }
    off += len;
  }
}

// Calls f(kv, off, a, e) for each block of KV head h with visible rows in
// the span [lo, hi) for query i: its K (`key`) or V, the block's first
// position `off`, and the span's part of it [a, e).
template <typename F>
__device__ __forceinline__ void ForSpanBlocks(const SegDims& g, const SegBlock* blocks,
                                              const int* head_first, int h, int i, int64_t lo,
                                              int64_t hi, bool key, F f) {
  int64_t off = 0;
  for (int b = head_first[h]; b < head_first[h + 1] && off < hi; ++b) {
    const SegBlock& blk = blocks[b];
    const int64_t len = Visible(blk, g, i);
    const int64_t a = max(lo, off), e = min(hi, off + len);
    if (a < e) f(key ? blk.k : blk.v, off, a, e);
    off += len;
  }
}

// ---- Quantized K a token a lane ----
//
// KIVI's K has its scale and zero per (group of tokens, channel), so for the
// rows of one group
//   q . k_t = sum_c (q_c * scale_c) * code_tc + sum_c q_c * zero_c.
// A warp takes 32 rows of one group (block rows 32k .. 32k + 31; groups of
// 32 or more tokens, powers of two). It writes the first factor for every
// query head of the group into its table in shared memory and sums the
// second, once for the 32 rows; then each lane takes one row and walks its
// codes, one multiply-add a query head a channel, with the table's entries
// the same for every lane (broadcast reads). No shuffles, no scale loads or
// conversions per row: the 8-channel loop spent about three times the
// instructions a row on them.

// Whether KeyChunks can take `kv`'s quantized rows.
__device__ __forceinline__ bool ChunkableKey(const SegKv& kv) {
  const auto ug = static_cast<uint32_t>(kv.group);
  return kv.quantized_kind == 1 && kv.key != 0 && (kv.bits == 2 || kv.bits == 4 || kv.bits == 8) &&
         ug >= 32 && (ug & (ug - 1)) == 0 && (reinterpret_cast<uintptr_t>(kv.codes) & 15) == 0;
}

// The scores of block rows [la, lq) (block-local, all quantized) into
// s[r * split + off + t - lo]. qs: the query heads [REP, D] in shared memory;
// table: this warp's [REP, D].
template <int D, int REP, int BITS>
__device__ __forceinline__ void KeyChunksBits(const SegKv& kv, int64_t la, int64_t lq, int64_t pos0,
                                              float scale, int warp, int lane, const float* qs,
                                              float* table, float* s, int split) {
  constexpr int kWords = D * BITS / 32;  // Code words a row: a whole number of uint4.
  static_assert(kWords % 4 == 0, "rows of whole 16-byte loads");
  constexpr int kPerWord = 32 / BITS;
  const int gshift = __ffs(kv.group) - 1;
  for (int64_t k = (la >> 5) + warp; k <= (lq - 1) >> 5; k += kSplitWarps) {
    const int64_t g = (k << 5) >> gshift;
    float bias[REP];
#pragma unroll
    for (int r = 0; r < REP; ++r) bias[r] = 0.0f;
#pragma unroll
    for (int j = 0; j < D / 32; ++j) {
      const int c = lane + 32 * j;
      const float sc = SegHalf(__ldg(kv.scales + g * D + c));
      const float ze = SegHalf(__ldg(kv.zeros + g * D + c));
#pragma unroll
      for (int r = 0; r < REP; ++r) {
        table[r * D + c] = qs[r * D + c] * sc;
        bias[r] += qs[r * D + c] * ze;
      }
    }
#pragma unroll
    for (int r = 0; r < REP; ++r) bias[r] = WarpSum(bias[r]);
    __syncwarp();
    const int64_t t = (k << 5) + lane;
    if (t >= la && t < lq) {
      const uint4* row = reinterpret_cast<const uint4*>(kv.codes + t * kWords);
      uint4 w4[kWords / 4];
#pragma unroll
      for (int x = 0; x < kWords / 4; ++x) w4[x] = __ldg(row + x);
      float acc[REP];
#pragma unroll
      for (int r = 0; r < REP; ++r) acc[r] = 0.0f;
#pragma unroll
      for (int x = 0; x < kWords; ++x) {
        const uint32_t w = x % 4 == 0   ? w4[x / 4].x
                           : x % 4 == 1 ? w4[x / 4].y
                           : x % 4 == 2 ? w4[x / 4].z
                                        : w4[x / 4].w;
#pragma unroll
        for (int e4 = 0; e4 < kPerWord; e4 += 4) {
          float f[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const uint32_t code = (w >> (BITS * (e4 + e))) & ((1u << BITS) - 1u);
            f[e] = __uint_as_float(0x4B000000u | code) - 8388608.0f;
          }
          const int c = x * kPerWord + e4;
#pragma unroll
          for (int r = 0; r < REP; ++r) {
            const float4 m = *reinterpret_cast<const float4*>(table + r * D + c);
            acc[r] = fmaf(m.w, f[3], fmaf(m.z, f[2], fmaf(m.y, f[1], fmaf(m.x, f[0], acc[r]))));
          }
        }
      }
      const int64_t pos = pos0 + t;
#pragma unroll
      for (int r = 0; r < REP; ++r) s[r * split + pos] = (acc[r] + bias[r]) * scale;
    }
    __syncwarp();  // The table is rewritten for the next chunk.
  }
}

// Takes block rows [a - off, quantized) of the range [a, e) when kv allows
// (ChunkableKey) and returns where the rest starts (a when it took none).
template <int D, int REP>
__device__ __forceinline__ int64_t KeyChunks(const SegKv& kv, int64_t off, int64_t a, int64_t e,
                                             int64_t lo, float scale, int warp, int lane,
                                             const float* qs, float* table, float* s, int split) {
  if (!ChunkableKey(kv)) return a;
  const int64_t la = a - off, lq = min(e - off, kv.quantized);
  if (la >= lq) return a;
  const int64_t pos0 = off - lo;
  switch (kv.bits) {
    case 2:
      KeyChunksBits<D, REP, 2>(kv, la, lq, pos0, scale, warp, lane, qs, table, s, split);
      break;
    case 4:
      KeyChunksBits<D, REP, 4>(kv, la, lq, pos0, scale, warp, lane, qs, table, s, split);
      break;
    default:
      KeyChunksBits<D, REP, 8>(kv, la, lq, pos0, scale, warp, lane, qs, table, s, split);
      break;
  }
  return off + lq;
}

// Sums each of v[0 .. REP) over the L lanes of a row (L a power of two, REP
// <= L) and leaves the lane one of the sums: the lanes whose bits below
// L / REP are 0 hold query head *head's. The first log2(REP) steps halve the
// values each lane carries (it keeps one half, sends its partner the other,
// as in a reduce-scatter), so a row takes REP - 1 + log2(L / REP) shuffles,
// not REP * log2(L): 5 instead of 16 for 4 heads over 16 lanes.
template <int L, int REP>
__device__ __forceinline__ float RowReduce(float (&v)[REP], int lane, int* head) {
  int r = 0;
#pragma unroll
  for (int n = REP, o = L / 2; n > 1; n /= 2, o /= 2) {
    const bool upper = (lane & o) != 0;
#pragma unroll
    for (int j = 0; j < n / 2; ++j) {
      const float send = upper ? v[j] : v[j + n / 2];
      const float keep = upper ? v[j + n / 2] : v[j];
      v[j] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
    if (upper) r += n / 2;
  }
  float sum = v[0];
#pragma unroll
  for (int o = L / (2 * REP); o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  *head = r;
  return sum;
}

// SplitVecBody's shared memory, in floats: the span's scores [rep, split +
// 1] (rows one float longer than the span, so that lanes reading one token
// of several query heads hit different banks), rounded up to 4 floats; the
// output sums [rep, d]; the queries [rep, d] (for KeyChunks or the tiles);
// KeyChunks' tables, [rep, d] a warp (chunks); the queries lane-major,
// [d / 4, 32] (tiles over codes, KeyB).
struct VecShared {
  int64_t stride, red, qs, tables, qt, total;
};
__host__ __device__ inline VecShared VecLayout(int rep, int d, int split, bool chunks, int rows) {
  VecShared v;
  v.stride = split + 1;
  v.red = (rep * v.stride + 3) / 4 * 4;
  v.qs = v.red + static_cast<int64_t>(rep) * d;
  v.tables = v.qs + (chunks || rows != kNoTiles ? static_cast<int64_t>(rep) * d : 0);
  v.qt = v.tables + (chunks ? static_cast<int64_t>(kSplitWarps) * rep * d : 0);
  v.total = v.qt + (rows == kAllTiles ? static_cast<int64_t>(d) * 8 : 0);
  return v;
}

// ROWS (TileRows): the rows the tensor-core tiles take (mma_tiles.cuh) go
// through them first, the rest through the 8-channel loop.
template <int L, int REP, int ROWS>
__device__ __forceinline__ void SplitVecBody(SegDims g, const SegBlock* blocks,
                                             const int* head_first, const float* q, int split,
                                             float* part_o, float* part_ml) {
  constexpr int T = 32 / L;  // Tokens a warp pass.
  constexpr int D = 8 * L;
  // Passes at a time. Four, with the queries in shared memory and at most
  // 128 registers (two blocks an SM), ran 15% slower on an H100 than two with
  // the queries in registers (docs/gpu.md).
  constexpr int U = 2;
  // Quantized K a token a lane (KeyChunks) where its tables fit in shared
  // memory beside the rest: 2 KB a warp at most.
  constexpr bool kChunks = REP * D <= kChunkTable;
  constexpr bool kTiles = ROWS != kNoTiles;
  extern __shared__ float sh[];
  const int span = blockIdx.x, i = blockIdx.y, h = blockIdx.z;
  const VecShared layout = VecLayout(REP, D, split, kChunks, ROWS);
  const int stride = static_cast<int>(layout.stride);
  float* s = sh;                     // [REP, stride]
  float* red = sh + layout.red;      // [REP, D]
  float* qs = sh + layout.qs;        // [REP, D] with kChunks or kTiles
  const float* qt = sh + layout.qt;  // [D / 4, 32] with kAllTiles
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* table = sh + layout.tables + warp * REP * D;  // [REP, D] a warp, with kChunks
  const int slot = lane / L, c0 = (lane % L) * 8;
  const float* qrow = q + (static_cast<int64_t>(i) * g.q_heads + h * REP) * D;
  for (int x = threadIdx.x; x < REP * D; x += blockDim.x) {
    red[x] = 0.0f;
    if (kChunks || kTiles) qs[x] = qrow[x];
  }
  if constexpr (ROWS == kAllTiles) {
    for (int x = threadIdx.x; x < D * 8; x += blockDim.x) {
      const int j = x >> 5, ln = x & 31, gid = ln >> 2, tid = ln & 3;
      sh[layout.qt + x] = gid < REP ? qrow[gid * D + tid * (D / 4) + j] : 0.0f;
    }
  }
  // The lane's 8 channels of each of the group's query heads, in registers
  // (from shared memory with the tiles, where the loop takes few rows).
  float qr[REP][8];
  if constexpr (!kTiles) {
#pragma unroll
    for (int r = 0; r < REP; ++r)
#pragma unroll
      for (int e = 0; e < 8; ++e) qr[r][e] = qrow[r * D + c0 + e];
  }
  __syncthreads();
  const int64_t lo = static_cast<int64_t>(span) * split, hi = lo + split;
  if constexpr (kTiles) {
    ForSpanBlocks(g, blocks, head_first, h, i, lo, hi, true,
                  [&](const SegKv& kv, int64_t off, int64_t a, int64_t e) {
                    const int64_t end = KeyTileEnd(kv, ROWS, off, a, e);
                    if (end == a) return;
                    const int64_t la = a - off, lq = end - off, pos0 = off - lo;
                    if (kv.quantized_kind == 0) {
                      KeyTiles<D, REP, 16, kSplitWarps>(kv, la, lq, pos0, g.scale, warp, lane, qs,
                                                        qt, s, stride);
                    } else if (kv.bits == 4) {
                      KeyTiles<D, REP, 4, kSplitWarps>(kv, la, lq, pos0, g.scale, warp, lane, qs,
                                                       qt, s, stride);
                    } else {
                      KeyTiles<D, REP, 2, kSplitWarps>(kv, la, lq, pos0, g.scale, warp, lane, qs,
                                                       qt, s, stride);
                    }
                  });
  }
  ForSpanVec<T, U, D>(
      g, blocks, head_first, h, i, lo, hi, warp, slot, c0, true,
      [&](const float* x, int64_t pos, bool valid) {
        float part[REP];
#pragma unroll
        for (int r = 0; r < REP; ++r) {
          part[r] = 0.0f;
#pragma unroll
          for (int e = 0; e < 8; ++e) part[r] += (kTiles ? qs[r * D + c0 + e] : qr[r][e]) * x[e];
        }
        int r = 0;
        const float sum = RowReduce<L, REP>(part, lane, &r);
        if (valid && (lane & (L / REP - 1)) == 0) s[r * stride + pos] = sum * g.scale;
      },
      [&](const SegKv& kv, int64_t off, int64_t a, int64_t e) -> int64_t {
        if constexpr (kTiles) {
          // The tiles took these rows above.
          if (const int64_t end = KeyTileEnd(kv, ROWS, off, a, e); end != a) return end;
        }
        if constexpr (kChunks) {
          return KeyChunks<D, REP>(kv, off, a, e, lo, g.scale, warp, lane, qs, table, s, stride);
        } else {
          return a;
        }
      });
  __syncthreads();
  SpanSoftmax(g, blocks, head_first, h, i, lo, hi, REP, stride, s,
              part_ml + ((static_cast<int64_t>(span) * g.n + i) * g.q_heads + h * REP) * 2);
  __syncthreads();
  if constexpr (kTiles) {
    ForSpanBlocks(
        g, blocks, head_first, h, i, lo, hi, false,
        [&](const SegKv& kv, int64_t off, int64_t a, int64_t e) {
          const int64_t end = ValueTileEnd<D>(kv, ROWS, off, a, e);
          if (end == a) return;
          const int64_t la = a - off, lv = end - off, pos0 = off - lo;
          if (kv.quantized_kind == 0) {
            ValueTiles<D, REP, 16, 32, kSplitWarps>(kv, la, lv, pos0, warp, lane, s, stride, red);
          } else if (kv.bits == 4 && kv.group == 32) {
            ValueTiles<D, REP, 4, 32, kSplitWarps>(kv, la, lv, pos0, warp, lane, s, stride, red);
          } else if (kv.bits == 4) {
            ValueTiles<D, REP, 4, 64, kSplitWarps>(kv, la, lv, pos0, warp, lane, s, stride, red);
          } else if (kv.group == 32) {
            ValueTiles<D, REP, 2, 32, kSplitWarps>(kv, la, lv, pos0, warp, lane, s, stride, red);
          } else {
            ValueTiles<D, REP, 2, 64, kSplitWarps>(kv, la, lv, pos0, warp, lane, s, stride, red);
          }
        });
  }
  float acc[REP][8];
#pragma unroll
  for (int r = 0; r < REP; ++r)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[r][e] = 0.0f;
  ForSpanVec<T, U, D>(
      g, blocks, head_first, h, i, lo, hi, warp, slot, c0, false,
      [&](const float* x, int64_t pos, bool valid) {
        if (!valid) return;
#pragma unroll
        for (int r = 0; r < REP; ++r) {
          const float w = s[r * stride + pos];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r][e] += w * x[e];
        }
      },
      [&](const SegKv& kv, int64_t off, int64_t a, int64_t e) -> int64_t {
        if constexpr (kTiles) {
          return ValueTileEnd<D>(kv, ROWS, off, a, e);  // The tiles took these rows above.
        } else {
          return a;
        }
      });
  // The warp's token slots together, then the warps in order.
#pragma unroll
  for (int r = 0; r < REP; ++r) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
#pragma unroll
      for (int o = L; o < 32; o *= 2) acc[r][e] += __shfl_xor_sync(0xffffffffu, acc[r][e], o);
    }
  }
  InWarpOrder<kSplitWarps>(warp, [&] {
    if (slot != 0) return;
#pragma unroll
    for (int r = 0; r < REP; ++r)
#pragma unroll
      for (int e = 0; e < 8; ++e) red[r * D + c0 + e] += acc[r][e];
  });
  float* o = part_o + ((static_cast<int64_t>(span) * g.n + i) * g.q_heads + h * REP) * D;
  for (int x = threadIdx.x; x < REP * D; x += blockDim.x) o[x] = red[x];
}

template <int L, int REP>
__global__ void __launch_bounds__(32 * kSplitWarps)
    SplitVecKernel(SegDims g, const SegBlock* blocks, const int* head_first, const float* q,
                   int split, float* part_o, float* part_ml) {
  SplitVecBody<L, REP, kNoTiles>(g, blocks, head_first, q, split, part_o, part_ml);
}
// At most 128 registers a thread: two blocks an SM.
template <int L, int REP, int ROWS>
__global__ void __launch_bounds__(32 * kSplitWarps, 2)
    SplitMmaKernel(SegDims g, const SegBlock* blocks, const int* head_first, const float* q,
                   int split, float* part_o, float* part_ml) {
  SplitVecBody<L, REP, ROWS>(g, blocks, head_first, q, split, part_o, part_ml);
}

// The SplitVecKernel or SplitMmaKernel instance for (d, rep) and the rows
// its tiles take, or null when there is none.
using SplitFn = void (*)(SegDims, const SegBlock*, const int*, const float*, int, float*, float*);
template <int L, int ROWS>
SplitFn VecForRep(int rep) {
  if constexpr (ROWS == kNoTiles) {
    switch (rep) {
      case 1:
        return SplitVecKernel<L, 1>;
      case 2:
        return SplitVecKernel<L, 2>;
      case 4:
        return SplitVecKernel<L, 4>;
      case 8:
        return SplitVecKernel<L, 8>;
      default:
        return nullptr;
    }
  } else {
    switch (rep) {
      case 1:
        return SplitMmaKernel<L, 1, ROWS>;
      case 2:
        return SplitMmaKernel<L, 2, ROWS>;
      case 4:
        return SplitMmaKernel<L, 4, ROWS>;
      case 8:
        return SplitMmaKernel<L, 8, ROWS>;
      default:
        return nullptr;
    }
  }
}
// The rows the tensor-core tiles take for g: fp16 and KIVI on path 0, fp16
// only on path 4, for head_dim 64 and 128 (at 256 the accumulators would not
// fit two blocks an SM); none on path 3.
int VecRows(const SegDims& g) {
  if (g.d != 64 && g.d != 128) return kNoTiles;
  return g.path == 0 ? kAllTiles : g.path == 4 ? kFp16Tiles : kNoTiles;
}
SplitFn VecKernel(const SegDims& g) {
  if (g.path != 0 && g.path != 3 && g.path != 4) return nullptr;
  const int rep = g.q_heads / g.kv_heads;
  const int rows = VecRows(g);
  switch (g.d) {
    case 64:
      return rows == kAllTiles    ? VecForRep<8, kAllTiles>(rep)
             : rows == kFp16Tiles ? VecForRep<8, kFp16Tiles>(rep)
                                  : VecForRep<8, kNoTiles>(rep);
    case 128:
      return rows == kAllTiles    ? VecForRep<16, kAllTiles>(rep)
             : rows == kFp16Tiles ? VecForRep<16, kFp16Tiles>(rep)
                                  : VecForRep<16, kNoTiles>(rep);
    case 256:
      return VecForRep<32, kNoTiles>(rep);
    default:
      return nullptr;
  }
}

bool SplitFits(const SegDims& g) {
  return g.path != 1 && g.q_heads / g.kv_heads <= kSplitMaxRep && g.d <= 32 * kSplitMaxLaneCh;
}

// Tokens per span: enough spans to give every SM a few blocks, at least 64
// and at most 512 tokens each.
int SplitTokens(const SegDims& g) {
  static const int sms = [] {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      return 108;
    }
    return n;
  }();
  const int64_t rows = static_cast<int64_t>(max(g.n, 1)) * g.kv_heads;
  const int64_t want_spans = (4 * static_cast<int64_t>(sms) + rows - 1) / rows;
  int split = 64;
  while (split < 512 && (g.max_tokens + split - 1) / split > want_spans) split *= 2;
  return split;
}

int64_t SplitSpans(const SegDims& g, int split) {
  return max(int64_t{1}, (g.max_tokens + split - 1) / split);
}

}  // namespace
}  // namespace kvtier::cuda

#endif  // KVTIER_KERNELS_CUDA_SPAN_KERNELS_CUH_
