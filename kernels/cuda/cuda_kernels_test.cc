// GPU tests (label gpu): the CUDA kernels against the CPU reference on the
// same bytes. Without a CUDA device they skip with a message.
#include "kernels/cuda/cuda_kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/codec.h"
#include "kernels/codec_internal.h"
#include "kernels/cuda/seg_load.h"
#include "kernels/flat_cache.h"
#include "kernels/half.h"
#include "kernels/speculation.h"
#include "tests/util/status_matchers.h"

namespace kvtier::cuda {
namespace {

#define SKIP_WITHOUT_GPU()                                                      \
  if (!DeviceAvailable()) {                                                     \
    GTEST_SKIP() << "no CUDA device: GPU tests run only on a machine with one"; \
  }

#define CUDA_OK(expr)                                         \
  do {                                                        \
    const int err_ = static_cast<int>(expr);                  \
    ASSERT_EQ(err_, 0) << #expr << ": " << ErrorString(err_); \
  } while (0)

template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) { cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)); }
  ~DeviceBuffer() { cudaFree(p_); }
  T* get() { return p_; }
  void Upload(const std::vector<T>& h) {
    cudaMemcpy(p_, h.data(), n_ * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> Download() {
    std::vector<T> h(n_);
    cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = nd(rng);
  return x;
}

TEST(CudaCodecTest, QuantizeAndDequantizeMatchTheReference) {
  SKIP_WITHOUT_GPU();
  for (int bits : {2, 4, 8}) {
    for (bool key : {true, false}) {
      for (int d : {64, 128, 256}) {
        QuantDims q;
        q.key = key;
        q.bits = bits;
        q.group = 32;
        q.tq = 71;
        q.d = d;
        q.slabs = 5;
        internal::QuantShape rs{key, bits, key ? 32 : std::min(32, d), q.tq, d};
        const std::vector<float> x = Random(q.slabs * q.tq * d, bits * 10 + d);
        DeviceBuffer<float> dx(x.size()), dout(x.size());
        DeviceBuffer<uint32_t> dcodes(q.WordsPerSlab() * q.slabs);
        DeviceBuffer<uint16_t> ds(q.GroupsPerSlab() * q.slabs), dz(q.GroupsPerSlab() * q.slabs);
        dx.Upload(x);
        CUDA_OK(Quantize(q, dx.get(), dcodes.get(), ds.get(), dz.get(), nullptr));
        CUDA_OK(Dequantize(q, dcodes.get(), ds.get(), dz.get(), dout.get(), nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        const std::vector<float> gpu = dout.Download();
        std::vector<uint8_t> codes(q.WordsPerSlab() * 4);
        std::vector<uint16_t> sc(q.GroupsPerSlab()), zc(q.GroupsPerSlab());
        std::vector<float> ref(q.tq * d);
        int differ = 0;
        for (int64_t s = 0; s < q.slabs; ++s) {
          std::fill(codes.begin(), codes.end(), 0);
          internal::QuantizeSlabRef(rs, x.data() + s * q.tq * d, codes.data(), sc.data(),
                                    zc.data());
          internal::DequantRowsRef(rs, codes.data(), sc.data(), zc.data(), 0, q.tq, ref.data());
          for (int64_t i = 0; i < q.tq * d; ++i) {
            const float g = gpu[s * q.tq * d + i];
            ASSERT_FALSE(std::isnan(g));
            if (g != ref[i]) {
              ++differ;
              // Off by at most one step at a rounding tie.
              ASSERT_NEAR(g, ref[i], 0.6f * (std::fabs(ref[i]) + 1.0f)) << i;
            }
          }
        }
        EXPECT_LE(differ, static_cast<int>(x.size() / 200) + 2)
            << "bits " << bits << " key " << key;
      }
    }
  }
}

TEST(CudaAttentionTest, FusedAttentionMatchesTheCpuReference) {
  SKIP_WITHOUT_GPU();
  for (const char* setting : {"kivi4", "kivi2", "kivi8", "fp16"}) {
    for (int qh : {8, 32}) {
      const int kvh = qh / 4, d = 128;
      const int64_t tokens = 1000;
      const std::vector<float> k = Random(kvh * tokens * d, 1), v = Random(kvh * tokens * d, 2);
      const std::vector<float> q = Random(qh * d, 3);
      KVT_ASSERT_OK_AND_ASSIGN(CodecConfig c, ParseCodecSetting(setting));
      const int64_t shape[] = {kvh, tokens, d};
      KVT_ASSERT_OK_AND_ASSIGN(EncodedBlock kt,
                               EncodedBlock::Encode(c, TensorRole::kKey, shape, k.data()));
      KVT_ASSERT_OK_AND_ASSIGN(EncodedBlock vt,
                               EncodedBlock::Encode(c, TensorRole::kValue, shape, v.data()));
      const EncodedView& kv = kt.view();
      const EncodedView& vv = vt.view();
      std::vector<float> ref(qh * d);
      KvBlock blk{kv, vv};
      ASSERT_TRUE(
          DecodeAttention({qh, kvh, d}, q.data(), {&blk, 1}, ref.data(), KernelLevel::kReference)
              .ok());
      // Upload each buffer as it lies in the tensor.
      std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> bufs;
      auto up = [&](const EncodedBlock& t, int i) {
        const std::string_view s = t.buffers()[i].data;
        bufs.push_back(std::make_unique<DeviceBuffer<uint8_t>>(s.size()));
        bufs.back()->Upload(std::vector<uint8_t>(s.begin(), s.end()));
        return bufs.back()->get();
      };
      DeviceKv dk, dv;
      if (c.codec == Codec::kRaw) {
        dk.raw = reinterpret_cast<const uint16_t*>(up(kt, 0));
        dv.raw = reinterpret_cast<const uint16_t*>(up(vt, 0));
      } else {
        dk = {kv.bits,
              kv.group,
              nullptr,
              reinterpret_cast<const uint32_t*>(up(kt, 0)),
              reinterpret_cast<const uint16_t*>(up(kt, 1)),
              reinterpret_cast<const uint16_t*>(up(kt, 2))};
        dv = {vv.bits,
              vv.group,
              nullptr,
              reinterpret_cast<const uint32_t*>(up(vt, 0)),
              reinterpret_cast<const uint16_t*>(up(vt, 1)),
              reinterpret_cast<const uint16_t*>(up(vt, 2))};
      }
      DeviceBuffer<float> dq(q.size()), scratch(qh * tokens), dout(qh * d);
      dq.Upload(q);
      AttnDims a{qh, kvh, d, tokens, 1.0f / std::sqrt(static_cast<float>(d))};
      CUDA_OK(DecodeAttention(a, dq.get(), dk, dv, scratch.get(), dout.get(), nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> gpu = dout.Download();
      for (size_t i = 0; i < gpu.size(); ++i) {
        ASSERT_NEAR(gpu[i], ref[i], 1e-4 + 1e-3 * std::fabs(ref[i])) << setting << " " << i;
      }
    }
  }
}

// Flat cache on the device: gather, appends that fill and overrun nothing,
// and attention, against the CPU FlatKvCache on the same fp16-rounded values.
TEST(CudaFlatCacheTest, GatherAppendAttendMatchTheCpuCache) {
  SKIP_WITHOUT_GPU();
  for (int d : {64, 128, 256}) {
    const int kvh = 8, qh = 32, appends = 9;
    const int64_t tokens = 1000;
    std::vector<float> k = Random(kvh * tokens * d, 31), v = Random(k.size(), 32);
    for (float& x : k) x = HalfToFloat(FloatToHalf(x));
    for (float& x : v) x = HalfToFloat(FloatToHalf(x));
    std::mt19937 rng(d);
    std::vector<std::vector<int64_t>> keep(kvh);
    for (int h = 0; h < kvh; ++h) {
      for (int64_t t = 0; t < tokens; ++t) {
        if (h != 5 && static_cast<int>(rng() % 8) <= h) keep[h].push_back(t);
      }
    }
    KVT_ASSERT_OK_AND_ASSIGN(FlatKvCache cpu,
                             FlatKvCache::Gather(kvh, d, tokens, k.data(), v.data(), keep));
    std::vector<int64_t> idx, cu{0}, off, lens;
    int64_t rows = 0, max_len = 0;
    for (int h = 0; h < kvh; ++h) {
      idx.insert(idx.end(), keep[h].begin(), keep[h].end());
      cu.push_back(cu.back() + static_cast<int64_t>(keep[h].size()));
      off.push_back(rows);
      lens.push_back(static_cast<int64_t>(keep[h].size()));
      rows += lens.back() + appends;
      max_len = std::max(max_len, lens.back() + appends);
    }
    DeviceBuffer<float> dk(k.size()), dv(v.size());
    dk.Upload(k);
    dv.Upload(v);
    DeviceBuffer<int64_t> didx(idx.size()), dcu(cu.size()), doff(off.size()), dlens(lens.size());
    didx.Upload(idx);
    dcu.Upload(cu);
    doff.Upload(off);
    dlens.Upload(lens);
    DeviceBuffer<uint16_t> kf(rows * d), vf(rows * d);
    const FlatDims f{qh, kvh, d, max_len, 0.0f};
    CUDA_OK(FlatGather(f, tokens, cu.back(), dk.get(), didx.get(), dcu.get(), doff.get(), kf.get(),
                       nullptr));
    CUDA_OK(FlatGather(f, tokens, cu.back(), dv.get(), didx.get(), dcu.get(), doff.get(), vf.get(),
                       nullptr));
    DeviceBuffer<float> nk(kvh * d), nv(kvh * d);
    for (int step = 0; step < appends; ++step) {
      std::vector<float> ak = Random(kvh * d, 40 + step), av = Random(kvh * d, 60 + step);
      for (float& x : ak) x = HalfToFloat(FloatToHalf(x));
      for (float& x : av) x = HalfToFloat(FloatToHalf(x));
      nk.Upload(ak);
      nv.Upload(av);
      CUDA_OK(
          FlatAppend(f, nk.get(), nv.get(), doff.get(), dlens.get(), kf.get(), vf.get(), nullptr));
      KVT_ASSERT_OK(cpu.Append(ak.data(), av.data()));
    }
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(dlens.Download(), cpu.head_lens());
    const std::vector<uint16_t> gk = kf.Download();
    for (int h = 0; h < kvh; ++h) {
      for (int64_t i = 0; i < cpu.head_lens()[h] * d; ++i) {
        ASSERT_EQ(HalfToFloat(gk[off[h] * d + i]), cpu.keys()[cpu.head_offsets()[h] * d + i])
            << "head " << h << " element " << i;
      }
    }
    const std::vector<float> q = Random(qh * d, 77);
    std::vector<float> ref(qh * d);
    KVT_ASSERT_OK(cpu.Attend(qh, q.data(), ref.data(), KernelLevel::kReference));
    DeviceBuffer<float> dq(q.size()), scratch(qh * max_len), dout(qh * d);
    dq.Upload(q);
    CUDA_OK(FlatDecodeAttention(f, dq.get(), kf.get(), vf.get(), doff.get(), dlens.get(),
                                scratch.get(), dout.get(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> gpu = dout.Download();
    for (size_t i = 0; i < gpu.size(); ++i) {
      ASSERT_NEAR(gpu[i], ref[i], 1e-4 + 1e-3 * std::fabs(ref[i])) << "d " << d << " " << i;
    }
  }
}

// SpeculateSelect against spec::Speculate on the same partial keys (an
// identity skew, so the partial query is the query's first r columns).
// Heads hold different token counts, as eviction leaves them. With small
// integer values every score is exact on both sides, ties included, so the
// picks must be equal token for token; with normal values they may differ
// only between tokens whose scores are within rounding of the cut.
void CheckSpeculation(bool integers, int budget, float alpha, uint32_t seed) {
  const int q_heads = 8, kv_heads = 2, d = 64, r = 13, group = q_heads / kv_heads;
  const std::vector<int64_t> lens = {3000, 1777};
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> small(-3, 3);
  auto value = [&] { return integers ? static_cast<float>(small(rng)) : nd(rng); };
  const std::vector<spec::SkewHead> layer = spec::IdentitySkew(1, q_heads, kv_heads, d, r).heads[0];
  std::vector<float> qhat(static_cast<size_t>(q_heads) * d);
  for (float& x : qhat) x = value();
  std::vector<uint16_t> pk16;
  std::vector<std::vector<float>> pk(kv_heads);
  std::vector<int64_t> offsets;
  for (int h = 0; h < kv_heads; ++h) {
    offsets.push_back(static_cast<int64_t>(pk16.size()) / r);
    for (int64_t i = 0; i < lens[h] * r; ++i) {
      const uint16_t x = FloatToHalf(value());
      pk16.push_back(x);
      pk[h].push_back(HalfToFloat(x));
    }
  }
  std::vector<const float*> pks = {pk[0].data(), pk[1].data()};
  spec::SpeculationParams params;
  params.alpha = alpha;
  params.budget = budget;
  const spec::Speculated want =
      spec::Speculate(layer, qhat.data(), pks, lens, q_heads, kv_heads, d, params);
  std::vector<float> qp(static_cast<size_t>(q_heads) * r);
  for (int j = 0; j < q_heads; ++j) {
    spec::SkewPartial(layer[j / group], d, qhat.data() + j * d, qp.data() + j * r);
  }
  const int64_t max_tokens = *std::max_element(lens.begin(), lens.end());
  DeviceBuffer<float> d_qp(qp.size()), d_scores(q_heads * max_tokens);
  DeviceBuffer<uint16_t> d_pk(pk16.size());
  DeviceBuffer<int64_t> d_off(kv_heads), d_lens(kv_heads);
  DeviceBuffer<int> d_counts(q_heads), d_n(1);
  DeviceBuffer<int32_t> d_idx(q_heads * max_tokens);
  d_qp.Upload(qp);
  d_pk.Upload(pk16);
  d_off.Upload(offsets);
  d_lens.Upload(lens);
  SpecDims s;
  s.q_heads = q_heads;
  s.kv_heads = kv_heads;
  s.r = r;
  s.max_tokens = max_tokens;
  s.scale = 1.0f / std::sqrt(static_cast<float>(d));
  s.alpha = alpha;
  s.budget = budget;
  CUDA_OK(SpeculateSelect(s, d_qp.get(), d_pk.get(), d_off.get(), d_lens.get(), d_scores.get(),
                          d_counts.get(), d_n.get(), d_idx.get(), nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int> counts = d_counts.Download();
  const int n = d_n.Download()[0];
  const std::vector<int32_t> idx = d_idx.Download();
  const std::vector<float> scores = d_scores.Download();
  if (integers) {
    EXPECT_EQ(counts, want.counts);
    EXPECT_EQ(n, want.n);
  } else {
    EXPECT_NEAR(n, want.n, 1);
  }
  for (int j = 0; j < q_heads; ++j) {
    const int64_t take = std::min<int64_t>(n, lens[j / group]);
    std::vector<int32_t> got(idx.begin() + j * max_tokens, idx.begin() + j * max_tokens + take);
    ASSERT_TRUE(std::is_sorted(got.begin(), got.end())) << "head " << j;
    ASSERT_TRUE(std::adjacent_find(got.begin(), got.end()) == got.end()) << "head " << j;
    if (integers || n == want.n) {
      if (integers) {
        EXPECT_EQ(got, want.tokens[j]) << "head " << j;
        continue;
      }
      // Where the sets differ, the scores must sit at the cut.
      std::vector<int32_t> only;
      std::set_symmetric_difference(got.begin(), got.end(), want.tokens[j].begin(),
                                    want.tokens[j].end(), std::back_inserter(only));
      float cut = INFINITY;
      for (int32_t t : want.tokens[j]) cut = std::min(cut, scores[j * max_tokens + t]);
      for (int32_t t : only) {
        EXPECT_NEAR(scores[j * max_tokens + t], cut, 1e-4f) << "head " << j << " token " << t;
      }
    }
  }
}

// The arrays of one SegmentedAttention test, laid out in one host arena that
// is uploaded whole: a block's pointers are arena offsets, placed on the host
// (for the reference, which reads them with the same SegLoad) or on the
// device.
class SegArena {
 public:
  template <typename T>
  size_t Add(const std::vector<T>& v) {
    const size_t off = (bytes_.size() + 255) / 256 * 256;
    bytes_.resize(off + v.size() * sizeof(T));
    std::memcpy(bytes_.data() + off, v.data(), v.size() * sizeof(T));
    return off;
  }
  const std::vector<uint8_t>& bytes() const { return bytes_; }

 private:
  std::vector<uint8_t> bytes_;
};

struct SegKvAt {  // A SegKv with arena offsets in place of pointers.
  SegKv kv;
  size_t raw = 0, codes = 0, scales = 0, zeros = 0, residual = 0;
  SegKv Place(const uint8_t* base) const {
    SegKv p = kv;
    if (kv.quantized_kind == 0) {
      p.raw = base + raw;
    } else {
      p.codes = reinterpret_cast<const uint32_t*>(base + codes);
      p.scales = reinterpret_cast<const uint16_t*>(base + scales);
      p.zeros = reinterpret_cast<const uint16_t*>(base + zeros);
      p.residual = base + residual;
    }
    return p;
  }
};

// Random codes, scales and zeros: SegLoad reads any bytes, so the kernel is
// checked on every code value whatever the codec would have written.
SegKvAt RandomQuantized(SegArena* a, bool key, int bits, int group, int64_t tokens,
                        int64_t quantized, int d, std::mt19937* rng) {
  SegKvAt s;
  s.kv.quantized_kind = 1;
  s.kv.dtype = 1;
  s.kv.bits = bits;
  s.kv.group = group;
  s.kv.key = key ? 1 : 0;
  s.kv.quantized = quantized;
  QuantDims q;
  q.key = key;
  q.bits = bits;
  q.group = group;
  q.tq = quantized;
  q.d = d;
  std::vector<uint32_t> codes(std::max<int64_t>(q.WordsPerSlab(), 1));
  for (uint32_t& w : codes) w = (*rng)();
  std::uniform_real_distribution<float> scale(0.01f, 0.3f), zero(-2.0f, 0.0f);
  std::vector<uint16_t> sc(std::max<int64_t>(q.GroupsPerSlab(), 1)), ze(sc.size());
  for (size_t i = 0; i < sc.size(); ++i) {
    sc[i] = FloatToHalf(scale(*rng));
    ze[i] = FloatToHalf(zero(*rng));
  }
  std::normal_distribution<float> nd;
  std::vector<uint16_t> res(std::max<int64_t>((tokens - quantized) * d, 1));
  for (uint16_t& x : res) x = FloatToHalf(nd(*rng));
  s.codes = a->Add(codes);
  s.scales = a->Add(sc);
  s.zeros = a->Add(ze);
  s.residual = a->Add(res);
  return s;
}

SegKvAt RandomRaw(SegArena* a, int dtype, int64_t tokens, int64_t stride, int d,
                  std::mt19937* rng) {
  SegKvAt s;
  s.kv.quantized_kind = 0;
  s.kv.dtype = dtype;
  s.kv.token_stride = stride;
  std::normal_distribution<float> nd;
  const size_t n = static_cast<size_t>(std::max<int64_t>((tokens - 1) * stride + d, 1));
  if (dtype == 0) {
    std::vector<float> x(n);
    for (float& v : x) v = nd(*rng);
    s.raw = a->Add(x);
  } else {
    std::vector<uint16_t> x(n);
    for (uint16_t& v : x) v = dtype == 1 ? FloatToHalf(nd(*rng)) : (FloatBits(nd(*rng)) >> 16);
    s.raw = a->Add(x);
  }
  return s;
}

// Every path of SegmentedAttention (spans read 8 channels a lane, with fp16
// and 2/4-bit KIVI rows on the tensor cores or not, quantized K of groups of
// 32 a token a lane, with and without their L2 prefetch; or a channel a
// lane; and merged; one block per query head when the group or
// head_dim is too large for spans) against a float64 longhand over the same
// blocks: quantized K (2, 4 and 8 bits, groups of 16 and 32) and V with
// residual rows, quantized rows starting on and off a multiple of 32, raw
// fp16/bf16/fp32 blocks, a causal open block with several queries, a KV head
// with no blocks (zeros), and heads longer than many spans.
TEST(CudaSegmentedAttentionTest, MatchesALonghandReference) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int q_heads, kv_heads, d, n;
    int64_t past;  // Tokens of the quantized block per head.
  };
  const Case cases[] = {
      {32, 8, 128, 1, 4000},  // 8 channels a lane: head_dim 64, 128, 256 and
      {32, 8, 128, 3, 700},   // 1, 2, 4 or 8 query heads per KV head.
      {8, 2, 64, 1, 37},     {16, 2, 256, 1, 900}, {4, 4, 64, 2, 300},
      {8, 4, 128, 1, 1500},  {12, 4, 96, 1, 500},  // head_dim 96: spans with a channel a lane.
      {12, 1, 96, 2, 300},  // 12 query heads per KV head: one block per head.
      {4, 2, 320, 1, 200},  // head_dim over 256: the same.
      {4, 1, 256, 1, 1200},  {4, 1, 256, 4, 512},  // Gemma 3 270M: one KV head of 256.
  };
  int seed = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.q_heads << "/" << c.kv_heads << "x" << c.d
                                      << " n=" << c.n << " past=" << c.past);
    std::mt19937 rng(++seed);
    const int d = c.d, rep = c.q_heads / c.kv_heads;
    const int64_t base = 5;  // Open-round tokens before the call's queries.
    SegArena arena;
    std::vector<std::pair<SegBlock, std::pair<SegKvAt, SegKvAt>>> blocks;
    std::vector<int> first;
    int64_t max_tokens = 0;
    for (int h = 0; h < c.kv_heads; ++h) {
      first.push_back(static_cast<int>(blocks.size()));
      if (h == 1 && c.kv_heads > 2) continue;  // No blocks at all: zeros.
      const int64_t past = c.past + 13 * h;
      const int64_t resid = std::min<int64_t>(past, 8);
      SegBlock b;
      b.tokens = past;
      SegBlock r;
      r.tokens = 29;
      auto raw = [&] {
        blocks.push_back({r,
                          {RandomRaw(&arena, 1 + h % 2, r.tokens, d, d, &rng),
                           RandomRaw(&arena, 1 + (h + 1) % 2, r.tokens, d, d, &rng)}});
      };
      // Odd heads put the raw block first: their quantized rows then start
      // at a position that is not a multiple of 32 (as a later round's do).
      if (h % 2 == 1) raw();
      blocks.push_back({b,
                        {RandomQuantized(&arena, true,
                                         h % 4 == 2   ? 8
                                         : h % 2 == 0 ? 4
                                                      : 2,
                                         h % 3 == 1 ? 16 : 32, past, past - resid, d, &rng),
                         // V groups of 12 channels: scales change inside 8 channels;
                         // 2 and 4 bits in groups of 32 and 64: the tensor-core tiles.
                         RandomQuantized(&arena, false,
                                         h % 2 == 0   ? 4
                                         : h % 4 == 1 ? 2
                                                      : 8,
                                         h % 3 == 2   ? 12
                                         : h % 4 == 0 ? 64
                                                      : 32,
                                         past, past - resid, d, &rng)}});
      if (h % 2 == 0) raw();
      SegBlock open;
      open.tokens = base + c.n;
      open.causal = 1;
      blocks.push_back({open,
                        {RandomRaw(&arena, 0, open.tokens, 2 * d, d, &rng),
                         RandomRaw(&arena, 0, open.tokens, 2 * d, d, &rng)}});
      max_tokens = std::max(max_tokens, past + r.tokens + open.tokens);
    }
    first.push_back(static_cast<int>(blocks.size()));
    const std::vector<uint8_t>& host = arena.bytes();
    DeviceBuffer<uint8_t> dev(host.size());
    dev.Upload(host);
    std::vector<SegBlock> hb, db;
    for (const auto& [b, kv] : blocks) {
      SegBlock x = b;
      x.k = kv.first.Place(host.data());
      x.v = kv.second.Place(host.data());
      hb.push_back(x);
      x.k = kv.first.Place(dev.get());
      x.v = kv.second.Place(dev.get());
      db.push_back(x);
    }
    SegDims g;
    g.n = c.n;
    g.q_heads = c.q_heads;
    g.kv_heads = c.kv_heads;
    g.d = d;
    g.base = base;
    g.max_tokens = max_tokens;
    const std::vector<float> q = Random(static_cast<size_t>(c.n) * c.q_heads * d, 100 + seed);
    DeviceBuffer<SegBlock> dblocks(db.size());
    dblocks.Upload(db);
    DeviceBuffer<int> dfirst(first.size());
    dfirst.Upload(first);
    // The longhand: float64 scores, softmax and sum over the same elements.
    std::vector<double> ref(q.size());
    std::vector<bool> empty(static_cast<size_t>(c.n) * c.q_heads);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    for (int i = 0; i < c.n; ++i) {
      for (int j = 0; j < c.q_heads; ++j) {
        const int h = j / rep;
        std::vector<double> sc;
        std::vector<std::pair<const SegBlock*, int64_t>> at;
        for (int b = first[h]; b < first[h + 1]; ++b) {
          const SegBlock& blk = hb[b];
          const int64_t len = blk.causal ? std::min(blk.tokens, base + i + 1) : blk.tokens;
          for (int64_t t = 0; t < len; ++t) {
            double dot = 0;
            for (int x = 0; x < d; ++x)
              dot += double(q[(int64_t(i) * c.q_heads + j) * d + x]) * SegLoad(blk.k, d, t, x);
            sc.push_back(dot * scale);
            at.push_back({&blk, t});
          }
        }
        empty[i * c.q_heads + j] = sc.empty();
        const double m = sc.empty() ? 0.0 : *std::max_element(sc.begin(), sc.end());
        double sum = 0;
        for (double& v : sc) sum += (v = std::exp(v - m));
        for (int x = 0; x < d; ++x) {
          double r = 0;
          for (size_t k = 0; k < sc.size(); ++k)
            r += sc[k] / sum * SegLoad(at[k].first->v, d, at[k].second, x);
          ref[(int64_t(i) * c.q_heads + j) * d + x] = r;
        }
      }
    }
    // The fastest kernel also with its L2 prefetch off, one iteration ahead
    // (the prologue covers part of a span) and far past any span's end.
    struct Run {
      int path, prefetch;
      const char* what;
    };
    for (const Run& run : {Run{0, -1, "fastest kernel"}, Run{0, 0, "fastest, no prefetch"},
                           Run{0, 1, "fastest, prefetch 1"}, Run{0, 64, "fastest, prefetch 64"},
                           Run{1, -1, "general kernel"}, Run{2, -1, "spans, a channel a lane"},
                           Run{3, -1, "spans, CUDA cores only"},
                           Run{4, -1, "spans, only fp16 rows on the tensor cores"}}) {
      SCOPED_TRACE(run.what);
      g.path = run.path;
      g.prefetch = run.prefetch;
      DeviceBuffer<float> dq(q.size()), dout(q.size()),
          scratch(static_cast<size_t>(SegmentedScratchFloats(g)));
      dq.Upload(q);
      cudaMemset(dout.get(), 0xff, q.size() * sizeof(float));  // NaN: all must be written.
      CUDA_OK(SegmentedAttention(g, dblocks.get(), dfirst.get(), dq.get(), scratch.get(),
                                 dout.get(), nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> out = dout.Download();
      // A second launch returns the same bits (the warps' sums meet in one
      // order): the prefill/decode hand-off relies on it.
      CUDA_OK(SegmentedAttention(g, dblocks.get(), dfirst.get(), dq.get(), scratch.get(),
                                 dout.get(), nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> again = dout.Download();
      EXPECT_EQ(std::memcmp(out.data(), again.data(), out.size() * sizeof(float)), 0)
          << "two launches on the same inputs differ";
      double err = 0, norm = 0;
      for (size_t e = 0; e < out.size(); ++e) {
        ASSERT_FALSE(std::isnan(out[e])) << "element " << e << " not written";
        err += (out[e] - ref[e]) * (out[e] - ref[e]);
        norm += ref[e] * ref[e];
        if (empty[e / d]) {
          EXPECT_EQ(out[e], 0.0f) << "a head with no tokens";
        }
      }
      EXPECT_LT(std::sqrt(err / std::max(norm, 1e-30)), 1e-5);
    }
  }
}

TEST(CudaSpeculationTest, SelectionMatchesTheCpuReference) {
  SKIP_WITHOUT_GPU();
  CheckSpeculation(/*integers=*/true, /*budget=*/0, /*alpha=*/4.0f, 1);
  CheckSpeculation(/*integers=*/true, /*budget=*/37, /*alpha=*/4.0f, 2);
  CheckSpeculation(/*integers=*/true, /*budget=*/0, /*alpha=*/1000.0f, 3);  // A head takes all.
  CheckSpeculation(/*integers=*/false, /*budget=*/0, /*alpha=*/2.0f, 4);
  CheckSpeculation(/*integers=*/false, /*budget=*/64, /*alpha=*/6.0f, 5);
}

}  // namespace
}  // namespace kvtier::cuda
