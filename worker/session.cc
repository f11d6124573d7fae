#include "worker/session.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "encoded/encode.h"
#include "encoded/encoded_tensor.h"
#include "google/protobuf/io/coded_stream.h"
#include "kernels/attention.h"
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

absl::Status Engine::Session::CheckValues(int layer, int64_t n, const Rows& qs, const Rows& ks,
                                          const Rows& vs) const {
  // What the open round (in the model's dtype) and EndRound's codec will
  // accept: fp16 storage and the quantizing codecs hold fp16 scales and
  // values.
  const bool half = shape.dtype == DType::kFp16 || policy.codec.codec != Codec::kRaw ||
                    policy.codec.dtype == DType::kFp16;
  const float limit = half ? kHalfMax : std::numeric_limits<float>::max();
  const int d = shape.head_dim;
  auto check = [&](const char* what, const Rows& r, int heads, float lim) -> absl::Status {
    if (r.dtype != DType::kFp32 && r.dtype != DType::kFp16 && r.dtype != DType::kBf16) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", layer, ": ", what, " must be fp32, fp16 or bf16"));
    }
    const int64_t count = n * heads * d;
    auto bad = [&](int64_t i) -> absl::Status {
      const int64_t token = i / (static_cast<int64_t>(heads) * d);
      const int64_t head = i / d % heads;
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", layer, ": ", what, "[", token, ", ", head, ", ", i % d, "] is ", RowValue(r, i),
          lim == kHalfMax ? "; K/V must be finite and within fp16 range (|x| <= 65504) for "
                            "this session's model dtype and codec"
                          : "; values must be finite"));
    };
    if (r.dtype == DType::kFp32) {
      const auto* x = static_cast<const float*>(r.data);
      for (int64_t i = 0; i < count; ++i) {
        if (!(std::fabs(x[i]) <= lim)) return bad(i);
      }
    } else if (r.dtype == DType::kFp16) {
      // Every finite fp16 value is within fp16 range.
      const auto* x = static_cast<const uint8_t*>(r.data);
      for (int64_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, x + 2 * i, 2);
        if ((h & 0x7c00) == 0x7c00) return bad(i);
      }
    } else {
      for (int64_t i = 0; i < count; ++i) {
        if (!(std::fabs(RowValue(r, i)) <= lim)) return bad(i);
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
  last_active_ms.store(clock->NowUnixMs());
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

// Scatters n token-major rows [n, heads, d] to rows [at, at + n) of each
// head of `x` ([heads][cap][d] in `dtype`): copied when they are in `dtype`
// already, converted otherwise. Returns the values converted.
int64_t Scatter(const Rows& src, int64_t n, int heads, int d, int64_t cap, int64_t at, DType dtype,
                uint8_t* x) {
  if (src.dtype == dtype) {
    const int es = DTypeSize(dtype);
    const auto* from = static_cast<const uint8_t*>(src.data);
    for (int64_t i = 0; i < n; ++i) {
      for (int h = 0; h < heads; ++h) {
        std::memcpy(x + (h * cap + at + i) * d * es, from + (i * heads + h) * d * es,
                    static_cast<size_t>(d) * es);
      }
    }
    return 0;
  }
  std::vector<float> widened;
  const float* wide = Fp32Rows(src, n * heads * d, &widened);
  for (int64_t i = 0; i < n; ++i) {
    for (int h = 0; h < heads; ++h) {
      const float* from = wide + (i * heads + h) * d;
      const int64_t to = (h * cap + at + i) * d;
      switch (dtype) {
        case DType::kFp16: {
          auto* y = reinterpret_cast<uint16_t*>(x) + to;
          for (int c = 0; c < d; ++c) y[c] = FloatToHalf(from[c]);
          break;
        }
        case DType::kBf16: {
          auto* y = reinterpret_cast<uint16_t*>(x) + to;
          for (int c = 0; c < d; ++c) y[c] = FloatToBf16(from[c]);
          break;
        }
        default:
          std::memcpy(x + to * 4, from, static_cast<size_t>(d) * 4);
      }
    }
  }
  // A 16-bit input into another 16-bit type is widened, then narrowed.
  return n * heads * d * (src.dtype == DType::kFp32 || dtype == DType::kFp32 ? 1 : 2);
}

}  // namespace

uint64_t NewPartialSerial() {
  static std::atomic<uint64_t> serials{0};
  return serials.fetch_add(1) + 1;
}

void OpenRowsTokenMajor(const OpenLayer& o, int kv_heads, int d, DType dtype, int64_t rows,
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

void WidenRows(DType dtype, const uint8_t* src, int64_t count, float* out) {
  switch (dtype) {
    case DType::kFp16: {
      const auto* x = reinterpret_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < count; ++i) out[i] = HalfToFloat(x[i]);
      break;
    }
    case DType::kBf16: {
      const auto* x = reinterpret_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < count; ++i) out[i] = Bf16ToFloat(x[i]);
      break;
    }
    default:
      std::memcpy(out, src, static_cast<size_t>(count) * 4);
  }
}

void Engine::Session::Append(int layer, int64_t n, const float* qs, const Rows& ks,
                             const Rows& vs) {
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
  stats.converted_kv_values += static_cast<uint64_t>(
      Scatter(ks, n, shape.kv_heads, d, o.cap, o.rows, shape.dtype, o.k.data()) +
      Scatter(vs, n, shape.kv_heads, d, o.cap, o.rows, shape.dtype, o.v.data()));
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
    Scatter(qs, n, shape.q_heads, d, o.q_cap, o.rows - o.q_first, DType::kFp32,
            reinterpret_cast<uint8_t*>(o.q.data()));
  }
  o.rows += n;
}

void Engine::Session::EndLayer(int64_t n) {
  if (++next_layer < shape.layers) return;
  next_layer = 0;
  state = SessionState::kOpen;
  tokens += n;
  stats.tokens += static_cast<uint64_t>(n);
  NotePeak();
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
