#include "services/controller/repairer.h"

#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace kvtier {

using controller::NodeInfo;
using controller::RepairTask;

absl::StatusOr<std::unique_ptr<Repairer>> Repairer::Start(controller::Controller* controller,
                                                          RepairOptions options) {
  if (options.parallelism < 1 || options.parallelism > 64 || options.max_attempts < 1 ||
      options.call_deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "repair needs parallelism in [1, 64], max_attempts >= 1 and a positive call deadline");
  }
  std::unique_ptr<Repairer> r(new Repairer(controller, std::move(options)));
  for (int i = 0; i < r->options_.parallelism; ++i) {
    r->threads_.emplace_back([raw = r.get()] { raw->Loop(); });
  }
  return r;
}

Repairer::~Repairer() {
  stop_.Notify();
  for (std::thread& t : threads_) t.join();
}

RepairStats Repairer::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void Repairer::Loop() {
  while (!stop_.HasBeenNotified()) {
    std::optional<RepairTask> task = controller_->NextRepair();
    if (!task.has_value()) {
      stop_.WaitForNotificationWithTimeout(absl::Milliseconds(50));
      continue;
    }
    const absl::Time t0 = absl::Now();
    bool empty = false;
    absl::Status s = Repair(*task, &empty);
    {
      absl::MutexLock lock(&mu_);
      stats_.busy += absl::Now() - t0;
      if (s.ok() && empty) {
        ++stats_.sessions_empty;
      } else if (s.ok()) {
        ++stats_.sessions_repaired;
      } else {
        ++stats_.sessions_failed;
      }
    }
    if (!s.ok()) {
      LogWarn("repair failed", {{"tenant", task->tenant},
                                {"session", task->session},
                                {"target", task->target.spec.id},
                                {"attempt", task->attempt + 1},
                                {"of", options_.max_attempts},
                                {"error", s.ToString()}});
      // Back off a little before the retry, so a store that is down for a
      // moment is not hammered.
      stop_.WaitForNotificationWithTimeout(absl::Milliseconds(200) * (task->attempt + 1));
    }
    controller_->RepairFinished(std::move(*task), s.ok(), options_.max_attempts);
  }
}

void Repairer::Throttle(uint64_t bytes) {
  if (options_.max_bytes_per_second == 0) return;
  absl::Time start;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    // No credit is saved up while idle: a burst after a quiet spell still
    // starts at the cap.
    start = std::max(now, next_send_);
    next_send_ = start + absl::Seconds(static_cast<double>(bytes) /
                                       static_cast<double>(options_.max_bytes_per_second));
  }
  const absl::Duration wait = start - absl::Now();
  if (wait > absl::ZeroDuration()) stop_.WaitForNotificationWithTimeout(wait);
}

absl::StatusOr<StoreClient*> Repairer::Client(const std::string& address) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<StoreClient>& c = clients_[address];
  if (c == nullptr) {
    StoreClientOptions o;
    o.target = address;
    o.token = options_.store_token;
    o.tls_root_certs = options_.store_tls_root_certs;
    o.tls_cert_chain = options_.store_tls_cert_chain;
    o.tls_private_key = options_.store_tls_private_key;
    o.deadline = options_.call_deadline;
    absl::StatusOr<std::unique_ptr<StoreClient>> made = StoreClient::Connect(std::move(o));
    if (!made.ok()) {
      clients_.erase(address);
      return made.status();
    }
    c = std::move(*made);
  }
  return c.get();
}

absl::Status Repairer::Repair(const RepairTask& task, bool* empty) {
  *empty = false;
  auto call = [&] {
    CallOptions c = CallOptions::Within(options_.call_deadline);
    c.tenant = task.tenant;
    return c;
  };
  const absl::Time t0 = absl::Now();
  KVT_ASSIGN_OR_RETURN(StoreClient * target, Client(task.target.spec.address));

  // The first source that answers. NOT_FOUND everywhere: nothing was stored
  // yet, so there is nothing to copy.
  StoreClient* source = nullptr;
  const NodeInfo* source_node = nullptr;
  v1::ListRoundsResponse have;
  absl::Status last = absl::NotFoundError("no source");
  bool all_not_found = true;
  for (const NodeInfo& n : task.sources) {
    KVT_ASSIGN_OR_RETURN(StoreClient * c, Client(n.spec.address));
    absl::StatusOr<v1::ListRoundsResponse> r = c->ListRounds(task.session, call());
    if (r.ok()) {
      source = c;
      source_node = &n;
      have = std::move(*r);
      break;
    }
    if (!absl::IsNotFound(r.status())) all_not_found = false;
    last = absl::Status(r.status().code(),
                        absl::StrCat("ListRounds on ", n.spec.id, ": ", r.status().message()));
  }
  if (source == nullptr) {
    if (!all_not_found) return last;
    LogInfo("repair skipped: no replica holds the session yet",
            {{"tenant", task.tenant}, {"session", task.session}, {"to", task.target.spec.id}});
    *empty = true;
    return absl::OkStatus();
  }

  // What the target holds already: (round, segment) -> crc.
  std::map<std::pair<uint32_t, uint32_t>, uint32_t> present;
  absl::StatusOr<v1::ListRoundsResponse> there = target->ListRounds(task.session, call());
  if (there.ok()) {
    for (const v1::RoundInfo& r : there->rounds()) {
      for (const v1::SegmentInfo& s : r.segments()) {
        present[{s.ref().round(), s.ref().segment()}] = s.payload_crc32c();
      }
    }
  } else if (!absl::IsNotFound(there.status())) {
    return absl::Status(there.status().code(), absl::StrCat("ListRounds on ", task.target.spec.id,
                                                            ": ", there.status().message()));
  }

  LogInfo("repair started", {{"tenant", task.tenant},
                             {"session", task.session},
                             {"from", source_node->spec.id},
                             {"to", task.target.spec.id},
                             {"rounds", have.rounds_size()}});
  uint64_t bytes = 0, segments = 0, skipped = 0;
  // Missing segments go in batches of whole rounds, up to kBatchBytes or
  // kBatchSegments: one GetSegments and one PutSegments a batch, so that a
  // call's fixed cost (and, with fsync, the target's WAL sync) is paid per
  // batch rather than per round.
  struct Missing {
    const v1::SegmentInfo* info;
    const v1::RoundInfo* round;
  };
  std::vector<Missing> batch;
  uint64_t batch_bytes = 0;
  auto flush = [&]() -> absl::Status {
    if (batch.empty()) return absl::OkStatus();
    const std::string rounds = batch.front().round == batch.back().round
                                   ? absl::StrCat("round ", batch.front().round->round())
                                   : absl::StrCat("rounds ", batch.front().round->round(), "-",
                                                  batch.back().round->round());
    Throttle(batch_bytes);
    std::vector<v1::SegmentRef> refs;
    for (const Missing& m : batch) refs.push_back(m.info->ref());
    KVT_ASSIGN_OR_RETURN(std::vector<FetchedSegment> got,
                         source->GetSegments(task.session, refs, call(), /*uncounted=*/true));
    if (got.size() != batch.size()) {
      return absl::InternalError(absl::StrCat("GetSegments of ", rounds, " returned ", got.size(),
                                              " of ", batch.size(), " segments"));
    }
    // Each segment with its own status.
    std::vector<PutSegmentsItem> items(got.size());
    for (size_t i = 0; i < got.size(); ++i) {
      const v1::SegmentInfo& info = got[i].info;
      PutSegmentArgs& a = items[i].args;
      a.session_id = task.session;
      a.round = info.ref().round();
      a.segment = info.ref().segment();
      a.layer_begin = info.layer_begin();
      a.layer_end = info.layer_end();
      a.round_summary = &batch[i].round->summary();
      a.session_ttl_seconds = have.ttl_seconds();
      items[i].payload = got[i].payload;
    }
    absl::StatusOr<std::vector<absl::StatusOr<v1::PutSegmentResponse>>> put =
        target->PutSegments(items, call());
    if (!put.ok()) {
      return absl::Status(put.status().code(),
                          absl::StrCat("PutSegments of ", rounds, " on ", task.target.spec.id, ": ",
                                       put.status().message()));
    }
    for (size_t i = 0; i < items.size(); ++i) {
      const absl::Status& st = (*put)[i].status();
      if (absl::IsAlreadyExists(st)) {
        ++skipped;  // The worker wrote it meanwhile.
        continue;
      }
      if (!st.ok()) {
        return absl::Status(st.code(), absl::StrCat("PutSegment round ", items[i].args.round,
                                                    " segment ", items[i].args.segment, " on ",
                                                    task.target.spec.id, ": ", st.message()));
      }
      bytes += got[i].payload.size();
      ++segments;
    }
    batch.clear();
    batch_bytes = 0;
    return absl::OkStatus();
  };
  std::vector<Missing> of_round;
  for (const v1::RoundInfo& round : have.rounds()) {
    if (stop_.HasBeenNotified()) return absl::CancelledError("the controller is stopping");
    of_round.clear();
    uint64_t round_bytes = 0;
    for (const v1::SegmentInfo& s : round.segments()) {
      auto it = present.find({s.ref().round(), s.ref().segment()});
      if (it != present.end()) {
        if (it->second != s.payload_crc32c()) {
          LogWarn("repair: replicas differ", {{"session", task.session},
                                              {"round", s.ref().round()},
                                              {"segment", s.ref().segment()},
                                              {"target", task.target.spec.id}});
        }
        ++skipped;
        continue;
      }
      of_round.push_back({&s, &round});
      round_bytes += s.payload_bytes();
    }
    // A round that would take the batch past either bound starts the next.
    if (batch_bytes + round_bytes > kBatchBytes ||
        batch.size() + of_round.size() > kBatchSegments) {
      KVT_RETURN_IF_ERROR(flush());
    }
    batch.insert(batch.end(), of_round.begin(), of_round.end());
    batch_bytes += round_bytes;
  }
  KVT_RETURN_IF_ERROR(flush());
  if (have.pinned()) KVT_RETURN_IF_ERROR(target->PinSession(task.session, true, call()));
  const double secs = absl::ToDoubleSeconds(absl::Now() - t0);
  {
    absl::MutexLock lock(&mu_);
    stats_.bytes_copied += bytes;
    stats_.segments_copied += segments;
    stats_.segments_present += skipped;
  }
  LogInfo("repair done", {{"tenant", task.tenant},
                          {"session", task.session},
                          {"to", task.target.spec.id},
                          {"segments", segments},
                          {"skipped", skipped},
                          {"bytes", bytes},
                          {"ms", static_cast<int64_t>(secs * 1000)},
                          {"mb_per_s", secs > 0 ? bytes / secs / 1e6 : 0.0}});
  return absl::OkStatus();
}

}  // namespace kvtier
