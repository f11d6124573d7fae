#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/seg_load.h"
#include "kernels/cuda/span_kernels.cuh"

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
