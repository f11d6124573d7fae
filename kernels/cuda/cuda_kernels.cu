#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/mma_tiles.cuh"
#include "kernels/cuda/seg_load.h"

namespace kvtier::cuda {
namespace {

__device__ __forceinline__ void PutCode(uint32_t* codes, int bits, int64_t i, uint32_t code) {
  const int per_word = 32 / bits;
  atomicOr(&codes[i / per_word], code << ((i % per_word) * bits));
}

__device__ __forceinline__ float H2F(uint16_t h) { return SegHalf(h); }
__device__ __forceinline__ uint16_t F2H(float f) { return __half_as_ushort(__float2half_rn(f)); }

// Min/max of one group, then its codes. `stride` steps between the group's
// elements (d for a K channel, 1 for a V token).
__device__ void QuantizeGroup(int bits, const float* x, uint32_t* codes, int64_t first, int n,
                              int64_t stride, uint16_t* scale_out, uint16_t* zero_out) {
  float mn = FLT_MAX, mx = -FLT_MAX;
  for (int j = 0; j < n; ++j) {
    const float v = x[first + j * stride];
    mn = fminf(mn, v);
    mx = fmaxf(mx, v);
  }
  const float qmax = static_cast<float>((1 << bits) - 1);
  const uint16_t s16 = F2H((mx - mn) / qmax), z16 = F2H(mn);
  *scale_out = s16;
  *zero_out = z16;
  const float s = H2F(s16), z = H2F(z16);
  for (int j = 0; j < n; ++j) {
    const int64_t i = first + j * stride;
    float c = s > 0.0f ? rintf((x[i] - z) / s) : 0.0f;
    c = fminf(fmaxf(c, 0.0f), qmax);
    PutCode(codes, bits, i, static_cast<uint32_t>(c));
  }
}

// K: one thread per (group, channel) of a slab.
__global__ void QuantizeKeyKernel(QuantDims q, const float* x, uint32_t* codes, uint16_t* scales,
                                  uint16_t* zeros) {
  const int64_t slab = blockIdx.y;
  const int64_t groups = (q.tq + q.group - 1) / q.group;
  const int64_t gi = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gi >= groups * q.d) return;
  const int64_t g = gi / q.d;
  const int c = static_cast<int>(gi % q.d);
  const int64_t t0 = g * q.group;
  const int n = static_cast<int>(min(static_cast<int64_t>(q.group), q.tq - t0));
  const float* xs = x + slab * q.tq * q.d;
  QuantizeGroup(q.bits, xs, codes + slab * q.WordsPerSlab(), t0 * q.d + c, n, q.d,
                scales + slab * q.GroupsPerSlab() + gi, zeros + slab * q.GroupsPerSlab() + gi);
}

// V: one thread per (token, channel group) of a slab.
__global__ void QuantizeValueKernel(QuantDims q, const float* x, uint32_t* codes, uint16_t* scales,
                                    uint16_t* zeros) {
  const int64_t slab = blockIdx.y;
  const int groups = (q.d + q.group - 1) / q.group;
  const int64_t gi = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gi >= q.tq * groups) return;
  const int64_t t = gi / groups;
  const int g = static_cast<int>(gi % groups);
  const int c0 = g * q.group;
  const int n = min(q.group, q.d - c0);
  const float* xs = x + slab * q.tq * q.d;
  QuantizeGroup(q.bits, xs, codes + slab * q.WordsPerSlab(), t * q.d + c0, n, 1,
                scales + slab * q.GroupsPerSlab() + gi, zeros + slab * q.GroupsPerSlab() + gi);
}

__device__ __forceinline__ float Dequant(const QuantDims& q, const uint32_t* codes,
                                         const uint16_t* scales, const uint16_t* zeros, int64_t t,
                                         int c) {
  return DequantAt(codes, scales, zeros, q.key, q.bits, q.group, q.d, t, c);
}

__global__ void DequantizeKernel(QuantDims q, const uint32_t* codes, const uint16_t* scales,
                                 const uint16_t* zeros, float* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t per_slab = q.tq * q.d;
  if (i >= per_slab * q.slabs) return;
  const int64_t slab = i / per_slab, e = i % per_slab;
  out[i] = Dequant(q, codes + slab * q.WordsPerSlab(), scales + slab * q.GroupsPerSlab(),
                   zeros + slab * q.GroupsPerSlab(), e / q.d, static_cast<int>(e % q.d));
}

// Element (t, c) of KV head h, from either representation.
__device__ __forceinline__ float LoadKv(const DeviceKv& kv, const QuantDims& q, int h, int64_t t,
                                        int c) {
  if (kv.bits == 0) return H2F(kv.raw[(static_cast<int64_t>(h) * q.tq + t) * q.d + c]);
  return Dequant(q, kv.codes + h * q.WordsPerSlab(), kv.scales + h * q.GroupsPerSlab(),
                 kv.zeros + h * q.GroupsPerSlab(), t, c);
}

// scores[qh, t]: one thread per token of a KV head, for all its query heads.
// q for the group sits in shared memory.
__global__ void ScoreKernel(AttnDims a, QuantDims kq, DeviceKv k, const float* q, float* scores) {
  extern __shared__ float qs[];
  const int h = blockIdx.y;
  const int rep = a.q_heads / a.kv_heads;
  for (int i = threadIdx.x; i < rep * a.d; i += blockDim.x) qs[i] = q[h * rep * a.d + i];
  __syncthreads();
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= a.tokens) return;
  float acc[8];
  for (int r = 0; r < 8; ++r) acc[r] = 0.0f;
  for (int c = 0; c < a.d; ++c) {
    const float kv = LoadKv(k, kq, h, t, c);
    for (int r = 0; r < rep && r < 8; ++r) acc[r] += qs[r * a.d + c] * kv;
  }
  for (int r = 0; r < rep && r < 8; ++r)
    scores[static_cast<int64_t>(h * rep + r) * a.tokens + t] = acc[r] * a.scale;
  // More than 8 query heads per KV head: the rest, one at a time.
  for (int r = 8; r < rep; ++r) {
    float s = 0.0f;
    for (int c = 0; c < a.d; ++c) s += qs[r * a.d + c] * LoadKv(k, kq, h, t, c);
    scores[static_cast<int64_t>(h * rep + r) * a.tokens + t] = s * a.scale;
  }
}

// In-place softmax of s[0, n) by one block of up to 1024 threads (n = 0
// leaves nothing to do).
__device__ void BlockSoftmax(float* s, int64_t n) {
  __shared__ float red[1024];
  float m = -FLT_MAX;
  for (int64_t t = threadIdx.x; t < n; t += blockDim.x) m = fmaxf(m, s[t]);
  red[threadIdx.x] = m;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + w]);
    __syncthreads();
  }
  m = red[0];
  __syncthreads();
  float sum = 0.0f;
  for (int64_t t = threadIdx.x; t < n; t += blockDim.x) {
    const float e = __expf(s[t] - m);
    s[t] = e;
    sum += e;
  }
  red[threadIdx.x] = sum;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
    __syncthreads();
  }
  const float inv = red[0] > 0.0f ? 1.0f / red[0] : 0.0f;
  for (int64_t t = threadIdx.x; t < n; t += blockDim.x) s[t] *= inv;
}

// In-place softmax of one query head's scores per block.
__global__ void SoftmaxKernel(AttnDims a, float* scores) {
  BlockSoftmax(scores + static_cast<int64_t>(blockIdx.x) * a.tokens, a.tokens);
}

// out[qh, c] += sum over a token slice of p[qh, t] * v[t, c]: one thread per
// channel, blockIdx.x picks the slice, blockIdx.y the KV head.
__global__ void AccumulateKernel(AttnDims a, QuantDims vq, DeviceKv v, const float* p, float* out,
                                 int64_t slice) {
  const int h = blockIdx.y;
  const int c = threadIdx.x;
  if (c >= a.d) return;
  const int rep = a.q_heads / a.kv_heads;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * slice;
  const int64_t t1 = min(a.tokens, t0 + slice);
  for (int r = 0; r < rep; ++r) {
    const float* pr = p + static_cast<int64_t>(h * rep + r) * a.tokens;
    float acc = 0.0f;
    for (int64_t t = t0; t < t1; ++t) acc += pr[t] * LoadKv(v, vq, h, t, c);
    atomicAdd(&out[(h * rep + r) * a.d + c], acc);
  }
}

// Flat cache: one block per packed kept row, threads over channels.
__global__ void FlatGatherKernel(FlatDims f, int64_t tokens, const float* src, const int64_t* idx,
                                 const int64_t* cu_len, const int64_t* offsets, uint16_t* dst) {
  const int64_t i = blockIdx.x;
  int h = 0;
  while (h + 1 < f.kv_heads && cu_len[h + 1] <= i) ++h;
  const int64_t row = offsets[h] + (i - cu_len[h]);
  const float* s = src + (static_cast<int64_t>(h) * tokens + idx[i]) * f.d;
  for (int c = threadIdx.x; c < f.d; c += blockDim.x) dst[row * f.d + c] = F2H(s[c]);
}

// One block per head: write the row, then bump the length once.
__global__ void FlatAppendKernel(FlatDims f, const float* k, const float* v, const int64_t* offsets,
                                 int64_t* lens, uint16_t* kf, uint16_t* vf) {
  const int h = blockIdx.x;
  const int64_t row = offsets[h] + lens[h];
  for (int c = threadIdx.x; c < f.d; c += blockDim.x) {
    kf[row * f.d + c] = F2H(k[h * f.d + c]);
    vf[row * f.d + c] = F2H(v[h * f.d + c]);
  }
  __syncthreads();
  if (threadIdx.x == 0) lens[h] += 1;
}

// scores[qh, t] for t < lens[h]: one thread per token, the group's queries in
// shared memory.
__global__ void FlatScoreKernel(FlatDims f, const float* q, const uint16_t* kf,
                                const int64_t* offsets, const int64_t* lens, float* scores) {
  extern __shared__ float qs[];
  const int h = blockIdx.y;
  const int rep = f.q_heads / f.kv_heads;
  for (int i = threadIdx.x; i < rep * f.d; i += blockDim.x) qs[i] = q[h * rep * f.d + i];
  __syncthreads();
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= lens[h]) return;
  const uint16_t* kr = kf + (offsets[h] + t) * f.d;
  for (int r = 0; r < rep; ++r) {
    float s = 0.0f;
    for (int c = 0; c < f.d; ++c) s += qs[r * f.d + c] * H2F(kr[c]);
    scores[static_cast<int64_t>(h * rep + r) * f.max_len + t] = s * f.scale;
  }
}

// In-place softmax of one query head's lens[h] scores per block.
__global__ void FlatSoftmaxKernel(FlatDims f, const int64_t* lens, float* scores) {
  const int rep = f.q_heads / f.kv_heads;
  BlockSoftmax(scores + static_cast<int64_t>(blockIdx.x) * f.max_len, lens[blockIdx.x / rep]);
}

// out[qh, c] += sum over a token slice of p[qh, t] * v[t, c].
__global__ void FlatAccumulateKernel(FlatDims f, const uint16_t* vf, const int64_t* offsets,
                                     const int64_t* lens, const float* p, float* out,
                                     int64_t slice) {
  const int h = blockIdx.y;
  const int c = threadIdx.x;
  if (c >= f.d) return;
  const int rep = f.q_heads / f.kv_heads;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * slice;
  const int64_t t1 = min(lens[h], t0 + slice);
  if (t0 >= t1) return;
  const uint16_t* vh = vf + offsets[h] * f.d;
  for (int r = 0; r < rep; ++r) {
    const float* pr = p + static_cast<int64_t>(h * rep + r) * f.max_len;
    float acc = 0.0f;
    for (int64_t t = t0; t < t1; ++t) acc += pr[t] * H2F(vh[t * f.d + c]);
    atomicAdd(&out[(h * rep + r) * f.d + c], acc);
  }
}

__device__ __forceinline__ int64_t Visible(const SegBlock& b, const SegDims& g, int i) {
  return b.causal ? min(b.tokens, g.base + i + 1) : b.tokens;
}

// One block per (query i, query head j): scores into scratch, softmax, then
// each thread sums p * v for its channels.
__global__ void SegmentedAttentionKernel(SegDims g, const SegBlock* blocks, const int* head_first,
                                         const float* q, float* scratch, float* out) {
  extern __shared__ float qs[];
  const int i = blockIdx.x, j = blockIdx.y;
  const int h = j / (g.q_heads / g.kv_heads);
  const float* qrow = q + (static_cast<int64_t>(i) * g.q_heads + j) * g.d;
  for (int c = threadIdx.x; c < g.d; c += blockDim.x) qs[c] = qrow[c];
  __syncthreads();
  float* s = scratch + (static_cast<int64_t>(i) * g.q_heads + j) * g.max_tokens;
  int64_t total = 0;
  for (int b = head_first[h]; b < head_first[h + 1]; ++b) {
    const SegBlock& blk = blocks[b];
    const int64_t len = Visible(blk, g, i);
    for (int64_t t = threadIdx.x; t < len; t += blockDim.x) {
      float acc = 0.0f;
      for (int c = 0; c < g.d; ++c) acc += qs[c] * SegLoad(blk.k, g.d, t, c);
      s[total + t] = acc * g.scale;
    }
    total += len;
  }
  __syncthreads();
  BlockSoftmax(s, total);
  __syncthreads();
  float* o = out + (static_cast<int64_t>(i) * g.q_heads + j) * g.d;
  for (int c = threadIdx.x; c < g.d; c += blockDim.x) {
    float acc = 0.0f;
    int64_t off = 0;
    for (int b = head_first[h]; b < head_first[h + 1]; ++b) {
      const SegBlock& blk = blocks[b];
      const int64_t len = Visible(blk, g, i);
      for (int64_t t = 0; t < len; ++t) acc += s[off + t] * SegLoad(blk.v, g.d, t, c);
      off += len;
    }
    o[c] = acc;
  }
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

// ---- Speculation (SpeculateSelect) ----

// A float's bits in an order that sorts as the floats do (finite values).
__device__ __forceinline__ uint32_t OrderedKey(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

// One thread per (token, query head): the partial score, summed in column
// order with separate roundings, as the CPU reference does.
__global__ void SpecScoreKernel(SpecDims s, const float* qp, const uint16_t* pk,
                                const int64_t* offsets, const int64_t* lens, float* scores) {
  extern __shared__ float qs[];
  const int j = blockIdx.y;
  const int h = j / (s.q_heads / s.kv_heads);
  for (int c = threadIdx.x; c < s.r; c += blockDim.x) qs[c] = qp[static_cast<int64_t>(j) * s.r + c];
  __syncthreads();
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= lens[h]) return;
  const uint16_t* row = pk + (offsets[h] + t) * s.r;
  float acc = 0.0f;
  for (int c = 0; c < s.r; ++c) acc = __fadd_rn(acc, __fmul_rn(qs[c], H2F(row[c])));
  scores[static_cast<int64_t>(j) * s.max_tokens + t] = __fmul_rn(acc, s.scale);
}

constexpr int kCountThreads = 256;

struct MaxOf {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// One block per query head: its best score, then the tokens within alpha.
__global__ void SpecCountKernel(SpecDims s, const int64_t* lens, const float* scores, int* counts) {
  using Reduce = cub::BlockReduce<float, kCountThreads>;
  using Sum = cub::BlockReduce<int, kCountThreads>;
  __shared__ union {
    typename Reduce::TempStorage max;
    typename Sum::TempStorage sum;
  } tmp;
  __shared__ float best_s;
  const int j = blockIdx.x;
  const int64_t len = lens[j / (s.q_heads / s.kv_heads)];
  const float* row = scores + static_cast<int64_t>(j) * s.max_tokens;
  float best = -INFINITY;
  for (int64_t t = threadIdx.x; t < len; t += blockDim.x) best = fmaxf(best, row[t]);
  best = Reduce(tmp.max).Reduce(best, MaxOf());
  if (threadIdx.x == 0) best_s = best;
  __syncthreads();
  const float floor = __fsub_rn(best_s, s.alpha);
  int n = 0;
  for (int64_t t = threadIdx.x; t < len; t += blockDim.x) n += row[t] >= floor ? 1 : 0;
  n = Sum(tmp.sum).Sum(n);
  if (threadIdx.x == 0) counts[j] = n;
}

constexpr int kSelectThreads = 1024;

// One block per query head: n from every head's count, then the head's top
// min(n, len) tokens by a radix select on the scores' ordered bits (8 bits a
// pass, most significant first), written in token order.
__global__ void SpecSelectKernel(SpecDims s, const int64_t* lens, const float* scores,
                                 const int* counts, int* n_out, int32_t* idx) {
  using Scan = cub::BlockScan<int, kSelectThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int hist[256];
  __shared__ uint32_t prefix_s;
  __shared__ int64_t k_s, take_s;
  const int j = blockIdx.x;
  const int64_t len = lens[j / (s.q_heads / s.kv_heads)];
  const float* row = scores + static_cast<int64_t>(j) * s.max_tokens;
  int32_t* out = idx + static_cast<int64_t>(j) * s.max_tokens;
  if (threadIdx.x == 0) {
    double mean = 0;
    int64_t most = 0;
    for (int i = 0; i < s.q_heads; ++i) {
      mean += counts[i];
      most = max(most, lens[i / (s.q_heads / s.kv_heads)]);
    }
    mean /= s.q_heads;
    int64_t n = llround(mean);
    if (s.budget > 0) n = min(n, static_cast<int64_t>(s.budget));
    n = max(int64_t{1}, min(n, max(int64_t{1}, most)));
    if (j == 0) *n_out = static_cast<int>(n);
    take_s = min(n, len);
  }
  __syncthreads();
  const int64_t take = take_s;
  if (take == len) {
    for (int64_t t = threadIdx.x; t < len; t += blockDim.x) out[t] = static_cast<int32_t>(t);
    return;
  }
  // The take-th largest key: its bits, and how many keys equal to it are taken.
  uint32_t prefix = 0, mask = 0;
  int64_t k = take;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    for (int64_t t = threadIdx.x; t < len; t += blockDim.x) {
      const uint32_t key = OrderedKey(row[t]);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int64_t left = k;
      int digit = 255;
      for (; digit > 0 && hist[digit] < left; --digit) left -= hist[digit];
      prefix_s = prefix | (static_cast<uint32_t>(digit) << shift);
      k_s = left;
    }
    __syncthreads();
    prefix = prefix_s;
    k = k_s;
    mask |= 255u << shift;
    __syncthreads();
  }
  // Every key above it, and the first k equal to it in token order.
  int64_t eq_seen = 0, written = 0;
  for (int64_t first = 0; first < len; first += blockDim.x) {
    const int64_t t = first + threadIdx.x;
    const uint32_t key = t < len ? OrderedKey(row[t]) : 0;
    const int eq = t < len && key == prefix ? 1 : 0;
    int eq_before = 0, eq_all = 0;
    Scan(scan).ExclusiveSum(eq, eq_before, eq_all);
    __syncthreads();
    const int pick = t < len && (key > prefix || (eq != 0 && eq_seen + eq_before < k)) ? 1 : 0;
    int at = 0, picked = 0;
    Scan(scan).ExclusiveSum(pick, at, picked);
    __syncthreads();
    if (pick != 0) out[written + at] = static_cast<int32_t>(t);
    eq_seen += eq_all;
    written += picked;
  }
}

}  // namespace

int SegmentedAttention(const SegDims& dims, const SegBlock* blocks, const int* head_first,
                       const float* q, float* scratch, float* out, void* stream) {
  if (dims.n < 0 || dims.q_heads <= 0 || dims.kv_heads <= 0 || dims.q_heads % dims.kv_heads != 0 ||
      dims.d <= 0 || dims.d > 1024 || dims.max_tokens < 0 || dims.base < 0 || dims.path < 0 ||
      dims.path > 4) {
    return cudaErrorInvalidValue;
  }
  if (dims.n == 0) return 0;
  SegDims g = dims;
  if (g.scale == 0.0f) g.scale = 1.0f / sqrtf(static_cast<float>(g.d));
  if (g.prefetch < 0) g.prefetch = kDefaultPrefetch;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (!SplitFits(g)) {
    const dim3 grid(static_cast<unsigned>(g.n), static_cast<unsigned>(g.q_heads));
    SegmentedAttentionKernel<<<grid, 256, g.d * sizeof(float), st>>>(g, blocks, head_first, q,
                                                                     scratch, out);
    return cudaGetLastError();
  }
  const int split = SplitTokens(g);
  const int64_t spans = SplitSpans(g, split);
  const int rep = g.q_heads / g.kv_heads;
  float* part_o = scratch;
  float* part_ml = scratch + spans * g.n * g.q_heads * g.d;
  const dim3 grid(static_cast<unsigned>(spans), static_cast<unsigned>(g.n),
                  static_cast<unsigned>(g.kv_heads));
  if (SplitFn vec = VecKernel(g); vec != nullptr) {
    const size_t shared =
        static_cast<size_t>(
            VecLayout(rep, g.d, split, rep * g.d <= kChunkTable, VecRows(g)).total) *
        sizeof(float);
    vec<<<grid, 32 * kSplitWarps, shared, st>>>(g, blocks, head_first, q, split, part_o, part_ml);
  } else {
    const size_t shared = static_cast<size_t>(rep) * (2 * g.d + split) * sizeof(float);
    SplitAttentionKernel<<<grid, 32 * kSplitWarps, shared, st>>>(g, blocks, head_first, q, split,
                                                                 part_o, part_ml);
  }
  SplitCombineKernel<<<static_cast<unsigned>(g.n * g.q_heads), kCombineThreads, 0, st>>>(
      g, static_cast<int>(spans), part_o, part_ml, out);
  return cudaGetLastError();
}

int64_t SegmentedScratchFloats(const SegDims& dims) {
  if (dims.q_heads <= 0 || dims.kv_heads <= 0 || dims.q_heads % dims.kv_heads != 0 || dims.d <= 0 ||
      dims.n <= 0) {
    return 0;
  }
  if (!SplitFits(dims)) return static_cast<int64_t>(dims.n) * dims.q_heads * dims.max_tokens;
  const int64_t spans = SplitSpans(dims, SplitTokens(dims));
  return spans * dims.n * dims.q_heads * (dims.d + 2);
}

int SpeculateSelect(const SpecDims& s, const float* qp, const uint16_t* pk, const int64_t* offsets,
                    const int64_t* lens, float* scores, int* counts, int* n_out, int32_t* idx,
                    void* stream) {
  if (s.q_heads <= 0 || s.kv_heads <= 0 || s.q_heads % s.kv_heads != 0 || s.r <= 0 || s.r > 1024 ||
      s.max_tokens < 0 || s.max_tokens > (int64_t{1} << 31) || s.budget < 0) {
    return cudaErrorInvalidValue;
  }
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (s.max_tokens > 0) {
    const dim3 grid(static_cast<unsigned>((s.max_tokens + 255) / 256),
                    static_cast<unsigned>(s.q_heads));
    SpecScoreKernel<<<grid, 256, s.r * sizeof(float), st>>>(s, qp, pk, offsets, lens, scores);
  }
  SpecCountKernel<<<s.q_heads, kCountThreads, 0, st>>>(s, lens, scores, counts);
  SpecSelectKernel<<<s.q_heads, kSelectThreads, 0, st>>>(s, lens, scores, counts, n_out, idx);
  return cudaGetLastError();
}

bool DeviceAvailable() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

const char* ErrorString(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

int Quantize(const QuantDims& q, const float* x, uint32_t* codes, uint16_t* scales, uint16_t* zeros,
             void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (q.tq == 0 || q.slabs == 0) return 0;
  cudaError_t e = cudaMemsetAsync(codes, 0, q.WordsPerSlab() * q.slabs * 4, s);
  if (e != cudaSuccess) return e;
  const int64_t per_slab = q.GroupsPerSlab();
  const dim3 grid(static_cast<unsigned>((per_slab + 127) / 128), static_cast<unsigned>(q.slabs));
  if (q.key) {
    QuantizeKeyKernel<<<grid, 128, 0, s>>>(q, x, codes, scales, zeros);
  } else {
    QuantizeValueKernel<<<grid, 128, 0, s>>>(q, x, codes, scales, zeros);
  }
  return cudaGetLastError();
}

int Dequantize(const QuantDims& q, const uint32_t* codes, const uint16_t* scales,
               const uint16_t* zeros, float* out, void* stream) {
  const int64_t n = q.tq * q.d * q.slabs;
  if (n == 0) return 0;
  DequantizeKernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0,
                     static_cast<cudaStream_t>(stream)>>>(q, codes, scales, zeros, out);
  return cudaGetLastError();
}

int DecodeAttention(const AttnDims& a, const float* q, const DeviceKv& k, const DeviceKv& v,
                    float* scratch, float* out, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (a.q_heads <= 0 || a.kv_heads <= 0 || a.q_heads % a.kv_heads != 0 || a.d <= 0 || a.d > 256 ||
      a.tokens <= 0) {
    return cudaErrorInvalidValue;
  }
  QuantDims kq;
  kq.key = true;
  kq.bits = k.bits > 0 ? k.bits : 16;
  kq.group = k.group;
  kq.tq = a.tokens;
  kq.d = a.d;
  QuantDims vq = kq;
  vq.key = false;
  vq.bits = v.bits > 0 ? v.bits : 16;
  vq.group = v.group;
  const int rep = a.q_heads / a.kv_heads;
  const dim3 sgrid(static_cast<unsigned>((a.tokens + 127) / 128),
                   static_cast<unsigned>(a.kv_heads));
  ScoreKernel<<<sgrid, 128, rep * a.d * sizeof(float), s>>>(a, kq, k, q, scratch);
  SoftmaxKernel<<<a.q_heads, 1024, 0, s>>>(a, scratch);
  cudaError_t e = cudaMemsetAsync(out, 0, static_cast<size_t>(a.q_heads) * a.d * sizeof(float), s);
  if (e != cudaSuccess) return e;
  const int64_t slice = 256;
  const dim3 agrid(static_cast<unsigned>((a.tokens + slice - 1) / slice),
                   static_cast<unsigned>(a.kv_heads));
  AccumulateKernel<<<agrid, a.d <= 32 ? 32 : ((a.d + 31) / 32) * 32, 0, s>>>(a, vq, v, scratch, out,
                                                                             slice);
  return cudaGetLastError();
}

namespace {
bool BadFlat(const FlatDims& f) {
  return f.q_heads <= 0 || f.kv_heads <= 0 || f.q_heads % f.kv_heads != 0 || f.d <= 0 ||
         f.d > 256 || f.max_len < 0;
}
}  // namespace

int FlatGather(const FlatDims& f, int64_t tokens, int64_t kept, const float* src,
               const int64_t* idx, const int64_t* cu_len, const int64_t* offsets, uint16_t* dst,
               void* stream) {
  if (BadFlat(f) || tokens < 0 || kept < 0) return cudaErrorInvalidValue;
  if (kept == 0) return 0;
  FlatGatherKernel<<<static_cast<unsigned>(kept), 128, 0, static_cast<cudaStream_t>(stream)>>>(
      f, tokens, src, idx, cu_len, offsets, dst);
  return cudaGetLastError();
}

int FlatAppend(const FlatDims& f, const float* k, const float* v, const int64_t* offsets,
               int64_t* lens, uint16_t* k_flat, uint16_t* v_flat, void* stream) {
  if (BadFlat(f)) return cudaErrorInvalidValue;
  FlatAppendKernel<<<f.kv_heads, 128, 0, static_cast<cudaStream_t>(stream)>>>(f, k, v, offsets,
                                                                              lens, k_flat, v_flat);
  return cudaGetLastError();
}

int FlatDecodeAttention(const FlatDims& f, const float* q, const uint16_t* k_flat,
                        const uint16_t* v_flat, const int64_t* offsets, const int64_t* lens,
                        float* scratch, float* out, void* stream) {
  if (BadFlat(f)) return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaMemsetAsync(out, 0, static_cast<size_t>(f.q_heads) * f.d * sizeof(float), s);
  if (e != cudaSuccess || f.max_len == 0) return e;
  FlatDims g = f;
  if (g.scale == 0.0f) g.scale = 1.0f / sqrtf(static_cast<float>(g.d));
  const int rep = g.q_heads / g.kv_heads;
  const dim3 sgrid(static_cast<unsigned>((g.max_len + 127) / 128),
                   static_cast<unsigned>(g.kv_heads));
  FlatScoreKernel<<<sgrid, 128, rep * g.d * sizeof(float), s>>>(g, q, k_flat, offsets, lens,
                                                                scratch);
  FlatSoftmaxKernel<<<g.q_heads, 1024, 0, s>>>(g, lens, scratch);
  const int64_t slice = 256;
  const dim3 agrid(static_cast<unsigned>((g.max_len + slice - 1) / slice),
                   static_cast<unsigned>(g.kv_heads));
  FlatAccumulateKernel<<<agrid, ((g.d + 31) / 32) * 32, 0, s>>>(g, v_flat, offsets, lens, scratch,
                                                                out, slice);
  return cudaGetLastError();
}

}  // namespace kvtier::cuda
