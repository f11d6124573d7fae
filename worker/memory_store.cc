#include "worker/memory_store.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"

namespace kvtier::worker {

absl::Status MemorySegmentStore::Check(Op op, const CallOptions& call, int segment) {
  if (!down_.ok()) return down_;
  if (absl::Now() > call.deadline) return absl::DeadlineExceededError("the call's deadline passed");
  auto it = armed_.find(op);
  if (it == armed_.end() || (it->second.segment >= 0 && it->second.segment != segment)) {
    return absl::OkStatus();
  }
  absl::Status s = it->second.status;
  if (--it->second.times <= 0) armed_.erase(it);
  return s;
}

absl::Status MemorySegmentStore::PutLocked(const std::string& session, const Segment& s,
                                           uint32_t layer_begin, uint32_t layer_end,
                                           std::string_view payload, const CallOptions& call) {
  if (absl::Status st = Check(Op::kPut, call, static_cast<int>(s.segment)); !st.ok()) return st;
  Round& r = sessions_[session][s.round];
  if (r.segments.empty()) r.model = s.model;
  auto [it, inserted] = r.segments.try_emplace(s.segment);
  if (!inserted) {
    return absl::AlreadyExistsError(
        absl::StrCat("segment ", s.round, "/", s.segment, " of '", session, "' is stored already"));
  }
  it->second = Stored{layer_begin, layer_end, std::string(payload)};
  ++counts_.stored_segments;
  counts_.stored_bytes += payload.size();
  return absl::OkStatus();
}

absl::Status MemorySegmentStore::Put(const std::string& session, const Segment& s,
                                     uint32_t layer_begin, uint32_t layer_end,
                                     std::string_view payload, const CallOptions& call) {
  absl::MutexLock lock(&mu_);
  ++counts_.put_calls;
  return PutLocked(session, s, layer_begin, layer_end, payload, call);
}

std::vector<absl::Status> MemorySegmentStore::PutMany(const std::string& session,
                                                      const std::vector<SegmentWrite>& writes,
                                                      const CallOptions& call) {
  absl::MutexLock lock(&mu_);
  ++counts_.put_calls;
  std::vector<absl::Status> out;
  out.reserve(writes.size());
  for (const SegmentWrite& w : writes) {
    out.push_back(PutLocked(session, w.s, w.layer_begin, w.layer_end, w.payload, call));
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> MemorySegmentStore::Get(
    const std::string& session, const std::vector<Segment>& segments, const CallOptions& call) {
  KVT_ASSIGN_OR_RETURN(std::vector<std::optional<std::string>> got,
                       GetCall(session, segments, call));
  std::vector<std::string> out;
  out.reserve(got.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (!got[i].has_value()) {
      return absl::NotFoundError(absl::StrCat("segment ", segments[i].round, "/",
                                              segments[i].segment, " of '", session,
                                              "' not found"));
    }
    out.push_back(*std::move(got[i]));
  }
  return out;
}

absl::StatusOr<std::vector<std::optional<std::string>>> MemorySegmentStore::GetPresent(
    const std::string& session, const std::vector<Segment>& segments, const CallOptions& call) {
  absl::StatusOr<std::vector<std::optional<std::string>>> got = GetCall(session, segments, call);
  if (absl::IsNotFound(got.status()))
    return std::vector<std::optional<std::string>>(segments.size());
  return got;
}

absl::StatusOr<std::vector<std::optional<std::string>>> MemorySegmentStore::GetCall(
    const std::string& session, const std::vector<Segment>& segments, const CallOptions& call) {
  absl::MutexLock lock(&mu_);
  ++counts_.get_calls;
  if (hold_gets_) {
    ++held_gets_;
    auto released = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !hold_gets_; };
    const bool in_time = mu_.AwaitWithDeadline(absl::Condition(&released), call.deadline);
    --held_gets_;
    if (!in_time) return absl::DeadlineExceededError("the call's deadline passed (gets held)");
  }
  if (absl::Status st = Check(Op::kGet, call); !st.ok()) return st;
  auto s = sessions_.find(session);
  if (s == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("session '", session, "' not found"));
  }
  std::vector<std::optional<std::string>> out;
  out.reserve(segments.size());
  for (const Segment& seg : segments) {
    auto r = s->second.find(seg.round);
    const Stored* found = nullptr;
    if (r != s->second.end()) {
      auto it = r->second.segments.find(seg.segment);
      if (it != r->second.segments.end()) found = &it->second;
    }
    if (found == nullptr) {
      out.emplace_back(std::nullopt);
    } else {
      out.emplace_back(found->payload);
    }
  }
  return out;
}

void MemorySegmentStore::EraseRoundLocked(RoundMap& rounds, RoundMap::iterator it) {
  for (const auto& [i, seg] : it->second.segments) {
    --counts_.stored_segments;
    counts_.stored_bytes -= seg.payload.size();
  }
  rounds.erase(it);
}

absl::Status MemorySegmentStore::Delete(const std::string& session, const CallOptions& call) {
  absl::MutexLock lock(&mu_);
  if (absl::Status st = Check(Op::kDelete, call); !st.ok()) return st;
  auto s = sessions_.find(session);
  if (s == sessions_.end()) return absl::OkStatus();
  while (!s->second.empty()) EraseRoundLocked(s->second, s->second.begin());
  sessions_.erase(s);
  return absl::OkStatus();
}

absl::Status MemorySegmentStore::DropRound(const std::string& session, uint32_t round,
                                           const CallOptions& call) {
  absl::MutexLock lock(&mu_);
  if (absl::Status st = Check(Op::kDropRound, call); !st.ok()) return st;
  auto s = sessions_.find(session);
  if (s == sessions_.end()) return absl::OkStatus();
  if (auto r = s->second.find(round); r != s->second.end()) EraseRoundLocked(s->second, r);
  return absl::OkStatus();
}

absl::Status MemorySegmentStore::DropSegments(const std::string& session,
                                              const std::vector<Segment>& segments,
                                              const CallOptions& call) {
  absl::MutexLock lock(&mu_);
  if (absl::Status st = Check(Op::kDropSegments, call); !st.ok()) return st;
  auto s = sessions_.find(session);
  if (s == sessions_.end()) return absl::OkStatus();
  for (const Segment& seg : segments) {
    auto r = s->second.find(seg.round);
    if (r == s->second.end()) continue;
    auto it = r->second.segments.find(seg.segment);
    if (it == r->second.segments.end()) continue;
    --counts_.stored_segments;
    counts_.stored_bytes -= it->second.payload.size();
    r->second.segments.erase(it);
    if (r->second.segments.empty()) s->second.erase(r);
  }
  return absl::OkStatus();
}

absl::Status MemorySegmentStore::RecordRecalls(const std::string& session,
                                               const std::vector<uint32_t>& rounds,
                                               const CallOptions& call) {
  absl::MutexLock lock(&mu_);
  ++counts_.record_calls;
  if (absl::Status st = Check(Op::kRecordRecalls, call); !st.ok()) return st;
  auto s = sessions_.find(session);
  if (s == sessions_.end()) return absl::OkStatus();
  for (uint32_t round : rounds) {
    if (auto r = s->second.find(round); r != s->second.end()) ++r->second.recalls;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<SegmentStore::StoredRound>> MemorySegmentStore::List(
    const std::string& session, const CallOptions& call) {
  absl::MutexLock lock(&mu_);
  if (absl::Status st = Check(Op::kList, call); !st.ok()) return st;
  auto s = sessions_.find(session);
  if (s == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("session '", session, "' not found"));
  }
  std::vector<StoredRound> out;
  for (const auto& [round, r] : s->second) {
    StoredRound sr;
    sr.round = round;
    sr.model = r.model;
    for (const auto& [i, seg] : r.segments) {
      sr.segments.push_back({i, seg.layer_begin, seg.layer_end});
    }
    out.push_back(std::move(sr));
  }
  return out;
}

void MemorySegmentStore::FailNext(Op op, absl::Status status, int times, int segment) {
  absl::MutexLock lock(&mu_);
  armed_[op] = Armed{std::move(status), times, segment};
}

void MemorySegmentStore::FailAll(absl::Status status) {
  absl::MutexLock lock(&mu_);
  down_ = std::move(status);
}

void MemorySegmentStore::Restore() {
  absl::MutexLock lock(&mu_);
  down_ = absl::OkStatus();
  armed_.clear();
}

void MemorySegmentStore::HoldGets() {
  absl::MutexLock lock(&mu_);
  hold_gets_ = true;
}

void MemorySegmentStore::ReleaseGets() {
  absl::MutexLock lock(&mu_);
  hold_gets_ = false;
}

void MemorySegmentStore::AwaitHeldGets(int n) {
  absl::MutexLock lock(&mu_);
  auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return held_gets_ >= n; };
  mu_.Await(absl::Condition(&enough));
}

MemorySegmentStore::Counts MemorySegmentStore::counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

std::vector<uint32_t> MemorySegmentStore::Rounds(const std::string& session) const {
  absl::MutexLock lock(&mu_);
  std::vector<uint32_t> out;
  auto s = sessions_.find(session);
  if (s == sessions_.end()) return out;
  for (const auto& [round, r] : s->second) out.push_back(round);
  return out;
}

uint64_t MemorySegmentStore::Recalls(const std::string& session, uint32_t round) const {
  absl::MutexLock lock(&mu_);
  auto s = sessions_.find(session);
  if (s == sessions_.end()) return 0;
  auto r = s->second.find(round);
  return r == s->second.end() ? 0 : r->second.recalls;
}

}  // namespace kvtier::worker
