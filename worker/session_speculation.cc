// A session's speculation (InfiniGen, worker/session.h): the next layer's
// tokens picked from partial skewed keys, their rows gathered from the host
// pool, and the sampled hit rate against a dense pass.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "encoded/encoded_tensor.h"
#include "google/protobuf/io/coded_stream.h"
#include "kernels/attention.h"
#include "kernels/half.h"
#include "worker/session.h"

namespace kvtier::worker {
namespace {

// The partial skewed keys of one past round's layer (cached in it).
void EnsurePartial(const RoundLayer& rl, const spec::SkewModel& skew, int layer, int d,
                   KernelLevel level) {
  if (rl.partial_skew == &skew) return;
  const int r = skew.partial_columns();
  rl.partial.assign(rl.heads.size(), {});
  std::vector<float> rows;
  for (size_t h = 0; h < rl.heads.size(); ++h) {
    const HeadKv& hk = rl.heads[h];
    rows.resize(static_cast<size_t>(hk.len) * d);
    if (hk.len > 0) DecodeRows(hk.kview, 0, 0, hk.len, rows.data(), level);
    std::vector<uint16_t>& pk = rl.partial[h];
    pk.resize(static_cast<size_t>(hk.len) * r);
    std::vector<float> skewed(static_cast<size_t>(hk.len) * r);
    spec::SkewPartialRows(skew.heads[layer][h], d, rows.data(), hk.len, skewed.data());
    for (size_t i = 0; i < skewed.size(); ++i) {
      pk[i] = FloatToHalf(std::clamp(skewed[i], -kHalfMax, kHalfMax));
    }
  }
  rl.partial_skew = &skew;
  rl.partial_serial = NewPartialSerial();
}

}  // namespace

Engine::Session::SpecInputs Engine::Session::SpecInputsAt(int layer, KernelLevel level) const {
  SpecInputs in;
  in.vis = Visible(layer);
  in.total.assign(shape.kv_heads, 0);
  for (const RoundLayer* rl : in.vis) {
    EnsurePartial(*rl, *skew, layer, shape.head_dim, level);
    for (int h = 0; h < shape.kv_heads; ++h) in.total[h] += rl->heads[h].len;
  }
  in.t_max = *std::max_element(in.total.begin(), in.total.end());
  return in;
}

void Engine::Session::Speculate(int layer, const float* q_next, KernelLevel level) {
  const absl::Time start = absl::Now();
  gather.layer = -1;
  const SpecInputs in = SpecInputsAt(layer, level);
  if (in.t_max == 0) return;
  const int hkv = shape.kv_heads;
  // Past tokens' partial keys per KV head (eviction keeps a different count
  // per head), concatenated in the rounds' order.
  const int r = skew->partial_columns();
  std::vector<std::vector<float>> pk(hkv);
  for (int h = 0; h < hkv; ++h) {
    pk[h].resize(static_cast<size_t>(in.total[h]) * r);
    float* at = pk[h].data();
    for (const RoundLayer* rl : in.vis) {
      const int64_t len = rl->heads[h].len;
      if (len == 0) continue;
      DecodeRows(EncodedView::Raw(DType::kFp16, rl->partial[h].data(), 1, len, r, 0, r), 0, 0, len,
                 at, level);
      at += len * r;
    }
  }
  std::vector<const float*> pks(hkv);
  for (int h = 0; h < hkv; ++h) pks[h] = pk[h].data();
  spec::SpeculationParams params;
  params.alpha = policy.speculation.alpha;
  params.budget = policy.speculation.budget;
  spec::Speculated picked = spec::Speculate(skew->heads[layer], q_next, pks, in.total,
                                            shape.q_heads, hkv, shape.head_dim, params);
  const absl::Time selected = absl::Now();
  stats.speculation_time.select += selected - start;
  GatherPicked(layer, in, std::move(picked), level);
  stats.speculation_time.gather += absl::Now() - selected;
}

void Engine::Session::GatherPicked(int layer, const SpecInputs& in, spec::Speculated picked,
                                   KernelLevel level) {
  const std::vector<const RoundLayer*>& vis = in.vis;
  const std::vector<int64_t>& total = in.total;
  const int d = shape.head_dim, hkv = shape.kv_heads, group = shape.q_heads / hkv;
  const int r = skew->partial_columns();
  uint64_t dense = 0;
  for (const RoundLayer* rl : vis) dense += static_cast<uint64_t>(rl->bytes);
  if (spec_stats.size() != static_cast<size_t>(shape.layers)) spec_stats.resize(shape.layers);
  SpeculationLayerStats& st = spec_stats[layer];
  ++st.steps;
  st.past_tokens +=
      static_cast<uint64_t>(std::accumulate(total.begin(), total.end(), int64_t{0}) / hkv);
  st.kept += static_cast<uint64_t>(picked.n);
  st.bytes_dense += dense;
  uint64_t bytes = 0;
  for (int h = 0; h < hkv; ++h) bytes += static_cast<uint64_t>(total[h]) * r * sizeof(uint16_t);
  gather.k.assign(hkv, {});
  gather.v.assign(hkv, {});
  for (int h = 0; h < hkv; ++h) {
    std::vector<int32_t> u;
    for (int g = 0; g < group; ++g) {
      const auto& t = picked.tokens[h * group + g];
      u.insert(u.end(), t.begin(), t.end());
    }
    std::sort(u.begin(), u.end());
    u.erase(std::unique(u.begin(), u.end()), u.end());
    st.gathered += u.size();
    gather.k[h].resize(u.size() * d);
    gather.v[h].resize(u.size() * d);
    // Walk the rounds once; runs of consecutive tokens decode together.
    size_t i = 0;
    int64_t first = 0;
    for (const RoundLayer* rl : vis) {
      const HeadKv& hk = rl->heads[h];
      const int64_t end = first + hk.len;
      const double per_token =
          hk.len > 0
              ? static_cast<double>(rl->tensors[2 * h].size() + rl->tensors[2 * h + 1].size()) /
                    static_cast<double>(hk.len)
              : 0;
      size_t from = i;
      while (i < u.size() && u[i] < end) {
        size_t j = i + 1;
        while (j < u.size() && u[j] == u[j - 1] + 1 && u[j] < end) ++j;
        const int64_t t0 = u[i] - first, t1 = u[j - 1] - first + 1;
        DecodeRows(hk.kview, 0, t0, t1, gather.k[h].data() + i * d, level);
        DecodeRows(hk.vview, 0, t0, t1, gather.v[h].data() + i * d, level);
        std::vector<uint32_t>& fetched = rl->FetchCounts(h);
        for (int64_t t = t0; t < t1; ++t) ++fetched[t];
        i = j;
      }
      bytes += static_cast<uint64_t>(per_token * static_cast<double>(i - from) + 0.5);
      first = end;
    }
  }
  st.bytes_speculative += bytes;
  gather.sample = (decode_steps - 1) % kHitSampleEvery == 0;
  if (gather.sample) gather.picked = std::move(picked);
  gather.layer = layer;
}

void Engine::Session::SampleHitRate(int layer, const float* q, KernelLevel level) {
  // The true scores of this step's query over every visible past token:
  // a dense pass, which is why it runs on every kHitSampleEvery-th step only.
  const std::vector<const RoundLayer*> vis = Visible(layer);
  const int d = shape.head_dim, hkv = shape.kv_heads;
  std::vector<std::vector<float>> keys(hkv);
  std::vector<int64_t> total(hkv, 0);
  std::vector<const float*> ptrs(hkv);
  for (int h = 0; h < hkv; ++h) {
    for (const RoundLayer* rl : vis) {
      const HeadKv& hk = rl->heads[h];
      const size_t at = keys[h].size();
      keys[h].resize(at + static_cast<size_t>(hk.len) * d);
      if (hk.len > 0) DecodeRows(hk.kview, 0, 0, hk.len, keys[h].data() + at, level);
      total[h] += hk.len;
    }
    ptrs[h] = keys[h].data();
  }
  const spec::HitRate hr = spec::Score(gather.picked, q, ptrs, total, shape.q_heads, hkv, d);
  SpeculationLayerStats& st = spec_stats[layer];
  ++st.sampled;
  st.hit_sum += hr.hit;
  st.mass_sum += hr.mass;
}

}  // namespace kvtier::worker
