#include "client/store_segments.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/crc32c.h"

namespace kvtier {
namespace {

// A store call's failure as the engine sees it, named by `what`. Only the
// transport's failures (UNAVAILABLE, CANCELLED, UNKNOWN: the store could not
// be reached or the call broke) become UNAVAILABLE, which callers may retry;
// every other code is the store's answer and keeps its code: DATA_LOSS (a
// stored segment failed its checksum), INVALID_ARGUMENT, INTERNAL,
// DEADLINE_EXCEEDED (the caller's budget is spent), RESOURCE_EXHAUSTED (the
// end tenant's store quota is full), PERMISSION_DENIED (the worker's store
// token may not act for end tenants: a configuration error).
absl::Status FromStore(const absl::Status& s, const std::string& what) {
  if (s.ok()) return s;
  switch (s.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kUnknown:
      return absl::UnavailableError(absl::StrCat(what, ": ", s.ToString()));
    default:
      return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
  }
}

// The same bytes already there (the controller's repair copied this round
// to a new replica while we wrote it) count as written; other bytes are a
// stale round the caller must replace.
bool SameBytesStored(StoreClient* client, const std::string& session,
                     const worker::SegmentStore::Segment& s, std::string_view payload,
                     const CallOptions& call) {
  auto listed = client->ListRounds(session, call);
  if (!listed.ok()) return false;
  for (const v1::RoundInfo& ri : listed->rounds()) {
    for (const v1::SegmentInfo& si : ri.segments()) {
      if (si.ref().round() == s.round && si.ref().segment() == s.segment &&
          si.payload_bytes() == payload.size() && si.payload_crc32c() == Crc32c(payload)) {
        return true;
      }
    }
  }
  return false;
}

// One segment's put status as SegmentStore::Put gives it.
absl::Status PutOutcome(StoreClient* client, const std::string& session,
                        const worker::SegmentStore::Segment& s, std::string_view payload,
                        const absl::Status& st, const CallOptions& call) {
  if (st.code() == absl::StatusCode::kAlreadyExists) {
    return SameBytesStored(client, session, s, payload, call) ? absl::OkStatus() : st;
  }
  return FromStore(st, absl::StrCat("PutSegment round ", s.round, " segment ", s.segment));
}

std::vector<v1::SegmentRef> RefsOf(const std::vector<worker::SegmentStore::Segment>& segments) {
  std::vector<v1::SegmentRef> refs;
  refs.reserve(segments.size());
  for (const worker::SegmentStore::Segment& s : segments) {
    v1::SegmentRef r;
    r.set_round(s.round);
    r.set_segment(s.segment);
    refs.push_back(r);
  }
  return refs;
}

}  // namespace

absl::Status StoreSegments::Put(const std::string& session, const Segment& s, uint32_t layer_begin,
                                uint32_t layer_end, std::string_view payload,
                                const CallOptions& call) {
  PutSegmentArgs a;
  a.session_id = session;
  a.round = s.round;
  a.segment = s.segment;
  a.layer_begin = layer_begin;
  a.layer_end = layer_end;
  v1::RoundSummary summary;
  if (s.model != 0) {
    summary.set_model_digest(s.model);
    a.round_summary = &summary;
  }
  auto r = client_->PutSegment(a, payload, call);
  return PutOutcome(client_.get(), session, s, payload, r.status(), call);
}

std::vector<absl::Status> StoreSegments::PutMany(const std::string& session,
                                                 const std::vector<SegmentWrite>& writes,
                                                 const CallOptions& call) {
  std::vector<PutSegmentsItem> items(writes.size());
  std::vector<v1::RoundSummary> summaries(writes.size());
  for (size_t i = 0; i < writes.size(); ++i) {
    PutSegmentArgs& a = items[i].args;
    a.session_id = session;
    a.round = writes[i].s.round;
    a.segment = writes[i].s.segment;
    a.layer_begin = writes[i].layer_begin;
    a.layer_end = writes[i].layer_end;
    if (writes[i].s.model != 0) {
      summaries[i].set_model_digest(writes[i].s.model);
      a.round_summary = &summaries[i];
    }
    items[i].payload = writes[i].payload;
  }
  auto r = client_->PutSegments(items, call);
  std::vector<absl::Status> out;
  out.reserve(writes.size());
  for (size_t i = 0; i < writes.size(); ++i) {
    const absl::Status st = r.ok() ? (*r)[i].status() : r.status();
    out.push_back(PutOutcome(client_.get(), session, writes[i].s, writes[i].payload, st, call));
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> StoreSegments::Get(const std::string& session,
                                                            const std::vector<Segment>& segments,
                                                            const CallOptions& call) {
  get_calls_.fetch_add(1);
  auto got = client_->GetSegments(session, RefsOf(segments), call);
  if (absl::IsNotFound(got.status())) {
    // A round the store dropped (pressure, or a drop at resume): the caller
    // tells it from an outage.
    return absl::NotFoundError(absl::StrCat("GetSegments: ", got.status().message()));
  }
  if (!got.ok()) return FromStore(got.status(), "GetSegments");
  std::vector<std::string> out;
  for (FetchedSegment& f : *got) out.push_back(std::move(f.payload));
  return out;
}

absl::StatusOr<std::vector<std::optional<std::string>>> StoreSegments::GetPresent(
    const std::string& session, const std::vector<Segment>& segments, const CallOptions& call) {
  get_calls_.fetch_add(1);
  auto got = client_->GetSegments(session, RefsOf(segments), call, /*uncounted=*/false,
                                  /*missing_ok=*/true);
  if (absl::IsNotFound(got.status())) {
    // The session itself is not stored: none of its segments is.
    return std::vector<std::optional<std::string>>(segments.size());
  }
  if (!got.ok()) return FromStore(got.status(), "GetSegments");
  std::vector<std::optional<std::string>> out;
  out.reserve(got->size());
  for (FetchedSegment& f : *got) {
    if (f.missing) {
      out.emplace_back(std::nullopt);
    } else {
      out.emplace_back(std::move(f.payload));
    }
  }
  return out;
}

absl::Status StoreSegments::DropRound(const std::string& session, uint32_t round,
                                      const CallOptions& call) {
  auto r = client_->DropRounds(session, {round}, call);
  if (!r.ok() && r.status().code() != absl::StatusCode::kNotFound) {
    return FromStore(r.status(), absl::StrCat("DropRounds round ", round));
  }
  return absl::OkStatus();
}

absl::Status StoreSegments::DropSegments(const std::string& session,
                                         const std::vector<Segment>& segments,
                                         const CallOptions& call) {
  auto r = client_->DropSegments(session, RefsOf(segments), call);
  if (!r.ok() && r.status().code() != absl::StatusCode::kNotFound) {
    return FromStore(r.status(), "DropSegments");
  }
  return absl::OkStatus();
}

absl::Status StoreSegments::RecordRecalls(const std::string& session,
                                          const std::vector<uint32_t>& rounds,
                                          const CallOptions& call) {
  record_calls_.fetch_add(1);
  auto r = client_->RecordRecalls(session, rounds, call);
  if (!r.ok()) return FromStore(r.status(), "RecordRecalls");
  return absl::OkStatus();
}

absl::StatusOr<std::vector<worker::SegmentStore::StoredRound>> StoreSegments::List(
    const std::string& session, const CallOptions& call) {
  auto r = client_->ListRounds(session, call);
  if (r.status().code() == absl::StatusCode::kNotFound) return r.status();
  if (!r.ok()) return FromStore(r.status(), "ListRounds");
  std::vector<StoredRound> out;
  for (const v1::RoundInfo& ri : r->rounds()) {
    StoredRound sr;
    sr.round = ri.round();
    sr.model = ri.summary().model_digest();
    for (const v1::SegmentInfo& si : ri.segments()) {
      sr.segments.push_back({si.ref().segment(), si.layer_begin(), si.layer_end()});
    }
    std::sort(sr.segments.begin(), sr.segments.end(),
              [](const StoredSegment& a, const StoredSegment& b) { return a.segment < b.segment; });
    out.push_back(std::move(sr));
  }
  return out;
}

absl::Status StoreSegments::Delete(const std::string& session, const CallOptions& call) {
  auto r = client_->DeleteSession(session, call);
  if (!r.ok() && r.status().code() != absl::StatusCode::kNotFound) {
    return FromStore(r.status(), "DeleteSession");
  }
  return absl::OkStatus();
}

}  // namespace kvtier
