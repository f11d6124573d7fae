// GPU tests (label gpu): the CUDA kernels against the CPU reference on the
// same bytes. Without a CUDA device they skip with a message.
#include "kernels/cuda/cuda_kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/codec.h"
#include "kernels/codec_internal.h"
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

#define KVT_ASSERT_OK(expr) ASSERT_THAT((expr), ::kvtier::testing::IsOk())

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
      for (int d : {64, 128}) {
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
      KVT_ASSERT_OK_AND_ASSIGN(v1::EncodedTensor kt,
                               Encode(c, v1::TENSOR_ROLE_KEY, shape, k.data()));
      KVT_ASSERT_OK_AND_ASSIGN(v1::EncodedTensor vt,
                               Encode(c, v1::TENSOR_ROLE_VALUE, shape, v.data()));
      KVT_ASSERT_OK_AND_ASSIGN(EncodedView kv, ParseEncoded(kt));
      KVT_ASSERT_OK_AND_ASSIGN(EncodedView vv, ParseEncoded(vt));
      std::vector<float> ref(qh * d);
      KvBlock blk{kv, vv};
      ASSERT_TRUE(
          DecodeAttention({qh, kvh, d}, q.data(), {&blk, 1}, ref.data(), KernelLevel::kReference)
              .ok());
      // Upload each buffer as it lies in the tensor.
      std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> bufs;
      auto up = [&](const v1::EncodedTensor& t, int i) {
        const std::string& s = t.buffers(i).data();
        bufs.push_back(std::make_unique<DeviceBuffer<uint8_t>>(s.size()));
        bufs.back()->Upload(std::vector<uint8_t>(s.begin(), s.end()));
        return bufs.back()->get();
      };
      DeviceKv dk, dv;
      if (c.codec == v1::CODEC_RAW) {
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
  for (int d : {64, 128}) {
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
  std::vector<spec::SkewHead> layer(kv_heads);
  for (spec::SkewHead& sh : layer) {
    sh.a.assign(static_cast<size_t>(d) * d, 0.0f);
    for (int i = 0; i < d; ++i) sh.a[static_cast<size_t>(i) * d + i] = 1.0f;
    for (int c = 0; c < r; ++c) sh.partial.push_back(c);
  }
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
