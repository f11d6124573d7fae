#include "worker/transfer.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "worker/engine.h"
#include "worker/session.h"

namespace kvtier::worker {

namespace {

// FAILED_PRECONDITION when `s` cannot be exported now (REQUIRES s.mu).
absl::Status CheckExportable(const SessionKey& id, SessionState state) {
  if (state == SessionState::kEnding) {
    return absl::FailedPreconditionError(
        absl::StrCat("EndRound of session ", id.ToString(), " is running"));
  }
  return absl::OkStatus();
}

// A transferred layer's open round (its rows of K and V in the model's
// dtype, then the queries eviction reads) as the session's open layer;
// INVALID_ARGUMENT when its counts or size do not fit. Takes li.open's bytes.
absl::Status OpenFromImage(const ModelShape& sh, LayerImage& li, OpenLayer* o) {
  const int d = sh.head_dim, es = sh.dtype_bytes();
  if (li.open_rows < 0 || li.q_first < 0 || li.q_rows < 0 || li.q_rows > li.open_rows ||
      (li.q_rows > 0 && li.q_first + li.q_rows != li.open_rows)) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", li.layer, " carries ", li.open_rows,
                                                   " open rows (", li.q_rows, " queries from ",
                                                   li.q_first, ")"));
  }
  const size_t head_bytes = static_cast<size_t>(li.open_rows) * d * es;
  const size_t q_bytes = static_cast<size_t>(li.q_rows) * d * sizeof(float);
  if (li.open.size() != 2 * sh.kv_heads * head_bytes + sh.q_heads * q_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", li.layer, "'s open round holds ", li.open.size(), " bytes; its rows need ",
        2 * sh.kv_heads * head_bytes + sh.q_heads * q_bytes));
  }
  o->cap = o->rows = li.open_rows;
  o->k.assign(li.open.begin(), li.open.begin() + sh.kv_heads * head_bytes);
  o->v.assign(li.open.begin() + sh.kv_heads * head_bytes,
              li.open.begin() + 2 * sh.kv_heads * head_bytes);
  o->q_first = li.q_first;
  o->q_cap = li.q_rows;
  o->q.resize(static_cast<size_t>(sh.q_heads) * li.q_rows * d);
  if (q_bytes > 0) {
    std::memcpy(o->q.data(), li.open.data() + 2 * sh.kv_heads * head_bytes, sh.q_heads * q_bytes);
  }
  li.open = std::string();  // Copied; the past payload stays shared.
  return absl::OkStatus();
}

// Open layer `o` of `layer` into the device's mirror of the open round.
absl::Status LoadOpenMirror(DeviceSession& device, const ModelShape& sh, int layer,
                            const OpenLayer& o) {
  if (o.rows == 0) return absl::OkStatus();
  std::vector<float> k, v;
  OpenRowsTokenMajor(o, sh.kv_heads, sh.head_dim, sh.dtype, o.rows, &k, &v);
  return device.LoadOpen(layer, k.data(), v.data(), o.rows);
}

}  // namespace

absl::Status SessionTransfer::PrepareLayer(PreparedImport& prep, LayerImage& li) const {
  const ModelShape& sh = prep.shape;
  // Out of place: ImportSession refuses it at the tail.
  if (li.layer < 0 || li.layer >= sh.layers || prep.open[li.layer].has_value()) {
    return absl::OkStatus();
  }
  // For a session going on the GPU, the rounds that travelled, checked and
  // split on arrival (CheckPast): to the GPU now. Layer L_w's stay on the
  // host for recall scoring, with a device copy of their own (ImportSession
  // places them).
  if (prep.device != nullptr && li.layer != prep.lw && li.parsed != nullptr) {
    for (std::unique_ptr<RoundLayer>& rl : *li.parsed) {
      if (rl != nullptr) KVT_RETURN_IF_ERROR(MoveToDevice(*rl, sh.head_dim));
    }
  }
  // The open round, as the session's open layer (and on the GPU, its mirror).
  OpenLayer o;
  if (!OpenFromImage(sh, li, &o).ok()) return absl::OkStatus();  // Refused at the tail.
  if (prep.device != nullptr) KVT_RETURN_IF_ERROR(LoadOpenMirror(*prep.device, sh, li.layer, o));
  prep.open[li.layer] = std::move(o);
  return absl::OkStatus();
}

absl::StatusOr<SessionImage> SessionTransfer::ExportSession(const SessionKey& id) const {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, e_.Find(id));
  absl::MutexLock lock(&s->mu);
  KVT_RETURN_IF_ERROR(CheckExportable(id, s->state));
  SessionImage im;
  im.shape = s->shape;
  im.policy = s->policy;
  im.policy.watershed_layer = s->lw;
  im.round_eviction = s->round_eviction;
  im.incarnation = s->incarnation;
  im.on_device = s->device != nullptr;
  for (const Session::PastRound& r : s->past)
    im.past.push_back({r.round, r.tokens, r.stored_bytes});
  return im;
}

absl::StatusOr<LayerImage> SessionTransfer::ExportLayer(const SessionKey& id, int layer,
                                                        bool device_rounds) const {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, e_.Find(id));
  absl::MutexLock lock(&s->mu);
  KVT_RETURN_IF_ERROR(CheckExportable(id, s->state));
  const ModelShape& sh = s->shape;
  if (layer < 0 || layer >= sh.layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " outside the model's ", sh.layers));
  }
  const bool in_step = s->state == SessionState::kPrefill || s->state == SessionState::kDecode;
  if (in_step && layer >= s->next_layer) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " of session ", id.ToString(), " is not done yet"));
  }
  LayerImage im;
  im.layer = layer;
  const int d = sh.head_dim, es = sh.dtype_bytes();
  // The payload SerializePayload would make of these tensors, as pieces:
  // the framing of every tensor in one small buffer, the tensors in place
  // (null owner: views into the round layer's payload, or a copy of their own
  // where it has none).
  struct Tensor {
    std::shared_ptr<const std::string> payload;
    std::string_view bytes;
    std::optional<OutsideCrc> outside;
  };
  std::vector<Tensor> tensors;
  for (const Session::PastRound& r : s->past) {
    const RoundLayer* rl = r.layers[layer].get();
    if (rl == nullptr) continue;
    im.rounds.push_back(r.round);
    if (rl->trimmed) im.trimmed.push_back(r.round);
    im.round_first_piece.push_back(2 * tensors.size());  // Framing and bytes per tensor.
    if (rl->tensors.empty() && rl->device != nullptr) {
      // On the GPU only: lent as it is (the device paths, or ResolveDevice
      // on the sender's thread), or read back below.
      im.device_rounds.push_back({r.round, rl->device, {}, rl->bytes});
    } else {
      const bool known = rl->outside.size() == rl->tensors.size();
      for (size_t i = 0; i < rl->tensors.size(); ++i) {
        tensors.push_back({rl->payload, rl->tensors[i],
                           known ? std::optional<OutsideCrc>(rl->outside[i]) : std::nullopt});
      }
    }
    for (const HeadKv& hk : rl->heads) im.past_raw_bytes += 2 * hk.len * d * es;
  }
  auto framing = std::make_shared<std::string>();
  std::vector<std::pair<size_t, size_t>> heads;  // (offset, size) in `framing`.
  for (const Tensor& t : tensors) {
    const size_t at = framing->size();
    AppendPayloadFraming(t.bytes.size(), framing.get());
    heads.emplace_back(at, framing->size() - at);
  }
  std::shared_ptr<const std::string> frame = framing;
  for (size_t i = 0; i < tensors.size(); ++i) {
    // The framing where the round layer's payload has it, just before the
    // tensor (a round layer's tensors lie there one after the other, each
    // after its framing): then the pieces of a round are contiguous, and a
    // sender sends them as one.
    const std::string_view head(frame->data() + heads[i].first, heads[i].second);
    const std::shared_ptr<const std::string>& payload = tensors[i].payload;
    const std::string_view t = tensors[i].bytes;
    if (payload != nullptr) {
      const auto base = reinterpret_cast<uintptr_t>(payload->data());
      const auto at = reinterpret_cast<uintptr_t>(t.data());
      if (at >= base + head.size() && at + t.size() <= base + payload->size() &&
          std::memcmp(t.data() - head.size(), head.data(), head.size()) == 0) {
        im.past_pieces.push_back(
            {payload, std::string_view(t.data() - head.size(), head.size()), std::nullopt});
        im.past_pieces.push_back({payload, t, tensors[i].outside});
        continue;
      }
    }
    im.past_pieces.push_back({frame, head, std::nullopt});
    std::shared_ptr<const std::string> owner = tensors[i].payload;
    std::string_view bytes = t;
    if (owner == nullptr) {  // Views without a shared buffer: a copy of their own.
      owner = std::make_shared<const std::string>(bytes);
      bytes = *owner;
    }
    im.past_pieces.push_back({std::move(owner), bytes, tensors[i].outside});
  }
  im.round_first_piece.push_back(im.past_pieces.size());
  const OpenLayer& o = s->open[layer];
  im.open_rows = in_step ? o.rows : s->tokens;
  if (!o.q.empty() && im.open_rows > o.q_first) {
    im.q_first = o.q_first;
    im.q_rows = im.open_rows - o.q_first;
  }
  const size_t head_bytes = static_cast<size_t>(im.open_rows) * d * es;
  const size_t q_bytes = static_cast<size_t>(im.q_rows) * d * sizeof(float);
  im.open.resize(2 * sh.kv_heads * head_bytes + sh.q_heads * q_bytes);
  char* p = im.open.data();
  for (int h = 0; h < sh.kv_heads && head_bytes > 0; ++h, p += head_bytes) {
    std::memcpy(p, o.k_head(h, d, es), head_bytes);
  }
  for (int h = 0; h < sh.kv_heads && head_bytes > 0; ++h, p += head_bytes) {
    std::memcpy(p, o.v_head(h, d, es), head_bytes);
  }
  for (int h = 0; h < sh.q_heads && q_bytes > 0; ++h, p += q_bytes) {
    std::memcpy(p, o.q.data() + h * o.q_cap * d, q_bytes);
  }
  // Read back and made again, byte for byte, where the caller did not ask
  // for the layers as they are.
  if (!device_rounds) KVT_RETURN_IF_ERROR(im.ResolveDevice());
  return im;
}

uint64_t LayerImage::past_size() const {
  if (past != nullptr) return past->size();
  uint64_t n = 0;
  for (const Piece& p : past_pieces) n += p.bytes.size();
  return n;
}

uint64_t LayerImage::LeaveOut(const std::vector<HandoffCache::Held>& held) {
  if (held.empty() || round_first_piece.size() != rounds.size() + 1) return 0;
  std::vector<Piece> kept;
  std::vector<size_t> first;
  uint64_t left_out = 0;
  for (size_t j = 0; j < rounds.size(); ++j) {
    auto h = std::find_if(held.begin(), held.end(),
                          [&](const HandoffCache::Held& x) { return x.round == rounds[j]; });
    const bool leave =
        h != held.end() &&
        std::binary_search(h->layers.begin(), h->layers.end(), static_cast<uint32_t>(layer)) &&
        std::find(trimmed.begin(), trimmed.end(), rounds[j]) == trimmed.end();
    if (leave) {
      reused.push_back(rounds[j]);
      auto d = std::find_if(device_rounds.begin(), device_rounds.end(),
                            [&](const DeviceRound& x) { return x.round == rounds[j]; });
      if (d != device_rounds.end()) {
        left_out += static_cast<uint64_t>(d->bytes);
        device_rounds.erase(d);
      }
    }
    first.push_back(kept.size());
    for (size_t i = round_first_piece[j]; i < round_first_piece[j + 1]; ++i) {
      if (leave) {
        // A round's pieces alternate framing and tensor (ExportLayer); the
        // tensors' bytes are what the receiver's RoundLayer::bytes counts.
        if ((i - round_first_piece[j]) % 2 == 1) left_out += past_pieces[i].bytes.size();
      } else {
        kept.push_back(std::move(past_pieces[i]));
      }
    }
  }
  first.push_back(kept.size());
  past_pieces = std::move(kept);
  round_first_piece = std::move(first);
  return left_out;
}

absl::Status LayerImage::ResolveDevice() {
  for (const DeviceRound& d : device_rounds) {
    const size_t j =
        static_cast<size_t>(std::find(rounds.begin(), rounds.end(), d.round) - rounds.begin());
    if (j >= rounds.size() || round_first_piece.size() != rounds.size() + 1) {
      return absl::InternalError(absl::StrCat("device round ", d.round, " is not in the export"));
    }
    std::vector<std::string> made;
    KVT_RETURN_IF_ERROR(d.layer->Serialized(&made));
    // Framing and bytes per tensor, as ExportLayer lays out a host round.
    auto framing = std::make_shared<std::string>();
    std::vector<size_t> at;
    for (const std::string& t : made) {
      at.push_back(framing->size());
      AppendPayloadFraming(t.size(), framing.get());
    }
    at.push_back(framing->size());
    std::vector<Piece> pieces;
    for (size_t i = 0; i < made.size(); ++i) {
      pieces.push_back(
          {framing, std::string_view(framing->data() + at[i], at[i + 1] - at[i]), std::nullopt});
      auto own = std::make_shared<const std::string>(std::move(made[i]));
      const std::string_view view = *own;
      pieces.push_back({std::move(own), view, std::nullopt});
    }
    past_pieces.insert(past_pieces.begin() + static_cast<ptrdiff_t>(round_first_piece[j]),
                       pieces.begin(), pieces.end());
    for (size_t k = j + 1; k < round_first_piece.size(); ++k) {
      round_first_piece[k] += pieces.size();
    }
  }
  device_rounds.clear();
  return absl::OkStatus();
}

absl::Status LayerImage::CheckPast(int kv_heads, int head_dim, uint32_t* outside_crc) {
  if (past == nullptr) return absl::InternalError("CheckPast before the past bytes arrived");
  KVT_ASSIGN_OR_RETURN(auto made, MakeLayers(past, travelled_rounds(), kv_heads, head_dim,
                                             /*verify_crc=*/true, outside_crc));
  parsed = std::make_shared<std::vector<std::unique_ptr<RoundLayer>>>(std::move(made));
  return absl::OkStatus();
}

std::string LayerImage::PastBytes() const {
  if (past != nullptr) return *past;
  std::string out;
  out.reserve(past_size());
  for (const Piece& p : past_pieces) out.append(p.bytes);
  return out;
}

absl::Status SessionTransfer::ExportTail(const SessionKey& id, SessionImage* im) const {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, e_.Find(id));
  absl::MutexLock lock(&s->mu);
  KVT_RETURN_IF_ERROR(CheckExportable(id, s->state));
  if (s->state == SessionState::kPrefill || s->state == SessionState::kDecode ||
      s->recall == RecallState::kFetching) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", id.ToString(), " is in the middle of a step (", StateName(s->state), ")"));
  }
  im->open_tokens = s->tokens;
  im->recall_ready = s->recall == RecallState::kReady;
  im->selected.clear();
  for (size_t i : s->selected) im->selected.push_back(s->past[i].round);
  im->upper_gone.clear();
  for (const Session::PastRound& r : s->past) {
    if (r.upper_gone) im->upper_gone.push_back(r.round);
  }
  im->round_resident = s->round_resident;
  im->unreported_recalls = s->unreported_recalls;
  im->rounds = s->stats.rounds;
  im->tokens = s->stats.tokens;
  im->peak_working_set_bytes = s->stats.peak_working_set_bytes;
  im->full_cache_bytes = s->stats.full_cache_bytes;
  return absl::OkStatus();
}

absl::Status SessionTransfer::CheckImport(const SessionKey& id, uint64_t bytes) const {
  const EngineOptions::TenantLimit* limit = nullptr;
  int64_t tenant_bytes = 0;
  {
    absl::MutexLock lock(&e_.mu_);
    KVT_RETURN_IF_ERROR(e_.CheckRoomLocked(id));
    auto use = e_.tenants_.find(id.tenant);
    if (use != e_.tenants_.end()) tenant_bytes = use->second.bytes.load();
  }
  limit = e_.LimitFor(id.tenant);
  absl::Status st = e_.CheckBudgetFor(id.tenant, limit, tenant_bytes, bytes);
  if (!st.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot take session ", id.ToString(), ": ", st.message()));
  }
  return absl::OkStatus();
}

absl::Status SessionTransfer::ImportSession(const SessionKey& id, const SessionImage& im,
                                            std::vector<LayerImage> layers, uint64_t* reused_out) {
  return ImportSession(id, im, std::move(layers), reused_out, nullptr);
}

absl::Status SessionTransfer::ImportSession(const SessionKey& id, const SessionImage& im,
                                            std::vector<LayerImage> layers, uint64_t* reused_out,
                                            std::unique_ptr<PreparedImport> prepared) {
  if (prepared != nullptr && prepared->shape != im.shape) {
    return absl::InternalError("the transfer's import was prepared for another model shape");
  }
  // Whether the prepared layers went to the GPU (their rounds and open
  // rounds are there already).
  const bool prepared_device = prepared != nullptr && prepared->device != nullptr;
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s,
                       e_.CreateSession(id, im.shape, im.policy, /*allow_device=*/true,
                                        prepared_device ? std::move(prepared->device) : nullptr));
  const ModelShape& sh = s->shape;
  const int d = sh.head_dim, lw = s->lw;
  if (prepared_device) {
    absl::MutexLock lock(&s->mu);
    if (s->device == nullptr || lw != prepared->lw) {
      // Its layers' rounds left the host for the GPU: they cannot go back.
      return absl::InternalError("the transfer's device side was prepared for another placement");
    }
  }
  {
    SessionPolicy round = im.policy;
    round.eviction = im.round_eviction;
    KVT_RETURN_IF_ERROR(ValidateRoundPolicy(sh, round));
  }
  if (static_cast<int>(layers.size()) != sh.layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("the transfer holds ", layers.size(), " layers; the model has ", sh.layers));
  }
  std::map<uint32_t, size_t> index;  // Round number -> position in `past`.
  uint64_t bytes = 0, reused_bytes = 0;
  int64_t working_set = 0;
  // What this worker kept of the session when it last handed it off: the
  // layers reuse from it; the rest is dropped (the session lives here now).
  std::optional<KeptRounds> kept = e_.handoff_->Take(id, im.incarnation);
  {
    absl::MutexLock lock(&s->mu);
    s->incarnation = im.incarnation != 0 ? im.incarnation : s->incarnation;
    s->round_eviction = im.round_eviction;
    for (const SessionImage::Round& r : im.past) {
      if (!s->past.empty() && r.round <= s->past.back().round) {
        return absl::InvalidArgumentError("the transfer's past rounds are not in order");
      }
      index[r.round] = s->past.size();
      Session::PastRound pr;
      pr.round = r.round;
      pr.tokens = r.tokens;
      pr.stored_bytes = r.stored_bytes;
      pr.layers.resize(sh.layers);
      s->past.push_back(std::move(pr));
    }
    // The sliding segments the rounds have left (the sender released and
    // dropped them; a drop it could not confirm is sent again at the next
    // EndRound here): no layer carries them, and recall never fetches them.
    s->pending_drops = s->MarkLeftWindows(s->PastTokens());
    for (int l = 0; l < sh.layers; ++l) {
      LayerImage& li = layers[l];
      bytes += li.bytes();
      if (li.layer != l) {
        return absl::InvalidArgumentError(
            absl::StrCat("transfer layer ", li.layer, " arrived where layer ", l, " belongs"));
      }
      // Up to L_w every past round is resident, except at a sliding layer
      // the rounds that have left its window (and with it the sender).
      if (l <= lw) {
        size_t resident = 0;
        for (size_t i = 0; i < s->past.size(); ++i) resident += s->LeftAt(i, l) ? 0 : 1;
        if (li.rounds.size() != resident) {
          return absl::InvalidArgumentError(absl::StrCat(
              "layer ", l, " carries ", li.rounds.size(), " past rounds; every one of ", "the ",
              resident, " inside its window must be resident"));
        }
      }
      for (uint32_t r : li.rounds) {
        auto it = index.find(r);
        if (it != index.end() && s->LeftAt(it->second, l)) {
          return absl::InvalidArgumentError(absl::StrCat("layer ", l, " carries round ", r,
                                                         ", which has left the layer's window"));
        }
      }
      for (uint32_t r : li.reused) {
        if (std::count(li.reused.begin(), li.reused.end(), r) != 1 ||
            std::find(li.rounds.begin(), li.rounds.end(), r) == li.rounds.end()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "layer ", l, " reuses round ", r, " twice or without carrying it as resident"));
        }
      }
      for (const LayerImage::DeviceRound& dr : li.device_rounds) {
        if (std::count_if(li.device_rounds.begin(), li.device_rounds.end(),
                          [&](const LayerImage::DeviceRound& x) { return x.round == dr.round; }) !=
                1 ||
            std::find(li.rounds.begin(), li.rounds.end(), dr.round) == li.rounds.end() ||
            std::find(li.reused.begin(), li.reused.end(), dr.round) != li.reused.end() ||
            dr.layer == nullptr || dr.lens.size() != static_cast<size_t>(sh.kv_heads)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "layer ", l, " carries device round ", dr.round,
              " twice, reused, without carrying it as resident, or not of this model"));
        }
      }
      // Pieces (an export handed over in process): one buffer of them.
      if (li.past == nullptr) {
        KVT_RETURN_IF_ERROR(li.ResolveDevice());  // In process: as gRPC would carry them.
        li.past = std::make_shared<const std::string>(li.PastBytes());
      }
      std::vector<std::unique_ptr<RoundLayer>> made;
      if (li.parsed != nullptr) {
        made = std::move(*li.parsed);  // Checked and split on arrival (CheckPast).
      } else {
        KVT_ASSIGN_OR_RETURN(made, MakeLayers(li.past, li.travelled_rounds(), sh.kv_heads, d));
      }
      size_t prev = 0, next = 0;
      for (size_t j = 0; j < li.rounds.size(); ++j) {
        auto it = index.find(li.rounds[j]);
        if (it == index.end() || (j > 0 && it->second <= prev)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "layer ", l, " carries round ", li.rounds[j], " out of order or not in the session"));
        }
        prev = it->second;
        std::unique_ptr<RoundLayer>& slot = s->past[it->second].layers[l];
        auto dr =
            std::find_if(li.device_rounds.begin(), li.device_rounds.end(),
                         [&](const LayerImage::DeviceRound& x) { return x.round == li.rounds[j]; });
        if (dr != li.device_rounds.end()) {
          KVT_ASSIGN_OR_RETURN(slot, s->FromDevice(*dr, l));
          continue;
        }
        if (std::find(li.reused.begin(), li.reused.end(), li.rounds[j]) == li.reused.end()) {
          slot = std::move(made[next++]);
          continue;
        }
        std::unique_ptr<RoundLayer>* held = nullptr;
        if (kept.has_value()) {
          auto k = kept->rounds.find(li.rounds[j]);
          if (k != kept->rounds.end() && static_cast<size_t>(l) < k->second.size()) {
            held = &k->second[l];
          }
        }
        if (held == nullptr || *held == nullptr) {
          return absl::FailedPreconditionError(absl::StrCat(
              "layer ", l, " reuses round ", li.rounds[j], " of session ", id.ToString(),
              ", which this worker no longer holds (its hand-off cache dropped it); send the "
              "step again, in full"));
        }
        reused_bytes += static_cast<uint64_t>((*held)->bytes);
        slot = std::move(*held);
        if (s->device == nullptr && slot->tensors.empty() && slot->device != nullptr) {
          // Kept from a device session; this one lives in host memory.
          LayerImage::DeviceRound dr{li.rounds[j], slot->device, {}, slot->bytes};
          for (const HeadKv& hk : slot->heads) dr.lens.push_back(hk.len);
          KVT_ASSIGN_OR_RETURN(slot, s->FromDevice(dr, l));
        }
      }
      // On a device session the layer moves to the GPU, as a fetched one
      // does.
      for (Session::PastRound& pr : s->past) {
        if (pr.layers[l] != nullptr) KVT_RETURN_IF_ERROR(s->Place(*pr.layers[l], l));
      }
      // The open round: taken (and on the GPU, loaded into the device's
      // mirror) as the layer arrived (PrepareLayer), or here.
      if (li.open_rows != im.open_tokens) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layer ", l, " carries ", li.open_rows, " open rows; the round has ", im.open_tokens));
      }
      OpenLayer& o = s->open[l];
      const bool taken = prepared != nullptr && prepared->open[l].has_value();
      if (taken) {
        o = *std::move(prepared->open[l]);
      } else {
        KVT_RETURN_IF_ERROR(OpenFromImage(sh, li, &o));
      }
      if (s->device != nullptr && !(taken && prepared_device)) {
        KVT_RETURN_IF_ERROR(LoadOpenMirror(*s->device, sh, l, o));
      }
    }
    s->tokens = im.open_tokens;
    s->state = im.open_tokens > 0 ? SessionState::kOpen : SessionState::kIdle;
    s->recall = im.recall_ready ? RecallState::kReady : RecallState::kNone;
    for (uint32_t r : im.selected) {
      auto it = index.find(r);
      if (it == index.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("selected round ", r, " is not in the transfer"));
      }
      for (int l = lw + 1; l < sh.layers; ++l) {
        if (s->past[it->second].layers[l] == nullptr && !s->LeftAt(it->second, l)) {
          return absl::InvalidArgumentError(absl::StrCat("selected round ", r, " lacks layer ", l));
        }
      }
      s->selected.push_back(it->second);
    }
    for (uint32_t r : im.upper_gone) {
      auto it = index.find(r);
      if (it != index.end()) s->past[it->second].upper_gone = true;
    }
    s->round_resident = im.round_resident;
    s->unreported_recalls = im.unreported_recalls;
    s->stats.rounds = im.rounds;
    s->stats.tokens = im.tokens;
    s->stats.peak_working_set_bytes = im.peak_working_set_bytes;
    s->stats.full_cache_bytes = im.full_cache_bytes;
    s->stats.pending_recall_counts = im.unreported_recalls.size();
    s->NotePeak();
    working_set = s->WorkingSetBytes();
  }
  KVT_RETURN_IF_ERROR(CheckImport(id, static_cast<uint64_t>(working_set)));
  KVT_RETURN_IF_ERROR(e_.Insert(id, s));
  if (reused_out != nullptr) *reused_out = reused_bytes;
  absl::MutexLock lock(&s->mu);
  e_.Account(*s);
  LogDebug("session imported", {{"session", id.ToString()},
                                {"past_rounds", s->past.size()},
                                {"open_tokens", s->tokens},
                                {"bytes", bytes},
                                {"reused_bytes", reused_bytes}});
  return absl::OkStatus();
}

absl::StatusOr<std::string> SessionTransfer::AcceptsDeviceRounds(const DeviceIdentity& peer) const {
  if (!e_.options_.device_transfer) {
    return absl::FailedPreconditionError("this worker runs with --device_transfer=grpc");
  }
  if (e_.options_.placement == EngineOptions::Placement::kHost) {
    return absl::FailedPreconditionError(
        "this worker keeps sessions in host memory (--placement=host)");
  }
  KVT_ASSIGN_OR_RETURN(DeviceIdentity local, LocalDeviceIdentity());
  KVT_ASSIGN_OR_RETURN(std::string path, ChooseDevicePath(local, peer));
  KVT_RETURN_IF_ERROR(e_.device_failures_.Check(peer, path));
  if (path == "cuda_ipc") KVT_RETURN_IF_ERROR(ProbeIpcPeer(peer));
  return path;
}

absl::StatusOr<DeviceIdentity> SessionTransfer::OffersDeviceRounds() const {
  if (!e_.options_.device_transfer) {
    return absl::FailedPreconditionError("the sending worker runs with --device_transfer=grpc");
  }
  return LocalDeviceIdentity();
}

absl::Status SessionTransfer::ForgetSession(const SessionKey& id, bool keep_rounds) {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, e_.Remove(id));
  if (!keep_rounds) return absl::OkStatus();
  KeptRounds kept;
  {
    absl::MutexLock lock(&s->mu);
    kept.incarnation = s->incarnation;
    for (Session::PastRound& r : s->past) {
      for (const std::unique_ptr<RoundLayer>& rl : r.layers) {
        if (rl != nullptr) kept.bytes += static_cast<uint64_t>(rl->bytes);
      }
      kept.rounds.emplace(r.round, std::move(r.layers));
    }
  }
  e_.handoff_->Keep(id, std::move(kept));
  return absl::OkStatus();
}

std::vector<HandoffCache::Held> SessionTransfer::HeldRounds(const SessionKey& id,
                                                            uint64_t incarnation,
                                                            absl::Time lease_until) {
  return e_.handoff_->Lookup(id, incarnation, lease_until);
}

absl::Status SessionTransfer::RevertPrefill(const SessionKey& id, int64_t n) {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, e_.Find(id));
  absl::MutexLock lock(&s->mu);
  if (s->state != SessionState::kOpen || s->tokens < n || n < 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", id.ToString(), " has no completed step of ", n,
                     " tokens to undo (", StateName(s->state), ", ", s->tokens, " tokens)"));
  }
  // Back into the step, then the usual rollback.
  s->tokens -= n;
  s->stats.tokens -= static_cast<uint64_t>(n);
  s->state = SessionState::kPrefill;
  s->step_n = n;
  s->RollBackStep();
  s->NotePeak();
  e_.Account(*s);
  return absl::OkStatus();
}

std::unique_ptr<PreparedImport> SessionTransfer::BeginImport(const ModelShape& shape,
                                                             const SessionPolicy& policy) const {
  // A shape or policy CreateSession would refuse is left to it. No model has
  // thousands of layers: a header that says so gets nothing made for it
  // before its bytes are counted.
  constexpr int kMaxPreparedLayers = 4096;
  if (!CheckShape(shape).ok() || shape.layers > kMaxPreparedLayers) return nullptr;
  absl::StatusOr<int> lw = WatershedLayer(shape, policy);
  if (!lw.ok()) return nullptr;
  auto prep = std::make_unique<PreparedImport>();
  prep->shape = shape;
  prep->lw = *lw;
  prep->open.resize(static_cast<size_t>(shape.layers));
  // The device working set, as CreateSession decides for an imported
  // session; without one (or when it cannot be made: ImportSession tries
  // again and says why) only the open rounds are prepared.
  if (e_.TriesDevice(policy) && e_.DeviceReads(policy).ok()) {
    auto dev = NewDeviceSession(shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim);
    if (dev.ok()) prep->device = *std::move(dev);
  }
  return prep;
}

std::unique_ptr<Engine::IncomingHold> SessionTransfer::HoldIncoming(const std::string& tenant) {
  absl::MutexLock lock(&e_.mu_);
  return std::unique_ptr<Engine::IncomingHold>(
      new Engine::IncomingHold(&e_, tenant, &e_.UseOf(tenant)));
}

void SessionTransfer::DeviceRoundsFailed(const DeviceIdentity& peer, const std::string& path,
                                         const absl::Status& why) {
  e_.device_failures_.Record(peer, path, why);
}

LinkPool& SessionTransfer::device_links() { return e_.device_links_; }

uint64_t SessionTransfer::ipc_pack_bytes() const { return e_.options_.ipc_pack_bytes; }

HandoffCache::Totals SessionTransfer::HandoffTotals() const { return e_.handoff_->totals(); }

}  // namespace kvtier::worker
