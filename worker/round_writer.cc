// EndRound: eviction and encoding of the open round under the session lock
// (the plan), PutSegments of its segments without it (the send), and the
// round's move into the working set under the lock again (the commit).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "encoded/encode.h"
#include "worker/session.h"

namespace kvtier::worker {

// What EndRound sends and then commits.
struct RoundPlan {
  uint32_t round = 0;
  int64_t tokens = 0;
  // Serialized SegmentPayloads, one per segment of the session's layout,
  // sent as they are.
  std::vector<std::shared_ptr<const std::string>> segments;
  std::vector<std::unique_ptr<RoundLayer>> layers;  // The round's working-set form.
  uint64_t round_working_set = 0;
  std::vector<uint32_t> recalls;  // Resident recalls to report, older ones first.
  // Sliding segments of past rounds that have left their windows, to drop.
  std::vector<SegmentStore::Segment> drops;
};

absl::StatusOr<EndRoundReport> Engine::EndRound(const SessionKey& id, const CallOptions& call) {
  KVT_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Find(id));
  const ModelShape& sh = s->shape;
  const int lw = s->lw;
  RoundPlan plan;
  {
    // Plan: eviction per layer, then encoding of each KV head's kept tokens.
    absl::MutexLock lock(&s->mu);
    switch (s->state) {
      case SessionState::kOpen:
        break;
      case SessionState::kIdle:
        return absl::FailedPreconditionError("EndRound without an open round");
      case SessionState::kEnding:
        // A concurrent attempt (often a retry whose first try is still
        // finishing after its caller gave up): retryable.
        return absl::AbortedError("EndRound of this session is already running");
      case SessionState::kPrefill:
      case SessionState::kDecode:
        return absl::FailedPreconditionError(absl::StrCat("EndRound in the middle of a ",
                                                          StateName(s->state), " step (next layer ",
                                                          s->next_layer, ")"));
    }
    const int d = sh.head_dim;
    const int64_t t = s->tokens;
    plan.round = s->stats.rounds;
    plan.tokens = t;
    plan.round_working_set = static_cast<uint64_t>(s->WorkingSetBytes());
    // Eviction per layer first, so that every tensor's size is known; then
    // each segment is laid out once and every tensor is encoded straight into
    // its place in it (TensorEncoder): the buffer that goes to the store as
    // is, and that the round's working-set form views.
    // The round's own eviction (the policy's when it opened), whose queries
    // the open round kept.
    const evict::Policy* eviction = &s->round_eviction;
    const bool evicting = eviction->method != evict::Method::kNone;
    const int es = sh.dtype_bytes();
    std::vector<std::vector<std::vector<int64_t>>> keep(sh.layers);
    if (evicting) {
      std::vector<float> keys;
      for (int l = 0; l < sh.layers; ++l) {
        // A sliding layer keeps its window whole: its positions stay those
        // of the round, and the round leaves it whole once out of the
        // window (as kvpress treats Gemma 3's sliding layers).
        if (sh.layer_window(l) > 0) continue;
        // The open round is head-major already; scoring reads fp32 keys, so
        // a 16-bit layer's are widened (one layer at a time).
        const OpenLayer& o = s->open[l];
        const float* k = reinterpret_cast<const float*>(o.k.data());
        int64_t k_stride = o.cap * d;
        if (sh.dtype != DType::kFp32) {
          keys.resize(static_cast<size_t>(sh.kv_heads) * t * d);
          for (int h = 0; h < sh.kv_heads; ++h) {
            WidenRows(sh.dtype, o.k_head(h, d, es), t * d, keys.data() + h * t * d);
          }
          k = keys.data();
          k_stride = t * d;
        }
        evict::LayerQK x{sh.q_heads, sh.kv_heads, d, t, o.q.data(), k};
        x.head_stride = k_stride;
        x.q_first = o.q_first;
        x.q_head_stride = o.q_cap * d;
        KVT_ASSIGN_OR_RETURN(keep[l], evict::SelectTokens(*eviction, l, sh.layers, x));
      }
    }
    // Rows of head h of layer l that the round keeps; all t when eviction
    // keeps them all (attention does not depend on key order).
    auto kept = [&](int l, int h) -> const std::vector<int64_t>* {
      if (!evicting || keep[l].empty() || static_cast<int64_t>(keep[l][h].size()) == t) {
        return nullptr;
      }
      return &keep[l][h];
    };
    std::vector<uint8_t> gathered;
    std::vector<float> widened;
    // The lambdas below run under this lock; they see the session's state
    // through these.
    const std::vector<OpenLayer>* open = &s->open;
    const CodecConfig& codec = s->policy.codec;
    auto segment = [&](int l0, int l1) -> absl::StatusOr<std::string> {
      std::vector<TensorEncoder> encs;
      std::vector<size_t> sizes;
      for (int l = l0; l < l1; ++l) {
        for (int h = 0; h < sh.kv_heads; ++h) {
          const std::vector<int64_t>* rows = kept(l, h);
          const int64_t shape[3] = {1, rows != nullptr ? static_cast<int64_t>(rows->size()) : t, d};
          for (TensorRole role : {TensorRole::kKey, TensorRole::kValue}) {
            // Self-locating, as the format wants (the store checks it).
            KVT_ASSIGN_OR_RETURN(TensorEncoder e,
                                 TensorEncoder::Make(codec, role, shape, static_cast<uint32_t>(l)));
            sizes.push_back(e.SerializedSize());
            encs.push_back(std::move(e));
          }
        }
      }
      absl::Status encoded;
      std::string out = SerializePayload(sizes, [&](size_t i, uint8_t* p) {
        const int l = l0 + static_cast<int>(i / (2 * sh.kv_heads));
        const int h = static_cast<int>(i / 2 % sh.kv_heads);
        const bool value = i % 2 == 1;
        const OpenLayer& o = (*open)[l];
        const uint8_t* src = value ? o.v_head(h, d, es) : o.k_head(h, d, es);
        if (const std::vector<int64_t>* rows = kept(l, h); rows != nullptr) {
          // Eviction dropped rows of this head: its kept rows are gathered
          // into a scratch of one head's size first.
          const size_t row = static_cast<size_t>(d) * es;
          gathered.resize(rows->size() * row);
          for (size_t j = 0; j < rows->size(); ++j) {
            std::copy_n(src + (*rows)[j] * row, row, &gathered[j * row]);
          }
          src = gathered.data();
        }
        // A 16-bit open round is widened a head at a time into `widened`
        // unless the codec stores it as it is (raw in the model's dtype).
        absl::StatusOr<uint8_t*> end = encs[i].EncodeTo(src, sh.dtype, p, &widened, options_.level);
        if (!end.ok()) {
          if (encoded.ok()) encoded = end.status();
          return p + sizes[i];
        }
        return *end;
      });
      KVT_RETURN_IF_ERROR(encoded);
      return out;
    };
    // Built (and on a GPU uploaded) before the puts, so that a failure of
    // either leaves the round open.
    for (const SegmentSpan& sp : s->layout) {
      KVT_ASSIGN_OR_RETURN(std::string bytes, segment(sp.begin, sp.end));
      auto payload = std::make_shared<const std::string>(std::move(bytes));
      KVT_ASSIGN_OR_RETURN(auto layers, MakeLayers(payload, sp.layers(), sh.kv_heads, d));
      for (auto& rl : layers) plan.layers.push_back(std::move(rl));
      plan.segments.push_back(std::move(payload));
    }
    for (int l = 0; l < sh.layers; ++l) KVT_RETURN_IF_ERROR(s->Place(*plan.layers[l], l));
    // Rounds that no later query sees at a sliding segment's layers leave
    // the working set there now (every later position is further on, so
    // this holds even if the puts fail), and the store after the puts.
    plan.drops = std::move(s->pending_drops);
    s->pending_drops.clear();
    for (const SegmentStore::Segment& x : s->MarkLeftWindows(s->PastTokens() + t)) {
      plan.drops.push_back(x);
    }
    plan.recalls = s->unreported_recalls;
    plan.recalls.insert(plan.recalls.end(), s->round_resident.begin(), s->round_resident.end());
    // Steps and other EndRounds are refused until the commit below.
    s->state = SessionState::kEnding;
  }

  // Send, without the lock.
  const CallOptions store_call = s->ForStore({StoreDeadline(call), {}});
  const std::string& name = s->key.session;
  // Every segment in one call where the store allows it (PutMany).
  auto put_all = [&]() -> absl::Status {
    std::vector<SegmentStore::SegmentWrite> writes;
    for (size_t i = 0; i < s->layout.size(); ++i) {
      const SegmentSpan& sp = s->layout[i];
      writes.push_back({{plan.round, sp.index, sh.model_digest},
                        static_cast<uint32_t>(sp.begin),
                        static_cast<uint32_t>(sp.end),
                        *plan.segments[i]});
    }
    const std::vector<absl::Status> st = store_->PutMany(name, writes, store_call);
    const absl::Status* failed = nullptr;
    const absl::Status* exists = nullptr;
    bool stored_some = false;
    for (const absl::Status& x : st) {
      if (x.ok()) {
        stored_some = true;
        continue;
      }
      if (failed == nullptr) failed = &x;
      if (exists == nullptr && x.code() == absl::StatusCode::kAlreadyExists) exists = &x;
    }
    if (failed == nullptr) return absl::OkStatus();
    // ALREADY_EXISTS is left to the caller, which replaces the whole round.
    if (exists != nullptr) return *exists;
    // Leave no part of a round behind (best effort: a retry of EndRound
    // replaces one anyway).
    if (stored_some) {
      absl::Status dropped = store_->DropRound(name, plan.round, store_call);
      if (!dropped.ok()) {
        LogWarn(
            "half-stored round not dropped",
            {{"session", s->key.ToString()}, {"round", plan.round}, {"error", dropped.ToString()}});
      }
    }
    return *failed;
  };
  absl::Status put = put_all();
  if (put.code() == absl::StatusCode::kAlreadyExists) {
    // An earlier EndRound of this round stored some of its segments and
    // then failed; the round may have grown since. Replace what is there.
    put = store_->DropRound(name, plan.round, store_call);
    if (put.ok()) put = put_all();
    if (put.code() == absl::StatusCode::kAlreadyExists) {
      put = absl::InternalError(
          absl::StrCat("round ", plan.round, " is still in the store after a drop"));
    }
  }
  absl::Status dropped = absl::CancelledError("not sent");
  if (put.ok() && !plan.drops.empty()) {
    dropped = store_->DropSegments(name, plan.drops, store_call);
    if (!dropped.ok()) {
      LogWarn("sliding-window segments that left their windows not dropped; sent again next round",
              {{"session", s->key.ToString()},
               {"segments", plan.drops.size()},
               {"error", dropped.ToString()}});
    }
  }
  absl::Status recorded = absl::CancelledError("not sent");
  if (put.ok() && !plan.recalls.empty()) {
    recorded = store_->RecordRecalls(name, plan.recalls, store_call);
    if (!recorded.ok()) {
      LogWarn("recall counters not sent; kept for the next round",
              {{"session", s->key.ToString()},
               {"rounds", plan.recalls.size()},
               {"error", recorded.ToString()}});
    }
  }

  // Commit.
  absl::MutexLock lock(&s->mu);
  if (!dropped.ok()) s->pending_drops = std::move(plan.drops);
  if (!put.ok()) {
    s->state = SessionState::kOpen;
    return put;
  }
  EndRoundReport rep;
  rep.round = plan.round;
  for (const auto& seg : plan.segments) rep.stored_bytes += seg->size();
  Session::PastRound pr;
  pr.round = plan.round;
  pr.tokens = plan.tokens;
  pr.layers = std::move(plan.layers);
  pr.stored_bytes = rep.stored_bytes;
  s->past.push_back(std::move(pr));
  s->last_active_ms.store(s->clock->NowUnixMs());
  if (s->policy.release_after_end_round) {
    for (auto& r : s->past) {
      for (int l = lw + 1; l < sh.layers; ++l) r.layers[l].reset();
    }
  }
  if (s->policy.speculation.pool_bytes > 0) {
    // The round is stored whatever happens here: a failed trim (the
    // re-encoding) leaves the pool as it was, above its cap until the next.
    absl::StatusOr<PoolTrim> trim = s->TrimPool(s->policy.codec, options_.level);
    if (trim.ok()) {
      rep.pool = *trim;
    } else {
      LogWarn("host pool not trimmed", {{"session", s->key.ToString()},
                                        {"round", plan.round},
                                        {"error", trim.status().ToString()}});
    }
  }
  s->round_resident.clear();
  if (recorded.ok()) {
    s->unreported_recalls.clear();
    rep.recalls_recorded = std::move(plan.recalls);
  } else {
    s->unreported_recalls = std::move(plan.recalls);
  }
  s->stats.pending_recall_counts = s->unreported_recalls.size();
  rep.full_bytes = static_cast<uint64_t>(s->TokenBytes(plan.tokens));
  s->stats.full_cache_bytes += rep.full_bytes;
  rep.speculation = std::move(s->spec_stats);
  s->CloseRound();
  s->stats.rounds += 1;
  s->NotePeak();
  Account(*s);
  rep.working_set_bytes = s->stats.working_set_bytes;
  rep.round_working_set_bytes = plan.round_working_set;
  rep.full_cache_bytes = s->stats.full_cache_bytes;
  rep.process_memory = ReadProcessMemory();
  return rep;
}

}  // namespace kvtier::worker
