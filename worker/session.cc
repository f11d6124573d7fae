#include "worker/session.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "google/protobuf/io/coded_stream.h"
#include "kernels/attention.h"
#include "kernels/encoded_tensor.h"
#include "kernels/half.h"

namespace kvtier::worker {

int64_t MonoUs(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

double MsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

const char* StateName(SessionState s) {
  switch (s) {
    case SessionState::kIdle:
      return "idle";
    case SessionState::kOpen:
      return "open";
    case SessionState::kPrefill:
      return "prefill";
    case SessionState::kDecode:
      return "decode";
    case SessionState::kEnding:
      return "ending";
  }
  return "?";
}

absl::StatusOr<std::vector<std::unique_ptr<RoundLayer>>> MakeLayers(
    std::shared_ptr<const std::string> payload, int layers, int kv_heads, int d, bool verify_crc,
    uint32_t* outside_crc) {
  auto split = SplitPayload(*payload, verify_crc, outside_crc);
  if (!split.ok()) {
    return absl::DataLossError(absl::StrCat("segment payload: ", split.status().message()));
  }
  if (static_cast<int64_t>(split->size()) != int64_t{2} * kv_heads * layers) {
    return absl::DataLossError(absl::StrCat("segment payload holds ", split->size(),
                                            " tensors; the model needs ", 2 * kv_heads * layers));
  }
  std::vector<std::unique_ptr<RoundLayer>> out;
  for (int l = 0; l < layers; ++l) {
    auto layer = std::make_unique<RoundLayer>();
    layer->payload = payload;
    layer->heads.resize(kv_heads);
    for (int h = 0; h < kv_heads; ++h) {
      const TensorParts& kt = (*split)[(l * kv_heads + h) * 2];
      const TensorParts& vt = (*split)[(l * kv_heads + h) * 2 + 1];
      HeadKv& hk = layer->heads[h];
      auto kv = ParseEncoded(kt);
      auto vv = kv.ok() ? ParseEncoded(vt) : kv;
      if (!vv.ok())
        return absl::DataLossError(absl::StrCat("segment tensor: ", vv.status().message()));
      hk.kview = *kv;
      hk.vview = *vv;
      if (hk.kview.slabs != 1 || hk.kview.head_dim != d || hk.vview.tokens != hk.kview.tokens ||
          hk.vview.head_dim != d || hk.vview.slabs != 1) {
        return absl::DataLossError("segment tensor shape does not match the session's model");
      }
      hk.len = hk.kview.tokens;
      layer->bytes += static_cast<int64_t>(kt.bytes.size() + vt.bytes.size());
      layer->tensors.push_back(kt.bytes);
      layer->tensors.push_back(vt.bytes);
      layer->outside.push_back(kt.outside);
      layer->outside.push_back(vt.outside);
    }
    out.push_back(std::move(layer));
  }
  return out;
}

std::string SerializePayload(const std::vector<size_t>& sizes,
                             const std::function<uint8_t*(size_t, uint8_t*)>& write) {
  using google::protobuf::io::CodedOutputStream;
  constexpr uint32_t kTensorsTag = (1 << 3) | 2;  // Field 1, length-delimited.
  size_t total = 0;
  for (size_t n : sizes) total += 1 + CodedOutputStream::VarintSize64(n) + n;
  std::string out(total, '\0');
  auto* p = reinterpret_cast<uint8_t*>(out.data());
  for (size_t i = 0; i < sizes.size(); ++i) {
    p = CodedOutputStream::WriteVarint32ToArray(kTensorsTag, p);
    p = CodedOutputStream::WriteVarint64ToArray(sizes[i], p);
    p = write(i, p);
  }
  return out;
}

void AppendPayloadFraming(size_t n, std::string* out) {
  using google::protobuf::io::CodedOutputStream;
  constexpr uint32_t kTensorsTag = (1 << 3) | 2;  // Field 1, length-delimited.
  uint8_t buf[16];
  uint8_t* p = CodedOutputStream::WriteVarint32ToArray(kTensorsTag, buf);
  p = CodedOutputStream::WriteVarint64ToArray(n, p);
  out->append(reinterpret_cast<const char*>(buf), static_cast<size_t>(p - buf));
}

std::string SerializePayload(const std::vector<std::string_view>& tensors) {
  std::vector<size_t> sizes;
  for (std::string_view t : tensors) sizes.push_back(t.size());
  return SerializePayload(sizes, [&](size_t i, uint8_t* p) {
    return std::copy(tensors[i].begin(), tensors[i].end(), p);
  });
}

absl::Status Engine::Session::CheckValues(int layer, int64_t n, const float* qs, const float* ks,
                                          const float* vs) const {
  // What the open round (in the model's dtype) and EndRound's codec will
  // accept: fp16 storage and the quantizing codecs hold fp16 scales and
  // values.
  const bool half = shape.dtype == v1::DTYPE_FP16 || policy.codec.codec != v1::CODEC_RAW ||
                    policy.codec.dtype == v1::DTYPE_FP16;
  const float limit = half ? kHalfMax : std::numeric_limits<float>::max();
  const int d = shape.head_dim;
  auto check = [&](const char* what, const float* x, int heads, float lim) -> absl::Status {
    const int64_t count = n * heads * d;
    for (int64_t i = 0; i < count; ++i) {
      if (!(std::fabs(x[i]) <= lim)) {
        const int64_t token = i / (static_cast<int64_t>(heads) * d);
        const int64_t head = i / d % heads;
        return absl::InvalidArgumentError(absl::StrCat(
            "layer ", layer, ": ", what, "[", token, ", ", head, ", ", i % d, "] is ", x[i],
            lim == kHalfMax ? "; K/V must be finite and within fp16 range (|x| <= 65504) for "
                              "this session's model dtype and codec"
                            : "; values must be finite"));
      }
    }
    return absl::OkStatus();
  };
  KVT_RETURN_IF_ERROR(check("q", qs, shape.q_heads, std::numeric_limits<float>::max()));
  KVT_RETURN_IF_ERROR(check("k", ks, shape.kv_heads, limit));
  return check("v", vs, shape.kv_heads, limit);
}

absl::Status Engine::Session::CheckStep(int layer, int64_t n, bool prefill) const {
  if (layer < 0 || layer >= shape.layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " outside the model's ", shape.layers));
  }
  if (n < 1) return absl::InvalidArgumentError("a step needs at least one token");
  if (state == SessionState::kEnding) {
    return absl::FailedPreconditionError("EndRound of this session is running");
  }
  const bool in_step = state == SessionState::kPrefill || state == SessionState::kDecode;
  if (!prefill && (state == SessionState::kIdle || tokens == 0)) {
    return absl::FailedPreconditionError("decode before the round's first prefill");
  }
  if (layer == 0 && !in_step) return absl::OkStatus();
  if (layer == 0) {
    // A new step while one is in flight: most often a retry whose earlier
    // call ended (a deadline, a cancel) before the worker rolled its step
    // back, which it does as it notices. Worth retrying, so not
    // FAILED_PRECONDITION.
    return absl::UnavailableError(absl::StrCat(
        "a ", StateName(state), " step of this session is in flight (next layer ", next_layer,
        "); a step whose call ended is rolled back as the worker notices: retry shortly"));
  }
  if (layer != next_layer || !in_step) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " out of order: expected layer ", in_step ? next_layer : 0,
                     in_step ? absl::StrCat(" of a ", StateName(state), " step") : ""));
  }
  if ((state == SessionState::kPrefill) != prefill) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " of a ", prefill ? "prefill" : "decode", " step while a ",
                     StateName(state), " step is in flight"));
  }
  if (n != step_n) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " carries ", n, " tokens; this step has ", step_n));
  }
  return absl::OkStatus();
}

void Engine::Session::BeginStep(int64_t n, bool prefill) {
  last_active_ms.store(SteadyNowMs());
  if (prefill && state == SessionState::kIdle) {
    recall = RecallState::kNone;
    selected.clear();
    round_eviction = policy.eviction;
  }
  state = prefill ? SessionState::kPrefill : SessionState::kDecode;
  if (!prefill) ++decode_steps;
  gather.layer = -1;
  step_n = n;
  next_layer = 0;
}

absl::Status MoveToDevice(RoundLayer& rl, int head_dim) {
  if (rl.device != nullptr) return absl::OkStatus();
  std::vector<std::pair<EncodedView, EncodedView>> views;
  for (const HeadKv& hk : rl.heads) views.emplace_back(hk.kview, hk.vview);
  // The tensors let the device layer be read back (a hand-off): the host
  // keeps none of its bytes.
  KVT_ASSIGN_OR_RETURN(rl.device, UploadLayer(views, head_dim, rl.tensors));
  for (HeadKv& hk : rl.heads) {
    hk.kview = {};
    hk.vview = {};
  }
  rl.payload.reset();
  rl.tensors.clear();
  rl.outside.clear();
  return absl::OkStatus();
}

absl::Status Engine::Session::Place(RoundLayer& rl, int layer) {
  if (device == nullptr || rl.device != nullptr) return absl::OkStatus();
  if (layer != lw) return MoveToDevice(rl, shape.head_dim);
  std::vector<std::pair<EncodedView, EncodedView>> views;
  for (const HeadKv& hk : rl.heads) views.emplace_back(hk.kview, hk.vview);
  // Layer L_w keeps its host tensors, so its device copy is never read back.
  KVT_ASSIGN_OR_RETURN(rl.device,
                       UploadLayer(views, shape.head_dim, std::vector<std::string_view>()));
  // Layer L_w stays on the host for recall scoring, in a payload of its own,
  // so the rest of its segment's host bytes can go.
  auto own = std::make_shared<const std::string>(SerializePayload(rl.tensors));
  KVT_ASSIGN_OR_RETURN(auto copy, MakeLayers(own, 1, shape.kv_heads, shape.head_dim));
  rl.heads = std::move(copy[0]->heads);
  rl.tensors = std::move(copy[0]->tensors);
  rl.outside = std::move(copy[0]->outside);
  rl.payload = std::move(own);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<RoundLayer>> Engine::Session::FromDevice(
    const LayerImage::DeviceRound& dr, int layer) {
  if (device != nullptr && layer != lw) {
    auto rl = std::make_unique<RoundLayer>();
    rl->bytes = dr.bytes;
    rl->heads.resize(dr.lens.size());
    for (size_t h = 0; h < dr.lens.size(); ++h) rl->heads[h].len = dr.lens[h];
    rl->device = dr.layer;
    return rl;
  }
  // Read back: a host session, or layer L_w, which recall scores on the
  // host (Place uploads it again with a copy of its own).
  std::vector<std::string> made;
  KVT_RETURN_IF_ERROR(dr.layer->Serialized(&made));
  auto own = std::make_shared<const std::string>(
      SerializePayload(std::vector<std::string_view>(made.begin(), made.end())));
  KVT_ASSIGN_OR_RETURN(auto layers, MakeLayers(own, 1, shape.kv_heads, shape.head_dim));
  return std::move(layers[0]);
}

uint64_t Engine::Session::DeviceBytes() const {
  uint64_t b = 0;
  for (const PastRound& r : past) {
    for (const auto& l : r.layers) {
      if (l != nullptr && l->device != nullptr) b += static_cast<uint64_t>(l->device->bytes());
    }
  }
  if (spec_device != nullptr) b += static_cast<uint64_t>(spec_device->bytes());
  return b;
}

int64_t Engine::Session::WorkingSetBytes() const {
  int64_t b = 0;
  for (const PastRound& r : past) {
    for (const auto& l : r.layers) {
      if (l == nullptr) continue;
      b += l->bytes;
      // Speculation's partial keys, held beside the round's layer.
      for (const std::vector<uint16_t>& pk : l->partial) {
        b += static_cast<int64_t>(pk.size() * sizeof(uint16_t));
      }
    }
  }
  // The open round counts at the model's dtype, as an engine holds it.
  b += TokenBytes(tokens);
  return b;
}

void Engine::Session::NotePeak() {
  stats.device_bytes = DeviceBytes();
  stats.open_round_bytes = 0;
  for (const OpenLayer& o : open) stats.open_round_bytes += o.HeldBytes();
  stats.working_set_bytes = static_cast<uint64_t>(WorkingSetBytes());
  stats.peak_working_set_bytes = std::max(stats.peak_working_set_bytes, stats.working_set_bytes);
}

std::vector<const RoundLayer*> Engine::Session::Visible(int layer) const {
  std::vector<const RoundLayer*> out;
  if (layer <= lw || recall != RecallState::kReady) {
    for (const PastRound& r : past) {
      if (r.layers[layer] != nullptr) out.push_back(r.layers[layer].get());
    }
  } else {
    for (size_t i : selected) out.push_back(past[i].layers[layer].get());
  }
  return out;
}

std::vector<PlacedRound> Engine::Session::VisiblePlaced(int layer) const {
  std::vector<int64_t> start(past.size());
  int64_t at = 0;
  for (size_t i = 0; i < past.size(); ++i) {
    start[i] = at;
    at += past[i].tokens;
  }
  std::vector<size_t> rounds;
  if (layer <= lw || recall != RecallState::kReady) {
    for (size_t i = 0; i < past.size(); ++i) {
      if (past[i].layers[layer] != nullptr) rounds.push_back(i);
    }
  } else {
    rounds = selected;
  }
  std::vector<PlacedRound> out;
  for (size_t i : rounds) out.push_back({past[i].layers[layer].get(), start[i], past[i].tokens});
  return out;
}

int64_t Engine::Session::PastTokens() const {
  int64_t n = 0;
  for (const PastRound& r : past) n += r.tokens;
  return n;
}

std::vector<SegmentStore::Segment> Engine::Session::MarkLeftWindows(int64_t next) {
  std::vector<SegmentStore::Segment> out;
  int64_t start = 0;
  for (PastRound& r : past) {
    start += r.tokens;  // The round's end.
    for (const SegmentSpan& sp : layout) {
      if (!sp.windowed || (r.left >> sp.index & 1) != 0) continue;
      if (!LeftWindow(start, next, sp.window)) continue;
      r.left |= uint64_t{1} << sp.index;
      for (int l = sp.begin; l < sp.end; ++l) r.layers[l].reset();
      out.push_back({r.round, sp.index});
    }
  }
  return out;
}

namespace {

// Grows `x` ([heads][cap][d] elements of `es` bytes, `rows` valid per head)
// to `cap2` rows per head.
template <typename T>
void Regrow(std::vector<T>& x, int heads, int64_t cap, int64_t cap2, int64_t rows, int64_t row) {
  std::vector<T> y(static_cast<size_t>(heads * cap2 * row));
  for (int h = 0; h < heads; ++h) {
    std::copy_n(x.data() + h * cap * row, rows * row, y.data() + h * cap2 * row);
  }
  x.swap(y);
}

// Scatters n token-major fp32 rows [n, heads, d] to rows [at, at + n) of
// each head of `x` ([heads][cap][d] in `dtype`), converting as it goes.
void Scatter(const float* src, int64_t n, int heads, int d, int64_t cap, int64_t at,
             v1::DType dtype, uint8_t* x) {
  for (int64_t i = 0; i < n; ++i) {
    for (int h = 0; h < heads; ++h) {
      const float* from = src + (i * heads + h) * d;
      const int64_t to = (h * cap + at + i) * d;
      switch (dtype) {
        case v1::DTYPE_FP16: {
          auto* y = reinterpret_cast<uint16_t*>(x) + to;
          for (int c = 0; c < d; ++c) y[c] = FloatToHalf(from[c]);
          break;
        }
        case v1::DTYPE_BF16: {
          auto* y = reinterpret_cast<uint16_t*>(x) + to;
          for (int c = 0; c < d; ++c) y[c] = FloatToBf16(from[c]);
          break;
        }
        default:
          std::memcpy(x + to * 4, from, static_cast<size_t>(d) * 4);
      }
    }
  }
}

}  // namespace

uint64_t NewPartialSerial() {
  static std::atomic<uint64_t> serials{0};
  return serials.fetch_add(1) + 1;
}

void OpenRowsTokenMajor(const OpenLayer& o, int kv_heads, int d, v1::DType dtype, int64_t rows,
                        std::vector<float>* k, std::vector<float>* v, int64_t first) {
  const int es = DTypeSize(dtype);
  const size_t n = static_cast<size_t>(rows - first), hkv = static_cast<size_t>(kv_heads);
  k->resize(n * hkv * d);  // Every element is written below.
  v->resize(k->size());
  std::vector<float> head(n * d);
  const size_t skip = static_cast<size_t>(first) * d * es;
  for (size_t h = 0; h < hkv; ++h) {
    for (auto [src, dst] : {std::pair(o.k_head(static_cast<int>(h), d, es), k),
                            std::pair(o.v_head(static_cast<int>(h), d, es), v)}) {
      WidenRows(dtype, src + skip, static_cast<int64_t>(n) * d, head.data());
      for (size_t t = 0; t < n; ++t) {
        std::memcpy(dst->data() + (t * hkv + h) * d, head.data() + t * d, d * sizeof(float));
      }
    }
  }
}

void WidenRows(v1::DType dtype, const uint8_t* src, int64_t count, float* out) {
  switch (dtype) {
    case v1::DTYPE_FP16: {
      const auto* x = reinterpret_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < count; ++i) out[i] = HalfToFloat(x[i]);
      break;
    }
    case v1::DTYPE_BF16: {
      const auto* x = reinterpret_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < count; ++i) out[i] = Bf16ToFloat(x[i]);
      break;
    }
    default:
      std::memcpy(out, src, static_cast<size_t>(count) * 4);
  }
}

void Engine::Session::Append(int layer, int64_t n, const float* qs, const float* ks,
                             const float* vs) {
  OpenLayer& o = open[layer];
  const int d = shape.head_dim;
  const int es = shape.dtype_bytes();
  o.rows = tokens;  // A rolled-back step's rows are overwritten.
  if (o.rows + n > o.cap) {
    const int64_t cap2 = std::max({o.rows + n, 2 * o.cap, int64_t{16}});
    Regrow(o.k, shape.kv_heads, o.cap, cap2, o.rows, int64_t{d} * es);
    Regrow(o.v, shape.kv_heads, o.cap, cap2, o.rows, int64_t{d} * es);
    o.cap = cap2;
  }
  Scatter(ks, n, shape.kv_heads, d, o.cap, o.rows, shape.dtype, o.k.data());
  Scatter(vs, n, shape.kv_heads, d, o.cap, o.rows, shape.dtype, o.v.data());
  // Queries: only those eviction will read at EndRound. Committed rows
  // before the last w go (rows of the step in flight stay until it commits,
  // so that a rolled-back step finds the committed window intact).
  const int64_t need = evict::QueriesRead(round_eviction);
  if (need != 0) {
    int64_t keep_from = need < 0 ? 0 : std::max<int64_t>(o.q_first, tokens - need);
    if (o.rows + n - o.q_first > o.q_cap && keep_from > o.q_first) {
      // Full: drop the rows no longer needed, and shrink a buffer that a
      // long prefill step had grown far past the window.
      const int64_t kept = o.rows - keep_from;
      const int64_t cap2 = std::max({kept + n, 2 * need, int64_t{16}});
      std::vector<float> y(static_cast<size_t>(shape.q_heads * cap2 * d));
      for (int h = 0; h < shape.q_heads; ++h) {
        std::copy_n(o.q.data() + (h * o.q_cap + keep_from - o.q_first) * d, kept * d,
                    y.data() + h * cap2 * d);
      }
      o.q.swap(y);
      o.q_cap = cap2;
      o.q_first = keep_from;
    }
    if (o.rows + n - o.q_first > o.q_cap) {
      const int64_t cap2 = std::max({o.rows + n - o.q_first, 2 * o.q_cap, int64_t{16}});
      Regrow(o.q, shape.q_heads, o.q_cap, cap2, o.rows - o.q_first, int64_t{d});
      o.q_cap = cap2;
    }
    Scatter(qs, n, shape.q_heads, d, o.q_cap, o.rows - o.q_first, v1::DTYPE_FP32,
            reinterpret_cast<uint8_t*>(o.q.data()));
  }
  o.rows += n;
}

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
        blocks.push_back({EncodedView::Raw(v1::DTYPE_FP32, ck.data(), 1, m, d, 0, d),
                          EncodedView::Raw(v1::DTYPE_FP32, cv.data(), 1, m, d, 0, d)});
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
      blocks.push_back({EncodedView::Raw(v1::DTYPE_FP32, gk[h].data(), 1, u, d, 0, d),
                        EncodedView::Raw(v1::DTYPE_FP32, gv[h].data(), 1, u, d, 0, d)});
    }
    blocks.push_back({EncodedView::Raw(sh.dtype, cur.k_head(h, d, es), 1, base + 1, d, 0, d),
                      EncodedView::Raw(sh.dtype, cur.v_head(h, d, es), 1, base + 1, d, 0, d)});
    const int64_t row = static_cast<int64_t>(h) * rep * d;
    KVT_RETURN_IF_ERROR(DecodeAttention({rep, 1, d}, q + row, blocks, out + row, level));
  }
  return absl::OkStatus();
}

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
      DecodeRows(EncodedView::Raw(v1::DTYPE_FP16, rl->partial[h].data(), 1, len, r, 0, r), 0, 0,
                 len, at, level);
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

void Engine::Session::EndLayer(int64_t n) {
  if (++next_layer < shape.layers) return;
  next_layer = 0;
  state = SessionState::kOpen;
  tokens += n;
  stats.tokens += static_cast<uint64_t>(n);
  NotePeak();
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

void Engine::Session::RollBackStep() {
  gather.layer = -1;
  for (OpenLayer& o : open) o.rows = tokens;
  if (state == SessionState::kPrefill && tokens == 0) {
    // The round's first prefill: the round was never open, and its recall
    // (done from this prefill's queries) goes too.
    state = SessionState::kIdle;
    recall = RecallState::kNone;
    selected.clear();
    round_resident.clear();
    fetch.reset();
    fetch_segments.clear();
  } else if (state == SessionState::kPrefill || state == SessionState::kDecode) {
    state = SessionState::kOpen;
  }
  next_layer = 0;
  step_n = 0;
}

void Engine::Session::CloseRound() {
  if (spec_device != nullptr) spec_device->ResetMirror();
  spec_stats.clear();
  decode_steps = 0;
  gather = Gather();
  // The buffers go: an idle session holds no open-round memory.
  for (OpenLayer& o : open) o = OpenLayer();
  tokens = 0;
  state = SessionState::kIdle;
  recall = RecallState::kNone;
  selected.clear();
  fetch.reset();
  fetch_segments.clear();
}

}  // namespace kvtier::worker
