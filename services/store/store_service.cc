#include "services/store/store_service.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/log.h"
#include "base/memory.h"
#include "base/status_macros.h"
#include "cachestore/names.h"
#include "kernels/crc32c.h"
#include "rpc/grpc_status.h"
#include "rpc/wire_format.h"
#include "services/common/idle_read.h"

namespace kvtier {
namespace {

using cachestore::SegmentId;

v1::SegmentState ToProto(cachestore::SegmentState s) {
  switch (s) {
    case cachestore::SegmentState::kWriting:
      return v1::SEGMENT_STATE_WRITING;
    case cachestore::SegmentState::kSealed:
      return v1::SEGMENT_STATE_SEALED;
    case cachestore::SegmentState::kSpilled:
      return v1::SEGMENT_STATE_SPILLED;
    case cachestore::SegmentState::kDropped:
      return v1::SEGMENT_STATE_DROPPED;
  }
  return v1::SEGMENT_STATE_UNSPECIFIED;
}

}  // namespace

v1::SegmentInfo ToProto(const cachestore::SegmentInfo& info) {
  v1::SegmentInfo p;
  p.mutable_ref()->set_round(info.id.round);
  p.mutable_ref()->set_segment(info.id.segment);
  p.set_layer_begin(info.layer_begin);
  p.set_layer_end(info.layer_end);
  p.set_payload_bytes(info.payload_bytes);
  p.set_payload_crc32c(info.payload_crc32c);
  p.set_state(ToProto(info.state));
  p.set_recall_count(info.recall_count);
  return p;
}

StoreService::StoreService(cachestore::Store* store, cachestore::QuotaManager* quotas,
                           const Authenticator* auth, Executor* executor, StoreMetrics* metrics,
                           StoreServiceOptions options)
    : store_(store),
      quotas_(quotas),
      auth_(auth),
      executor_(executor),
      metrics_(metrics),
      options_(options),
      tenant_inflight_share_(options.tenant_inflight_upload_bytes != 0
                                 ? options.tenant_inflight_upload_bytes
                                 : options.max_inflight_upload_bytes /
                                       std::max(1, auth->WritingTenants())) {
  if (options_.upload_idle_timeout > absl::ZeroDuration()) {
    watchdog_ = std::thread([this] { WatchIdleUploads(); });
  }
}

StoreService::~StoreService() {
  stop_.Notify();
  if (watchdog_.joinable()) watchdog_.join();
}

absl::Status StoreService::AdmitUpload(const std::string& tenant, uint64_t bytes) {
  absl::MutexLock lock(&upload_mu_);
  uint64_t& mine = tenant_inflight_[tenant];
  if (bytes > tenant_inflight_share_ || mine > tenant_inflight_share_ - bytes) {
    const uint64_t held = mine;
    if (mine == 0) tenant_inflight_.erase(tenant);
    return absl::ResourceExhaustedError(absl::StrCat(
        "tenant '", tenant, "' has uploads in flight declaring ", held, " bytes; with ", bytes,
        " more it would pass its share of ", tenant_inflight_share_, " bytes"));
  }
  if (bytes > options_.max_inflight_upload_bytes ||
      inflight_upload_bytes_ > options_.max_inflight_upload_bytes - bytes) {
    if (mine == 0) tenant_inflight_.erase(tenant);
    return absl::ResourceExhaustedError(
        absl::StrCat("uploads in flight already declare ", inflight_upload_bytes_,
                     " bytes; the limit is ", options_.max_inflight_upload_bytes));
  }
  mine += bytes;
  inflight_upload_bytes_ += bytes;
  return absl::OkStatus();
}

void StoreService::RefundUpload(const std::string& tenant, uint64_t bytes) {
  if (bytes == 0) return;
  absl::MutexLock lock(&upload_mu_);
  inflight_upload_bytes_ -= bytes;
  auto it = tenant_inflight_.find(tenant);
  it->second -= bytes;
  if (it->second == 0) tenant_inflight_.erase(it);
}

uint64_t StoreService::InflightUploadBytes() const {
  absl::MutexLock lock(&upload_mu_);
  return inflight_upload_bytes_;
}

uint64_t StoreService::InflightUploadBytes(const std::string& tenant) const {
  absl::MutexLock lock(&upload_mu_);
  auto it = tenant_inflight_.find(tenant);
  return it == tenant_inflight_.end() ? 0 : it->second;
}

// ---- PutSegment, PutSegments ----

// Reads the header and reserves room, then accumulates chunks on the
// callback thread (a memcpy, never blocking) and commits. The reservation and
// the commit run on the callback thread when the store can do them without
// waiting (Store::TryBeginWrite, Store::TryCommitWrite: no lock held by
// another call's removals, no disk room to make; a commit that is one
// RocksDB write without fsync and does not stall), else on the executor. A
// small put thus skips two hand-offs between threads.
// A payload that goes to a file of its own is also written to that file as it
// arrives, by one writer task at a time on the executor (WriteChunks), so the
// disk works while the rest is received; the commit, and any failure after
// the header, wait for that task (RunAfterWrites). Exactly one Finish() is
// called on every path; nothing touches `this` after it, since OnDone() may
// delete the reactor at once.
//
// PutSegments (`batch_`) runs the same steps for each segment in turn: a
// segment commits when its last byte arrives (not at the half-close), its
// outcome goes into the reply (EndSegment) and the next message is read
// once it has committed. A segment refused at its header has its bytes read
// and dropped (skip_). Errors of the stream itself end the call (Done).
// With sync_writes, the commits are not synced one by one (defer_sync, so a
// small one may commit on the callback thread too): one WAL sync at the
// half-close makes them all durable before the reply.
class StoreService::PutReactor : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  PutReactor(StoreService* svc, grpc::CallbackServerContext* ctx, grpc::ByteBuffer* resp,
             bool batch)
      : svc_(svc),
        ctx_(ctx),
        resp_(resp),
        start_(absl::Now()),
        batch_(batch),
        method_(batch ? "PutSegments" : "PutSegment") {
    absl::StatusOr<Principal> p = svc_->auth_->Authenticate(*ctx_);
    absl::Status allowed = p.ok() ? Authenticator::RequireWrite(*p) : p.status();
    if (!allowed.ok()) {
      Done(allowed);
      return;
    }
    principal_ = *std::move(p);
    svc_->Register(this);
    Read();
  }

  // For the idle watchdog (services/common/idle_read.h): since when the
  // stream has waited for the client's next message; nullopt while the
  // store itself works (a slow fsync is not the client's idleness).
  std::optional<absl::Time> waiting_since() const { return idle_.since(); }
  // Called by the watchdog under upload_mu_, while registered (so before
  // Done), with what waiting_since() said: when it takes the stream, the
  // upload fails DEADLINE_EXCEEDED on the executor.
  void CancelIdle(absl::Time since) {
    if (!idle_.Take(since)) return;
    svc_->executor_->Schedule([this] {
      Fail(absl::DeadlineExceededError(
          absl::StrCat("upload idle for ", absl::FormatDuration(svc_->options_.upload_idle_timeout),
                       " (no message from the client); the store ended it")));
    });
  }

  void OnReadDone(bool ok) override {
    if (!idle_.ReadDone()) return;  // The watchdog failed the stream.
    if (!ok) {                      // The client half-closed (or the call broke).
      HalfClosed();
      return;
    }
    // Fast path: the message is one field (1 = header, 2 = chunk); anything
    // else goes through the full protobuf parser.
    absl::StatusOr<wire::Field> field = wire::SingleField(req_);
    v1::PutSegmentRequest parsed;
    if (!field.ok()) {
      if (absl::Status s = wire::Parse(req_, &parsed); !s.ok()) {
        Fail(s);
        return;
      }
    }
    const bool is_header = field.ok() ? field->number == 1 : parsed.has_header();
    const bool is_chunk = field.ok() ? field->number == 2 : parsed.has_chunk();
    if (!ticket_.valid() && !skipping_) {
      if (!is_header) {
        Done(absl::InvalidArgumentError(
            segments_ == 0 ? absl::StrCat("the first ", method_, " message must be the header")
                           : absl::StrCat("after segment ", segments_,
                                          "'s last byte the next message must be a header")));
        return;
      }
      if (batch_ && segments_ == kMaxBatchSegments) {
        Done(absl::InvalidArgumentError(
            absl::StrCat("PutSegments takes at most ", kMaxBatchSegments, " segments a call")));
        return;
      }
      if (field.ok() && !header_.ParseFromString(field->ToString())) {
        Done(absl::InvalidArgumentError(absl::StrCat(method_, " header does not parse")));
        return;
      }
      if (!field.ok()) header_ = parsed.header();
      ++segments_;
      if (!Admit()) return;
      std::optional<absl::StatusOr<cachestore::WriteTicket>> t = svc_->store_->TryBeginWrite(spec_);
      if (t.has_value()) {
        Started(*std::move(t));
      } else {
        svc_->executor_->Schedule([this] { Started(svc_->store_->BeginWrite(spec_)); });
      }
      return;
    }
    if (!is_chunk) {
      Fail(absl::InvalidArgumentError(
          batch_ ? absl::StrCat("a header came before segment ", segments_, "'s last byte")
                 : "only one header is allowed per PutSegment stream"));
      return;
    }
    const size_t size = field.ok() ? field->size : parsed.chunk().size();
    if (size > svc_->options_.max_chunk_bytes) {
      Fail(absl::InvalidArgumentError(
          absl::StrCat("chunk of ", size, " bytes exceeds ", svc_->options_.max_chunk_bytes)));
      return;
    }
    if (skipping_) {  // A refused segment's bytes (PutSegments).
      if (size > skip_) {
        Done(absl::OutOfRangeError(absl::StrCat("oversize stream: segment ", segments_,
                                                " has fewer declared payload bytes left")));
        return;
      }
      skip_ -= size;
      skipping_ = skip_ != 0;
      Read();
      return;
    }
    if (buffer_.size() + size > ticket_.spec().payload_bytes) {
      Fail(absl::OutOfRangeError(absl::StrCat("oversize stream: more than the declared ",
                                              ticket_.spec().payload_bytes, " payload bytes")));
      return;
    }
    // Checksum each chunk as it lands, while it is still in cache.
    const size_t at = buffer_.size();
    if (field.ok()) {
      field->AppendTo(&buffer_);
    } else {
      buffer_.append(parsed.chunk());
    }
    crc_ = Crc32cExtend(crc_, buffer_.data() + at, buffer_.size() - at);
    if (streaming_) {
      received_.store(buffer_.size(), std::memory_order_release);
      KickWriter();
    }
    if (batch_ && buffer_.size() == payload_bytes_) {
      CommitSegment();  // Reads on once it has committed.
      return;
    }
    Read();
  }

  void OnDone() override { delete this; }

 private:
  static constexpr int kMaxBatchSegments = 4096;

  void HalfClosed() {
    if (batch_) {
      if (ticket_.valid() || skipping_) {
        const uint64_t got = skipping_ ? header_.payload_bytes() - skip_ : buffer_.size();
        Fail(absl::OutOfRangeError(absl::StrCat("truncated stream: segment ", segments_, " got ",
                                                got, " of ", header_.payload_bytes(),
                                                " payload bytes")));
      } else if (segments_ == 0) {
        Done(absl::InvalidArgumentError("PutSegments stream ended without a header"));
      } else if (svc_->store_->options().sync_writes) {
        // The batch's commits were not synced one by one: one WAL sync for
        // all of them before any is acknowledged.
        svc_->executor_->Schedule([this] { Answer(svc_->store_->SyncWrites()); });
      } else {
        Answer(absl::OkStatus());
      }
      return;
    }
    if (!ticket_.valid()) {
      Done(absl::InvalidArgumentError("PutSegment stream ended without a header"));
    } else if (buffer_.size() != ticket_.spec().payload_bytes) {
      Fail(absl::OutOfRangeError(absl::StrCat("truncated stream: got ", buffer_.size(), " of ",
                                              ticket_.spec().payload_bytes, " payload bytes")));
    } else {
      CommitSegment();
    }
  }

  // PutSegments' reply, once its segments are durable.
  void Answer(const absl::Status& synced) {
    if (synced.ok()) *resp_ = wire::Serialize(batch_reply_);
    Done(synced);
  }

  // The payload is complete: commits it here when the store can do it
  // without waiting, else on the executor once no writer task runs.
  void CommitSegment() {
    if (!streaming_ && TryCommitNow()) return;  // No writer task ever ran for an inline payload.
    RunAfterWrites([this] { Commit(); });
  }

  // The header's spec into spec_, its size checked and admitted against the
  // caller's uploads in flight; on failure the segment is refused (false).
  bool Admit() {
    const v1::PutSegmentHeader& h = header_;
    cachestore::WriteSpec& spec = spec_;
    spec.tenant = principal_.tenant;
    spec.session = h.session_id();
    spec.id = {h.ref().round(), h.ref().segment()};
    spec.layer_begin = h.layer_begin();
    spec.layer_end = h.layer_end();
    spec.payload_bytes = h.payload_bytes();
    spec.payload_crc32c = h.payload_crc32c();
    spec.has_round_summary = h.has_round_summary();
    spec.round_summary = h.has_round_summary() ? h.round_summary() : v1::RoundSummary();
    spec.session_ttl_seconds.reset();
    if (h.has_session_ttl_seconds()) spec.session_ttl_seconds = h.session_ttl_seconds();
    // The size's range first: a header declaring 2^64 - 1 bytes is out of
    // range, not a request that merely does not fit right now.
    const uint64_t max_segment = svc_->store_->options().max_segment_bytes;
    if (spec.payload_bytes == 0 || spec.payload_bytes > max_segment) {
      Refused(absl::OutOfRangeError(
          absl::StrCat("payload_bytes ", spec.payload_bytes, " outside [1, ", max_segment, "]")));
      return false;
    }
    if (absl::Status s = svc_->AdmitUpload(principal_.caller, spec.payload_bytes); !s.ok()) {
      Refused(s);
      return false;
    }
    inflight_bytes_ = spec.payload_bytes;
    return true;
  }

  // BeginWrite's answer: the payload is read next.
  void Started(absl::StatusOr<cachestore::WriteTicket> t) {
    const cachestore::WriteSpec& spec = spec_;
    if (!t.ok()) {
      Refused(t.status());
      return;
    }
    ticket_ = *std::move(t);
    buffer_.reserve(spec.payload_bytes);
    // buffer_ never reallocates from here on (appends stay within the
    // declared size), so the writer task reads the received bytes through
    // base_ while the callback thread appends after them.
    base_ = buffer_.data();
    payload_bytes_ = spec.payload_bytes;
    streaming_ = spec.payload_bytes > svc_->store_->options().inline_payload_max_bytes;
    // Initial metadata tells the client the header was accepted (quota and
    // room reserved) before it streams the payload. A batch's client streams
    // without waiting: its metadata comes with the reply.
    if (!batch_) StartSendInitialMetadata();
    Read();
  }

  // A segment refused at its header (nothing reserved is kept): PutSegment
  // ends; PutSegments records it and drops its bytes as they come.
  void Refused(const absl::Status& s) {
    if (!batch_) {
      Done(s);
      return;
    }
    EndSegment(s);
    skip_ = header_.payload_bytes();
    skipping_ = skip_ != 0;
    Read();
  }

  void Read() {
    idle_.Waiting();
    StartRead(&req_);
  }

  // Starts the writer task when enough has arrived and none runs.
  void KickWriter() {
    {
      absl::MutexLock lock(&write_mu_);
      if (writer_running_) return;
      const size_t received = received_.load(std::memory_order_acquire);
      if (received - streamed_ < kWriteBatch && received != payload_bytes_) return;
      writer_running_ = true;
    }
    svc_->executor_->Schedule([this] { WriteChunks(); });
  }

  // The writer task: writes what has arrived until it has caught up, then
  // runs what waited for it.
  void WriteChunks() {
    std::function<void()> then;
    for (;;) {
      size_t from, to;
      {
        absl::MutexLock lock(&write_mu_);
        from = streamed_;
        to = received_.load(std::memory_order_acquire);
        if (from == to || !write_status_.ok()) {
          writer_running_ = false;
          then = std::move(after_writes_);
          after_writes_ = nullptr;
          break;
        }
      }
      absl::Status s = svc_->store_->WriteChunk(ticket_, std::string_view(base_ + from, to - from));
      absl::MutexLock lock(&write_mu_);
      streamed_ = to;
      if (!s.ok()) write_status_ = s;
    }
    if (then) then();
  }

  // Runs `fn` on the executor once no writer task runs: at the writer's
  // end, or scheduled now when none runs.
  void RunAfterWrites(std::function<void()> fn) {
    {
      absl::MutexLock lock(&write_mu_);
      if (writer_running_) {
        after_writes_ = std::move(fn);
        return;
      }
    }
    svc_->executor_->Schedule(std::move(fn));
  }

  // A failure after the header: the writer task may be using the ticket.
  void Fail(const absl::Status& s) {
    if (!ticket_.valid()) {
      Done(s);
      return;
    }
    RunAfterWrites([this, s] { Done(s); });
  }

  void Commit() {
    absl::Status streamed;
    {
      absl::MutexLock lock(&write_mu_);
      streamed = write_status_;
    }
    if (!streamed.ok()) {
      Committed(streamed, 0);
      return;
    }
    const uint64_t bytes = ticket_.spec().payload_bytes;
    Committed(svc_->store_->CommitWrite(std::move(ticket_), std::move(buffer_), crc_,
                                        /*defer_sync=*/batch_),
              bytes);
  }

  // The commit on this (callback) thread, when the store can do it without
  // waiting; false (nothing done) when it declines.
  bool TryCommitNow() {
    const uint64_t bytes = ticket_.spec().payload_bytes;
    std::optional<absl::StatusOr<cachestore::SegmentInfo>> info =
        svc_->store_->TryCommitWrite(ticket_, buffer_, crc_, /*defer_sync=*/batch_);
    if (!info.has_value()) return false;
    Committed(*std::move(info), bytes);
    return true;
  }

  void Committed(const absl::StatusOr<cachestore::SegmentInfo>& info, uint64_t bytes) {
    if (batch_) {
      EndSegment(info.status(), info.ok() ? &*info : nullptr, bytes);
      Read();
      return;
    }
    if (info.ok()) {
      v1::PutSegmentResponse resp;
      *resp.mutable_segment() = ToProto(*info);
      resp.set_charged_bytes(bytes);
      *resp_ = wire::Serialize(resp);
    }
    Done(info.status());
  }

  // Gives back what the current segment holds (its reservation, in-flight
  // share and buffer) and readies the reactor for the next; in a batch, also
  // records the segment's outcome in the reply.
  void EndSegment(const absl::Status& s, const cachestore::SegmentInfo* info = nullptr,
                  uint64_t bytes = 0) {
    // Abort a pending write before the client hears the outcome, so that a
    // retry never meets the failed upload's reservation (ALREADY_EXISTS).
    ticket_ = cachestore::WriteTicket();
    svc_->RefundUpload(principal_.caller, inflight_bytes_);
    inflight_bytes_ = 0;
    std::string().swap(buffer_);
    crc_ = 0;
    base_ = nullptr;
    payload_bytes_ = 0;
    streaming_ = false;
    received_.store(0, std::memory_order_relaxed);
    {
      absl::MutexLock lock(&write_mu_);
      streamed_ = 0;
      write_status_ = absl::OkStatus();
    }
    if (!s.ok()) {
      LogInfo(absl::StrCat(method_, " rejected"), {{"tenant", principal_.tenant},
                                                   {"code", absl::StatusCodeToString(s.code())},
                                                   {"error", std::string(s.message())}});
    }
    if (segments_ == 0) return;  // No header yet: no segment.
    svc_->metrics_->CountSegmentPut(method_, s.ok());
    if (!batch_) return;
    v1::PutSegmentsResult* r = batch_reply_.add_results();
    *r->mutable_ref() = header_.ref();
    r->set_code(static_cast<int>(s.code()));
    r->set_message(std::string(s.message()));
    if (info != nullptr) {
      *r->mutable_segment() = ToProto(*info);
      r->set_charged_bytes(bytes);
    }
  }

  void Done(const absl::Status& s) {
    if (batch_) {
      if (ticket_.valid() || inflight_bytes_ != 0) EndSegment(absl::CancelledError("call failed"));
    } else {
      EndSegment(s);
    }
    if (batch_ && !s.ok()) {
      LogInfo("PutSegments failed", {{"tenant", principal_.tenant},
                                     {"code", absl::StatusCodeToString(s.code())},
                                     {"error", std::string(s.message())},
                                     {"results_lost", absl::StrCat(batch_reply_.results_size())}});
    }
    svc_->Unregister(this);
    svc_->metrics_->ObserveRequest(method_, absl::Now() - start_, s.ok());
    Finish(ToGrpc(s));
  }

  StoreService* const svc_;
  grpc::CallbackServerContext* const ctx_;
  grpc::ByteBuffer* const resp_;
  const absl::Time start_;
  const bool batch_;          // PutSegments.
  const std::string method_;  // For errors, logs and metrics.
  Principal principal_;
  grpc::ByteBuffer req_;
  v1::PutSegmentHeader header_;
  cachestore::WriteSpec spec_;   // From header_ (Admit).
  uint64_t inflight_bytes_ = 0;  // Admitted by svc_->AdmitUpload.
  IdleRead idle_;
  uint32_t crc_ = 0;  // CRC-32C of buffer_.
  cachestore::WriteTicket ticket_;
  std::string buffer_;
  // PutSegments: headers read so far, the reply, a refused segment's bytes
  // still to drop.
  int segments_ = 0;
  v1::PutSegmentsResponse batch_reply_;
  bool skipping_ = false;
  uint64_t skip_ = 0;
  // Streaming to the payload file (set in Begin).
  static constexpr size_t kWriteBatch = size_t{1} << 20;
  bool streaming_ = false;
  const char* base_ = nullptr;  // buffer_.data(), stable once reserved.
  uint64_t payload_bytes_ = 0;
  std::atomic<size_t> received_{0};  // Bytes of buffer_ the writer may read.
  absl::Mutex write_mu_;
  bool writer_running_ ABSL_GUARDED_BY(write_mu_) = false;
  size_t streamed_ ABSL_GUARDED_BY(write_mu_) = 0;
  absl::Status write_status_ ABSL_GUARDED_BY(write_mu_);
  std::function<void()> after_writes_ ABSL_GUARDED_BY(write_mu_);
};

void StoreService::Register(PutReactor* r) {
  absl::MutexLock lock(&upload_mu_);
  uploads_.insert(r);
}

void StoreService::Unregister(PutReactor* r) {
  absl::MutexLock lock(&upload_mu_);
  uploads_.erase(r);
}

void StoreService::WatchIdleUploads() {
  const absl::Duration timeout = options_.upload_idle_timeout;
  const absl::Duration tick = std::clamp(timeout / 4, absl::Milliseconds(10), absl::Seconds(1));
  while (!stop_.WaitForNotificationWithTimeout(tick)) {
    const absl::Time now = absl::Now();
    absl::MutexLock lock(&upload_mu_);
    for (PutReactor* r : uploads_) {
      std::optional<absl::Time> since = r->waiting_since();
      if (since.has_value() && now - *since > timeout) r->CancelIdle(*since);
    }
  }
}

grpc::ServerReadReactor<grpc::ByteBuffer>* StoreService::PutSegment(
    grpc::CallbackServerContext* ctx, grpc::ByteBuffer* response) {
  return new PutReactor(this, ctx, response, /*batch=*/false);
}

grpc::ServerReadReactor<grpc::ByteBuffer>* StoreService::PutSegments(
    grpc::CallbackServerContext* ctx, grpc::ByteBuffer* response) {
  return new PutReactor(this, ctx, response, /*batch=*/true);
}

// ---- GetSegments ----

// Checks every ref and counts the recall (index work under the store's lock,
// no I/O: on the callback thread), then streams each segment as a header plus
// ~1 MiB chunks, or, to a client that accepts batches, small segments whole,
// several to a message. A segment in RAM is taken on the callback thread too
// (Store::TryReadSegment); one that must be read from disk is loaded on the
// executor. The next segment is loaded when the previous one has been
// written (or batched).
class StoreService::GetReactor : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  GetReactor(StoreService* svc, grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* raw)
      : svc_(svc), ctx_(ctx), start_(absl::Now()) {
    auto p = svc_->auth_->Authenticate(*ctx_);
    if (!p.ok()) {
      Done(p.status());
      return;
    }
    principal_ = *std::move(p);
    if (absl::Status s = wire::Parse(*raw, &request_); !s.ok()) {
      Done(s);
      return;
    }
    if (request_.refs_size() == 0 || request_.refs_size() > svc_->options_.max_refs) {
      Done(absl::InvalidArgumentError(absl::StrCat("GetSegments takes 1 to ",
                                                   svc_->options_.max_refs, " refs, got ",
                                                   request_.refs_size())));
      return;
    }
    absl::flat_hash_set<std::pair<uint32_t, uint32_t>> seen;
    for (const auto& r : request_.refs()) {
      if (!seen.insert({r.round(), r.segment()}).second) {
        Done(absl::InvalidArgumentError(absl::StrCat("GetSegments names round ", r.round(),
                                                     " segment ", r.segment(), " twice")));
        return;
      }
    }
    Prepare();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Done(absl::CancelledError("client went away during GetSegments"));
      return;
    }
    Pump();
  }

  void OnDone() override { delete this; }

 private:
  // Segments up to this size go whole into a batch (request.accept_batches).
  static constexpr size_t kBatchSegmentMax = size_t{256} << 10;

  void Prepare() {
    std::vector<SegmentId> ids;
    ids.reserve(request_.refs_size());
    for (const auto& r : request_.refs()) ids.push_back({r.round(), r.segment()});
    absl::StatusOr<std::vector<cachestore::SegmentInfo>> infos =
        svc_->store_->PrepareRead(principal_.tenant, request_.session_id(), ids,
                                  svc_->options_.max_get_bytes, !request_.uncounted());
    if (!infos.ok()) {
      Done(infos.status());
      return;
    }
    ids_ = std::move(ids);
    Pump();
  }

  // Starts the next write: the current segment's header or next chunk, or a
  // batch, loading segments as needed (those in RAM here, one on disk on the
  // executor, which comes back with it in `loaded`); finishes the call after
  // the last. Called once at the start, after each write, and after a disk
  // read: never two at a time.
  void Pump(std::optional<absl::StatusOr<cachestore::ReadResult>> loaded = std::nullopt) {
    for (;;) {
      if (current_.payload != nullptr) {
        if (WriteCurrent()) return;
        current_ = {};
      }
      if (next_ == ids_.size()) {
        if (!batch_.empty()) {
          WriteBatch();
          return;
        }
        Done(absl::OkStatus());
        return;
      }
      if (!loaded.has_value()) {
        loaded =
            svc_->store_->TryReadSegment(principal_.tenant, request_.session_id(), ids_[next_]);
      }
      if (!loaded.has_value()) {
        // On disk: what is batched goes first; the read comes after it.
        if (!batch_.empty()) {
          WriteBatch();
          return;
        }
        svc_->executor_->Schedule([this] {
          Pump(svc_->store_->ReadSegment(principal_.tenant, request_.session_id(), ids_[next_]));
        });
        return;
      }
      absl::StatusOr<cachestore::ReadResult> r = *std::move(loaded);
      loaded.reset();
      if (!r.ok()) {
        Done(r.status());
        return;
      }
      ++next_;
      bytes_sent_ += r->payload->size();
      if (request_.accept_batches() &&
          r->payload->size() <= std::min(kBatchSegmentMax, svc_->options_.chunk_bytes)) {
        AddToBatch(*r);
        if (batch_bytes_ >= svc_->options_.chunk_bytes) {
          WriteBatch();
          return;
        }
        continue;
      }
      current_ = *std::move(r);
      header_sent_ = false;
      offset_ = 0;
      if (!batch_.empty()) {
        WriteBatch();
        return;
      }
    }
  }

  v1::GetSegmentsHeader HeaderOf(const cachestore::ReadResult& r) const {
    v1::GetSegmentsHeader h;
    *h.mutable_segment() = ToProto(r.info);
    h.set_served_from(r.served_from == cachestore::Tier::kRam ? v1::TIER_RAM : v1::TIER_DISK);
    return h;
  }

  // The current segment's header, then its chunks: true when a write
  // started, false when the segment has been sent whole.
  bool WriteCurrent() {
    if (!header_sent_) {
      header_sent_ = true;
      v1::GetSegmentsResponse header;
      *header.mutable_header() = HeaderOf(current_);
      msg_ = wire::Serialize(header);
      StartWrite(&msg_);
      return true;
    }
    const std::string& p = *current_.payload;
    if (offset_ == p.size()) return false;
    const size_t n = std::min(svc_->options_.chunk_bytes, p.size() - offset_);
    // No copy: the slice points into the payload, which it keeps alive.
    msg_ = wire::BytesFieldMessage(2, p.data() + offset_, n, current_.payload);
    offset_ += n;
    StartWrite(&msg_);
    return true;
  }

  // A GetSegmentsBatchItem of `r` into the batch being built: its framing
  // and header (small, copied into the message) and its payload (referenced).
  void AddToBatch(const cachestore::ReadResult& r) {
    const std::string header = HeaderOf(r).SerializeAsString();
    const size_t payload = r.payload->size();
    std::string item;  // Item.header, then the head of Item.payload.
    wire::AppendLengthDelimitedHead(1, header.size(), &item);
    item += header;
    wire::AppendLengthDelimitedHead(2, payload, &item);
    auto framing = std::make_shared<std::string>();  // Batch.segments' head, then the above.
    wire::AppendLengthDelimitedHead(1, item.size() + payload, framing.get());
    *framing += item;
    batch_bytes_ += framing->size() + payload;
    batch_.push_back({framing->data(), framing->size(), framing});
    batch_.push_back({r.payload->data(), payload, r.payload});
  }

  void WriteBatch() {
    constexpr int kBatchField = 3;  // GetSegmentsResponse.batch
    msg_ = wire::BytesFieldMessage(kBatchField, batch_);
    batch_.clear();
    batch_bytes_ = 0;
    StartWrite(&msg_);
  }

  void Done(const absl::Status& s) {
    svc_->metrics_->ObserveRequest("GetSegments", absl::Now() - start_, s.ok());
    Finish(ToGrpc(s));
  }

  StoreService* const svc_;
  grpc::CallbackServerContext* const ctx_;
  v1::GetSegmentsRequest request_;
  const absl::Time start_;
  Principal principal_;
  std::vector<SegmentId> ids_;
  size_t next_ = 0;                 // The next segment to load.
  cachestore::ReadResult current_;  // A segment sent as a header and chunks.
  bool header_sent_ = false;
  size_t offset_ = 0;
  std::vector<wire::BytesPiece> batch_;  // The batch being built.
  size_t batch_bytes_ = 0;
  uint64_t bytes_sent_ = 0;
  grpc::ByteBuffer msg_;
};

grpc::ServerWriteReactor<grpc::ByteBuffer>* StoreService::GetSegments(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request) {
  return new GetReactor(this, ctx, request);
}

// ---- Unary calls ----

template <typename Req, typename Resp, typename Work>
grpc::ServerUnaryReactor* StoreService::Unary(grpc::CallbackServerContext* ctx, const char* method,
                                              bool write, const grpc::ByteBuffer* raw,
                                              grpc::ByteBuffer* out, Work work) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const absl::Time start = absl::Now();
  absl::StatusOr<Principal> p = auth_->Authenticate(*ctx);
  absl::Status denied = p.ok() && write ? Authenticator::RequireWrite(*p) : p.status();
  if (!denied.ok()) {
    metrics_->ObserveRequest(method, absl::Now() - start, false);
    reactor->Finish(ToGrpc(denied));
    return reactor;
  }
  executor_->Schedule([this, reactor, method, start, raw, out, principal = *std::move(p),
                       work = std::move(work)]() mutable {
    Req req;
    Resp resp;
    absl::Status s = wire::Parse(*raw, &req);
    if (s.ok()) s = work(principal, &req, &resp);
    if (s.ok()) *out = wire::Serialize(resp);
    metrics_->ObserveRequest(method, absl::Now() - start, s.ok());
    reactor->Finish(ToGrpc(s));
  });
  return reactor;
}

grpc::ServerUnaryReactor* StoreService::ListRounds(grpc::CallbackServerContext* ctx,
                                                   const grpc::ByteBuffer* raw,
                                                   grpc::ByteBuffer* out) {
  return Unary<v1::ListRoundsRequest, v1::ListRoundsResponse>(
      ctx, "ListRounds", false, raw, out,
      [this](const Principal& p, const v1::ListRoundsRequest* req,
             v1::ListRoundsResponse* resp) -> absl::Status {
        absl::StatusOr<cachestore::SessionInfo> info =
            store_->ListRounds(p.tenant, req->session_id());
        if (!info.ok()) return info.status();
        resp->set_pinned(info->pinned);
        resp->set_ttl_seconds(info->ttl_seconds);
        for (const auto& r : info->rounds) {
          v1::RoundInfo* out = resp->add_rounds();
          out->set_round(r.round);
          *out->mutable_summary() = r.summary;
          for (const auto& s : r.segments) *out->add_segments() = ToProto(s);
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* StoreService::DropRounds(grpc::CallbackServerContext* ctx,
                                                   const grpc::ByteBuffer* raw,
                                                   grpc::ByteBuffer* out) {
  return Unary<v1::DropRoundsRequest, v1::DropRoundsResponse>(
      ctx, "DropRounds", true, raw, out,
      [this](const Principal& p, const v1::DropRoundsRequest* req,
             v1::DropRoundsResponse* resp) -> absl::Status {
        if (req->rounds_size() == 0 || req->rounds_size() > 4096) {
          return absl::InvalidArgumentError("DropRounds takes 1 to 4096 rounds");
        }
        std::vector<uint32_t> rounds(req->rounds().begin(), req->rounds().end());
        auto r = store_->DropRounds(p.tenant, req->session_id(), rounds);
        if (!r.ok()) return r.status();
        for (uint32_t x : r->dropped) resp->add_dropped(x);
        for (uint32_t x : r->not_found) resp->add_not_found(x);
        resp->set_freed_bytes(r->freed_bytes);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* StoreService::DropSegments(grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* raw,
                                                     grpc::ByteBuffer* out) {
  return Unary<v1::DropSegmentsRequest, v1::DropSegmentsResponse>(
      ctx, "DropSegments", true, raw, out,
      [this](const Principal& p, const v1::DropSegmentsRequest* req,
             v1::DropSegmentsResponse* resp) -> absl::Status {
        if (req->segments_size() == 0 || req->segments_size() > 4096) {
          return absl::InvalidArgumentError("DropSegments takes 1 to 4096 segments");
        }
        std::vector<cachestore::SegmentId> ids;
        ids.reserve(req->segments_size());
        for (const v1::SegmentRef& r : req->segments()) ids.push_back({r.round(), r.segment()});
        auto r = store_->DropSegments(p.tenant, req->session_id(), ids);
        if (!r.ok()) return r.status();
        for (const cachestore::SegmentId& x : r->dropped) {
          v1::SegmentRef* ref = resp->add_dropped();
          ref->set_round(x.round);
          ref->set_segment(x.segment);
        }
        for (const cachestore::SegmentId& x : r->not_found) {
          v1::SegmentRef* ref = resp->add_not_found();
          ref->set_round(x.round);
          ref->set_segment(x.segment);
        }
        resp->set_freed_bytes(r->freed_bytes);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* StoreService::RecordRecalls(grpc::CallbackServerContext* ctx,
                                                      const grpc::ByteBuffer* raw,
                                                      grpc::ByteBuffer* out) {
  return Unary<v1::RecordRecallsRequest, v1::RecordRecallsResponse>(
      ctx, "RecordRecalls", true, raw, out,
      [this](const Principal& p, const v1::RecordRecallsRequest* req,
             v1::RecordRecallsResponse* resp) -> absl::Status {
        if (req->rounds_size() == 0 || req->rounds_size() > 4096) {
          return absl::InvalidArgumentError("RecordRecalls takes 1 to 4096 rounds");
        }
        std::vector<uint32_t> rounds(req->rounds().begin(), req->rounds().end());
        auto r = store_->RecordRecalls(p.tenant, req->session_id(), rounds);
        if (!r.ok()) return r.status();
        for (uint32_t x : r->counted) resp->add_counted(x);
        for (uint32_t x : r->not_found) resp->add_not_found(x);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* StoreService::DeleteSession(grpc::CallbackServerContext* ctx,
                                                      const grpc::ByteBuffer* raw,
                                                      grpc::ByteBuffer* out) {
  return Unary<v1::DeleteSessionRequest, v1::DeleteSessionResponse>(
      ctx, "DeleteSession", true, raw, out,
      [this](const Principal& p, const v1::DeleteSessionRequest* req,
             v1::DeleteSessionResponse* resp) -> absl::Status {
        auto r = store_->DeleteSession(p.tenant, req->session_id());
        if (!r.ok()) return r.status();
        resp->set_freed_bytes(r->freed_bytes);
        resp->set_rounds_deleted(static_cast<uint32_t>(r->dropped.size()));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* StoreService::PinSession(grpc::CallbackServerContext* ctx,
                                                   const grpc::ByteBuffer* raw,
                                                   grpc::ByteBuffer* out) {
  return Unary<v1::PinSessionRequest, v1::PinSessionResponse>(
      ctx, "PinSession", true, raw, out,
      [this](const Principal& p, const v1::PinSessionRequest* req, v1::PinSessionResponse*) {
        return store_->PinSession(p.tenant, req->session_id(), req->pinned());
      });
}

grpc::ServerUnaryReactor* StoreService::ListSessions(grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* raw,
                                                     grpc::ByteBuffer* out) {
  return Unary<v1::ListSessionsRequest, v1::ListSessionsResponse>(
      ctx, "ListSessions", false, raw, out,
      [this](const Principal& p, const v1::ListSessionsRequest* req,
             v1::ListSessionsResponse* resp) -> absl::Status {
        if (req->limit() > 10000) {
          return absl::InvalidArgumentError("ListSessions takes a limit of at most 10000");
        }
        if (!req->start_after().empty()) {
          KVT_RETURN_IF_ERROR(ValidateName("start_after", req->start_after()));
        }
        const size_t limit = req->limit() == 0 ? 1000 : req->limit();
        const int64_t min_idle_ms =
            static_cast<int64_t>(std::min<uint64_t>(req->min_idle_seconds(), uint64_t{1} << 40)) *
            1000;
        cachestore::Store::SessionPage page =
            store_->ListSessions(p.tenant, min_idle_ms, limit, req->start_after());
        for (const auto& s : page.sessions) {
          v1::SessionSummary* out = resp->add_sessions();
          out->set_session_id(s.session);
          out->set_idle_seconds(static_cast<uint64_t>(s.idle_ms / 1000));
          out->set_rounds(s.rounds);
          out->set_bytes(s.bytes);
          out->set_pinned(s.pinned);
          out->set_ttl_seconds(s.ttl_seconds);
        }
        resp->set_next_start_after(std::move(page.next_start_after));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* StoreService::Stats(grpc::CallbackServerContext* ctx,
                                              const grpc::ByteBuffer* raw, grpc::ByteBuffer* out) {
  return Unary<v1::StatsRequest, v1::StatsResponse>(
      ctx, "Stats", false, raw, out,
      [this](const Principal& p, const v1::StatsRequest*, v1::StatsResponse* resp) {
        cachestore::StoreStats s = store_->Stats();
        auto tier = [&](v1::Tier t, uint64_t bytes, uint64_t segs, uint64_t budget) {
          v1::TierStats* ts = resp->add_tiers();
          ts->set_tier(t);
          ts->set_bytes(bytes);
          ts->set_segments(segs);
          ts->set_budget_bytes(budget);
        };
        tier(v1::TIER_RAM, s.ram_bytes, s.ram_segments, s.ram_budget_bytes);
        tier(v1::TIER_DISK, s.disk_bytes, s.disk_segments, s.disk_budget_bytes);
        resp->set_sessions(s.sessions);
        resp->set_hits_ram(s.hits_ram);
        resp->set_hits_disk(s.hits_disk);
        resp->set_spills(s.spills);
        resp->set_promotions(s.promotions);
        resp->set_drops(s.drops);
        resp->set_expired_sessions(s.expired_sessions);
        cachestore::TenantUsage u = quotas_->Usage(p.tenant);
        resp->set_tenant(p.tenant);
        resp->set_tenant_bytes(u.used_bytes);
        resp->set_tenant_quota_bytes(u.quota_bytes);
        resp->set_tenant_sessions(store_->TenantSessions(p.tenant));
        const ProcessMemory m = ReadProcessMemory();
        v1::ProcessMemory* pm = resp->mutable_memory();
        pm->set_resident_bytes(m.resident_bytes);
        pm->set_peak_resident_bytes(m.peak_resident_bytes);
        pm->set_heap_in_use_bytes(m.heap_in_use_bytes);
        pm->set_heap_free_bytes(m.heap_free_bytes);
        return absl::OkStatus();
      });
}

}  // namespace kvtier
