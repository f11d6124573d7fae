// Round recall inside the engine: scoring at L_w, the one GetSegments call on
// the fetch executor, and its installation at L_w + 1.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "worker/session.h"

namespace kvtier::worker {

RecallReport Engine::StartRecall(Session& s, int64_t n, int64_t question_tokens, const float* q,
                                 const float* k, const CallOptions& call) {
  s.mu.AssertHeld();
  const ModelShape& sh = s.shape;
  const int d = sh.head_dim;
  std::vector<std::vector<float>> keys(s.past.size() * sh.kv_heads);
  std::vector<RoundKeys> rk(s.past.size());
  for (size_t r = 0; r < s.past.size(); ++r) {
    const RoundLayer& rl = *s.past[r].layers[s.lw];
    for (int h = 0; h < sh.kv_heads; ++h) {
      std::vector<float>& buf = keys[r * sh.kv_heads + h];
      buf.resize(static_cast<size_t>(rl.heads[h].len) * d);
      DecodeRows(rl.heads[h].kview, 0, 0, rl.heads[h].len, buf.data(), options_.level);
      rk[r].keys.push_back(buf.data());
      rk[r].lens.push_back(rl.heads[h].len);
    }
  }
  const int64_t qt = question_tokens > 0 ? std::min(question_tokens, n) : n;
  RecallReport rep;
  rep.round = s.stats.rounds;
  rep.scores =
      QAttention(sh.q_heads, sh.kv_heads, d, q, static_cast<int64_t>(sh.q_heads) * d, qt, rk, k);
  std::vector<uint32_t> pick =
      SelectRounds(rep.scores, s.policy.recall, s.policy.keep_recent_round);
  pick.erase(std::remove_if(pick.begin(), pick.end(),
                            [&s](uint32_t i) {
                              s.mu.AssertHeld();
                              return s.past[i].upper_gone;
                            }),
             pick.end());
  s.selected.assign(pick.begin(), pick.end());
  std::vector<SegmentStore::Segment> segs;
  s.fetch_segments.clear();
  std::vector<uint32_t> resident;
  for (uint32_t i : pick) {
    const Session::PastRound& r = s.past[i];
    rep.selected.push_back(r.round);
    // The round's upper segments not resident, except the sliding ones it
    // has left (gone from the store; no query here attends them).
    const size_t before = segs.size();
    for (const SegmentSpan& sp : s.layout) {
      if (!sp.upper || (r.left >> sp.index & 1) != 0 || r.layers[sp.begin] != nullptr) continue;
      segs.push_back({r.round, sp.index});
      s.fetch_segments.push_back({i, sp.index});
    }
    if (segs.size() == before) resident.push_back(r.round);
  }
  // Reported at EndRound. Assigned, not appended: a rolled-back first
  // prefill recalls again.
  s.round_resident = std::move(resident);
  rep.fetched_segments = static_cast<int>(segs.size());
  s.recall = RecallState::kReady;
  if (!segs.empty()) {
    // ONE GetSegments call for every selected round, started now so that it
    // overlaps with this layer's attention and the engine's work up to layer
    // L_w + 1. The task owns what it uses: a session that rolls back or
    // closes drops its reference and never waits.
    auto f = std::make_shared<Fetch>();
    s.fetch = f;
    s.recall = RecallState::kFetching;
    {
      absl::MutexLock lock(&fetches_mu_);
      ++fetches_in_flight_;
    }
    // Timed from here, its wait for a fetch thread included: layer L_w + 1
    // starts waiting after this, so the part it waits never exceeds it.
    fetch_executor_->Schedule([this, f, sid = s.key.session, segs = std::move(segs),
                               store_call = s.ForStore({StoreDeadline(call), {}}),
                               t0 = std::chrono::steady_clock::now()] {
      // A round the store dropped (pressure) comes back as nullopt in the
      // same call: noted as gone, its other segments used.
      absl::StatusOr<std::vector<std::optional<std::string>>> got =
          store_->GetPresent(sid, segs, store_call);
      if (got.ok() && got->size() != segs.size()) {
        got = absl::DataLossError("GetSegments returned another count");
      }
      if (got.ok()) {
        std::vector<std::string> payloads(segs.size());
        for (size_t i = 0; i < segs.size(); ++i) {
          if ((*got)[i].has_value()) {
            payloads[i] = *std::move((*got)[i]);
          } else {
            if (f->gone.empty()) f->gone.assign(segs.size(), false);
            f->gone[i] = true;
          }
        }
        f->result = std::move(payloads);
      } else {
        f->result = got.status();
      }
      f->ms = MsSince(t0);
      f->done.Notify();
      absl::MutexLock lock(&fetches_mu_);
      --fetches_in_flight_;
    });
  }
  s.stats.recalls.push_back(rep);
  return rep;
}

absl::StatusOr<RecallReport> Engine::InstallFetch(Session& s, const std::shared_ptr<Fetch>& f,
                                                  bool arrived, double exposed_ms) {
  s.mu.AssertHeld();
  const ModelShape& sh = s.shape;
  auto fail = [&s](absl::Status st) {
    s.mu.AssertHeld();
    s.RollBackStep();
    return st;
  };
  if (!arrived) {
    return fail(absl::DeadlineExceededError(
        "recall fetch (GetSegments) did not finish within the call's deadline"));
  }
  if (!f->result.ok()) {
    const absl::Status& st = f->result.status();
    // The store's code as it came (UNAVAILABLE for the transport's
    // failures, DATA_LOSS for a corrupt stored segment, ...).
    return fail(absl::Status(st.code(), absl::StrCat("recall fetch failed: ", st.message())));
  }
  if (f->result->size() != s.fetch_segments.size()) {
    return fail(absl::DataLossError("recall fetch returned a different segment count"));
  }
  // A round with any segment gone (dropped by the store) is attended up to
  // L_w only from now on; the others' segments become their layers.
  std::vector<bool> gone(s.past.size(), false);
  for (size_t i = 0; i < f->gone.size(); ++i) {
    if (f->gone[i]) gone[s.fetch_segments[i].round] = true;
  }
  std::vector<std::pair<size_t, std::vector<std::unique_ptr<RoundLayer>>>> parsed;
  uint64_t fetched = 0;
  for (size_t i = 0; i < f->result->size(); ++i) {
    const Session::FetchedSegment& fs = s.fetch_segments[i];
    if (gone[fs.round]) continue;
    std::string& bytes = (*f->result)[i];
    const SegmentSpan& sp = s.layout[fs.segment];
    fetched += bytes.size();
    // The fetched buffer itself becomes the working set's bytes: views, no
    // copy (its crc32c was checked on arrival).
    auto payload = std::make_shared<const std::string>(std::move(bytes));
    auto layers = MakeLayers(std::move(payload), sp.layers(), sh.kv_heads, sh.head_dim);
    if (!layers.ok()) {
      return fail(absl::DataLossError(
          absl::StrCat("recalled segment payload is malformed: ", layers.status().message())));
    }
    for (int l = sp.begin; l < sp.end; ++l) {
      absl::Status placed = s.Place(*(*layers)[l - sp.begin], l);
      if (!placed.ok()) return fail(placed);
    }
    parsed.emplace_back(i, *std::move(layers));
  }
  RecallReport& rr = s.stats.recalls.back();
  for (auto& [i, layers] : parsed) {
    const Session::FetchedSegment& fs = s.fetch_segments[i];
    const SegmentSpan& sp = s.layout[fs.segment];
    Session::PastRound& r = s.past[fs.round];
    for (int l = sp.begin; l < sp.end; ++l) r.layers[l] = std::move(layers[l - sp.begin]);
  }
  for (size_t index = 0; index < gone.size(); ++index) {
    if (!gone[index]) continue;
    Session::PastRound& r = s.past[index];
    r.upper_gone = true;
    s.selected.erase(std::remove(s.selected.begin(), s.selected.end(), index), s.selected.end());
    rr.selected.erase(std::remove(rr.selected.begin(), rr.selected.end(), r.round),
                      rr.selected.end());
    rr.gone.push_back(r.round);
  }
  if (!rr.gone.empty()) {
    LogWarn("recalled rounds were dropped by the store; attending them up to L_w only",
            {{"session", s.key.ToString()}, {"rounds", rr.gone.size()}});
  }
  s.recall = RecallState::kReady;
  s.fetch.reset();
  rr.fetch_ms = f->ms;
  // The waiter wakes a moment after the fetch ends: never more than all of it.
  rr.exposed_ms = std::min(exposed_ms, f->ms);
  rr.bytes_fetched += fetched;
  return rr;
}

}  // namespace kvtier::worker
