// A session's attention at one layer (worker/session.h): over the visible
// past rounds and the open round, causally and within a sliding window, on
// the host or, for a decode step, on the device; with speculation, over the
// gathered tokens only.
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

// Attention of n new tokens (positions base..base+n-1 of the open round,
// open_start + base + i in the conversation) at one layer over the visible
// past rounds plus the open round, causally. With a window (a sliding
// layer; 0: none), token i attends over the `window` positions up to
// itself: a past round that the window cuts is decoded from its first
// position inside it (its tokens are its positions: sliding models keep
// every token).
absl::Status AttendRounds(const ModelShape& sh, const std::vector<PlacedRound>& rounds,
                          const OpenLayer& cur, int64_t open_start, int64_t base, int64_t n,
                          int64_t window, const float* q, float* out, KernelLevel level) {
  const int d = sh.head_dim, rep = sh.q_heads / sh.kv_heads, es = sh.dtype_bytes();
  std::vector<KvBlock> blocks;
  std::vector<float> ck, cv;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = open_start + base + i;
    const int64_t first = window > 0 ? pos + 1 - window : std::numeric_limits<int64_t>::min();
    for (int h = 0; h < sh.kv_heads; ++h) {
      blocks.clear();
      for (const PlacedRound& r : rounds) {
        if (r.start + r.tokens <= first) continue;
        if (r.layer == nullptr) {
          return absl::InternalError("a past round inside a sliding window is not resident");
        }
        const HeadKv& hk = r.layer->heads[h];
        if (hk.len == 0) continue;
        if (r.start >= first) {
          blocks.push_back({hk.kview, hk.vview});
          continue;
        }
        if (hk.len != r.tokens) {
          return absl::InternalError(
              "a sliding layer's round lost tokens; its positions are unknown");
        }
        const int64_t from = first - r.start, m = r.tokens - from;
        ck.resize(static_cast<size_t>(m) * d);
        cv.resize(ck.size());
        DecodeRows(hk.kview, 0, from, r.tokens, ck.data(), level);
        DecodeRows(hk.vview, 0, from, r.tokens, cv.data(), level);
        blocks.push_back({EncodedView::Raw(DType::kFp32, ck.data(), 1, m, d, 0, d),
                          EncodedView::Raw(DType::kFp32, cv.data(), 1, m, d, 0, d)});
      }
      const int64_t from = window > 0 ? std::max<int64_t>(0, first - open_start) : 0;
      const int64_t visible = base + i + 1;
      const int64_t skip = from * d * es;
      blocks.push_back(
          {EncodedView::Raw(sh.dtype, cur.k_head(h, d, es) + skip, 1, visible - from, d, 0, d),
           EncodedView::Raw(sh.dtype, cur.v_head(h, d, es) + skip, 1, visible - from, d, 0, d)});
      const int64_t row = i * sh.q_heads * d + static_cast<int64_t>(h) * rep * d;
      KVT_RETURN_IF_ERROR(DecodeAttention({rep, 1, d}, q + row, blocks, out + row, level));
    }
  }
  return absl::OkStatus();
}

// Attention of one decode token at one layer over gathered past tokens
// (fp32 [u, d] per KV head) plus the open round.
absl::Status AttendGathered(const ModelShape& sh, const std::vector<std::vector<float>>& gk,
                            const std::vector<std::vector<float>>& gv, const OpenLayer& cur,
                            int64_t base, const float* q, float* out, KernelLevel level) {
  const int d = sh.head_dim, rep = sh.q_heads / sh.kv_heads, es = sh.dtype_bytes();
  std::vector<KvBlock> blocks;
  for (int h = 0; h < sh.kv_heads; ++h) {
    blocks.clear();
    const auto u = static_cast<int64_t>(gk[h].size()) / d;
    if (u > 0) {
      blocks.push_back({EncodedView::Raw(DType::kFp32, gk[h].data(), 1, u, d, 0, d),
                        EncodedView::Raw(DType::kFp32, gv[h].data(), 1, u, d, 0, d)});
    }
    blocks.push_back({EncodedView::Raw(sh.dtype, cur.k_head(h, d, es), 1, base + 1, d, 0, d),
                      EncodedView::Raw(sh.dtype, cur.v_head(h, d, es), 1, base + 1, d, 0, d)});
    const int64_t row = static_cast<int64_t>(h) * rep * d;
    KVT_RETURN_IF_ERROR(DecodeAttention({rep, 1, d}, q + row, blocks, out + row, level));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Engine::Session::DecodeOnDevice(int layer, const float* q, float* out,
                                             const float* q_next, KernelLevel level) {
  const int d = shape.head_dim, hkv = shape.kv_heads;
  const bool gathered = gather.layer == layer;
  absl::Status st;
  bool attending = false, selecting = false;
  SessionStats::SpeculationTime& times = stats.speculation_time;
  absl::Time at = absl::Now();
  // The time since the last mark, added to `part`.
  auto mark = [&at](absl::Duration* part) {
    const absl::Time now = absl::Now();
    *part += now - at;
    at = now;
  };
  // 1. This layer's attention over its gathered tokens, on the attention stream.
  if (gathered) {
    const int64_t rows = tokens + 1;
    const int64_t from = std::min(spec_device->MirroredRows(layer), tokens);
    std::vector<float> k, v;
    OpenRowsTokenMajor(open[layer], hkv, d, shape.dtype, rows, &k, &v, from);
    st = spec_device->LaunchAttend(layer, q, k.data(), v.data(), from, rows);
    attending = st.ok();
    ++times.steps;
    mark(&times.attend);
  }
  // 2. Layer + 1's selection on the speculation stream, meanwhile.
  SpecInputs next;
  if (st.ok() && q_next != nullptr) {
    next = SpecInputsAt(layer + 1, level);
    if (next.t_max > 0) {
      const int r = skew->partial_columns(), group = shape.q_heads / hkv;
      std::vector<std::vector<std::string_view>> parts(hkv);
      std::string key = absl::StrCat(reinterpret_cast<uintptr_t>(skew.get()));
      for (const RoundLayer* rl : next.vis) {
        absl::StrAppend(&key, ":", rl->partial_serial, "/", rl->partial[0].size());
        for (int h = 0; h < hkv; ++h) {
          const std::vector<uint16_t>& pk = rl->partial[h];
          parts[h].emplace_back(reinterpret_cast<const char*>(pk.data()),
                                pk.size() * sizeof(uint16_t));
        }
      }
      std::vector<float> qp(static_cast<size_t>(shape.q_heads) * r);
      for (int j = 0; j < shape.q_heads; ++j) {
        spec::SkewPartial(skew->heads[layer + 1][j / group], d, q_next + j * d, qp.data() + j * r);
      }
      st = spec_device->SetPartialKeys(layer + 1, key, parts);
      if (st.ok()) {
        st = spec_device->LaunchSelect(layer + 1, qp.data(), policy.speculation.alpha,
                                       policy.speculation.budget);
      }
      selecting = st.ok();
    }
  }
  mark(&times.select);
  // 3. The CPU's share while the GPU works: the hit-rate sample of this
  // layer's picks, or this layer's attention when nothing was gathered.
  if (st.ok() && gathered && gather.sample) {
    SampleHitRate(layer, q, level);
    mark(&times.sample);
  }
  if (st.ok() && !gathered) {
    st = AttendRounds(shape, VisiblePlaced(layer), open[layer], PastTokens(), tokens, 1,
                      shape.layer_window(layer), q, out, level);
  }
  gather.layer = -1;
  // 4. Layer + 1's tokens gathered from the pool and sent to the device.
  if (selecting) {
    at = absl::Now();
    absl::StatusOr<spec::Speculated> picked = spec_device->FinishSelect();
    mark(&times.select);
    if (st.ok() && !picked.ok()) st = picked.status();
    if (st.ok()) {
      GatherPicked(layer + 1, next, *std::move(picked), level);
      mark(&times.gather);
      st = spec_device->UploadGathered(layer + 1, gather.k, gather.v);
      mark(&times.upload);
      if (!st.ok()) gather.layer = -1;
    }
  }
  // 5. This layer's output.
  if (attending) {
    at = absl::Now();
    absl::Status done = spec_device->FinishAttend(out);
    mark(&times.attend);
    if (st.ok()) st = done;
  }
  if (!st.ok()) {
    LogWarn("speculation on the device failed; the step is rolled back",
            {{"session", key.ToString()}, {"layer", layer}, {"error", st.ToString()}});
    RollBackStep();
  }
  return st;
}

absl::Status Engine::Session::Attend(int layer, int64_t n, const float* qs, const float* ks,
                                     const float* vs, float* out, KernelLevel level) {
  absl::Status st;
  if (device != nullptr) {
    std::vector<const DeviceLayer*> rounds;
    for (const RoundLayer* r : Visible(layer)) rounds.push_back(r->device.get());
    st = device->Attend(layer, rounds, ks, vs, tokens, n, qs, out);
  } else if (gather.layer == layer && n == 1) {
    const absl::Time start = absl::Now();
    st = AttendGathered(shape, gather.k, gather.v, open[layer], tokens, qs, out, level);
    const absl::Time attended = absl::Now();
    ++stats.speculation_time.steps;
    stats.speculation_time.attend += attended - start;
    if (st.ok() && gather.sample) {
      SampleHitRate(layer, qs, level);
      stats.speculation_time.sample += absl::Now() - attended;
    }
    gather.layer = -1;
  } else {
    st = AttendRounds(shape, VisiblePlaced(layer), open[layer], PastTokens(), tokens, n,
                      shape.layer_window(layer), qs, out, level);
  }
  if (!st.ok()) RollBackStep();
  return st;
}

}  // namespace kvtier::worker
