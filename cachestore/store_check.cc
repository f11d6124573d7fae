// Store::CheckIndex: every derived index against the sessions it is built
// from.
#include "absl/strings/str_cat.h"
#include "cachestore/store.h"
#include "cachestore/store_internal.h"

namespace kvtier::cachestore {

absl::Status Store::CheckIndex() const {
  absl::MutexLock lock(&mu_);
  absl::flat_hash_map<std::string, uint64_t> tenants;
  size_t deadlines = 0;
  for (bool pinned : {false, true}) {
    // What the old planner read: every sealed segment of the class.
    std::vector<SpillCandidate> cands;
    std::vector<const SegmentEntry*> entries;
    uint64_t total = 0;
    for (const auto& [k, s] : sessions_) {
      if (s.pinned != pinned) continue;
      for (const auto& [rn, r] : s.rounds) {
        for (const auto& [sn, e] : r.segments) {
          if (e.info.state != SegmentState::kSealed) continue;
          cands.push_back({e.info.payload_bytes, e.insert_seq, e.last_access_seq, r.recall_count});
          entries.push_back(&e);
          total += e.info.payload_bytes;
        }
      }
    }
    std::vector<const SegmentEntry*> planned;
    for (size_t i : PlanSpill(cands, total, options_.spill_policy)) planned.push_back(entries[i]);
    std::vector<const SegmentEntry*> walked;
    spill_order_[pinned ? 1 : 0].Walk([&](SegmentEntry* e, const SpillKey&) {
      walked.push_back(e);
      return true;
    });
    if (walked != planned) {
      return absl::InternalError(absl::StrCat("spill order (", pinned ? "pinned" : "unpinned",
                                              ") lists ", walked.size(), " segments, the planner ",
                                              planned.size(), ", or their order differs"));
    }
  }
  std::vector<DropCandidate> drops;
  std::vector<const RoundEntry*> rounds;
  uint64_t droppable = 0;
  for (const auto& [k, s] : sessions_) {
    ++tenants[s.tenant];
    if (by_idle_.count({s.last_access_ms, const_cast<SessionEntry*>(&s)}) == 0) {
      return absl::InternalError(absl::StrCat("session ", s.session, " is not in by_idle"));
    }
    const bool expires = !s.pinned && s.ttl_seconds != 0;
    const int64_t deadline = s.last_access_ms + int64_t{s.ttl_seconds} * 1000;
    if (expires != (s.indexed_deadline_ms >= 0) || (expires && s.indexed_deadline_ms != deadline) ||
        (expires && by_deadline_.count({deadline, const_cast<SessionEntry*>(&s)}) == 0)) {
      return absl::InternalError(absl::StrCat("session ", s.session, " has a stale TTL deadline"));
    }
    deadlines += expires ? 1 : 0;
    for (const auto& [rn, r] : s.rounds) {
      if (r.session != &s || r.number != rn) {
        return absl::InternalError(
            absl::StrCat("round ", rn, " of ", s.session, " does not point back at its session"));
      }
      uint64_t bytes = 0;
      uint32_t writing = 0;
      for (const auto& [sn, e] : r.segments) {
        bytes += e.info.payload_bytes;
        writing += e.info.state == SegmentState::kWriting ? 1 : 0;
      }
      if (writing != r.writing) {
        return absl::InternalError(absl::StrCat("round ", rn, " of ", s.session, " counts ",
                                                r.writing, " uploads, holds ", writing));
      }
      if (s.pinned || writing != 0 || bytes == 0) continue;
      drops.push_back({bytes, r.insert_seq, r.recall_count});
      rounds.push_back(&r);
      droppable += bytes;
    }
  }
  if (by_idle_.size() != sessions_.size() || by_deadline_.size() != deadlines) {
    return absl::InternalError("session time indexes hold entries of no session");
  }
  if (tenants != tenant_sessions_) return absl::InternalError("tenant session counts differ");
  if (by_name_.size() != sessions_.size()) {
    return absl::InternalError("the name index holds entries of no session");
  }
  for (const auto& [name, s] : by_name_) {
    if (name.first != s->tenant || name.second != s->session) {
      return absl::InternalError(absl::StrCat("the name index's ", std::string(name.second),
                                              " names session ", s->session));
    }
  }
  if (drop_order_.bytes() != droppable) {
    return absl::InternalError(
        absl::StrCat("drop order holds ", drop_order_.bytes(), " bytes, the rounds ", droppable));
  }
  std::vector<const RoundEntry*> planned;
  if (!drops.empty()) {
    const std::optional<std::vector<size_t>> plan = PlanDrop(drops, droppable);
    for (size_t i : plan.value()) planned.push_back(rounds[i]);
  }
  std::vector<const RoundEntry*> walked;
  drop_order_.Walk([&](RoundEntry* r) {
    walked.push_back(r);
    return true;
  });
  if (walked != planned) {
    return absl::InternalError(absl::StrCat("drop order lists ", walked.size(),
                                            " rounds, the planner ", planned.size(),
                                            ", or their order differs"));
  }
  return absl::OkStatus();
}

}  // namespace kvtier::cachestore
