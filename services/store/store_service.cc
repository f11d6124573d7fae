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
#include "cachestore/upload.h"
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

namespace {

cachestore::WriteSpec SpecOf(const std::string& tenant, const v1::PutSegmentHeader& h) {
  cachestore::WriteSpec spec;
  spec.tenant = tenant;
  spec.session = h.session_id();
  spec.id = {h.ref().round(), h.ref().segment()};
  spec.layer_begin = h.layer_begin();
  spec.layer_end = h.layer_end();
  spec.payload_bytes = h.payload_bytes();
  spec.payload_crc32c = h.payload_crc32c();
  spec.has_round_summary = h.has_round_summary();
  if (h.has_round_summary()) spec.round_summary = h.round_summary();
  if (h.has_session_ttl_seconds()) spec.session_ttl_seconds = h.session_ttl_seconds();
  return spec;
}

// A successful upload's reply: PutSegmentsResponse with every segment's
// outcome, or PutSegment's one committed segment.
grpc::ByteBuffer ReplyOf(const std::vector<cachestore::UploadResult>& results, bool batch) {
  if (!batch) {
    v1::PutSegmentResponse reply;
    if (!results.empty() && results[0].info.has_value()) {
      *reply.mutable_segment() = kvtier::ToProto(*results[0].info);
      reply.set_charged_bytes(results[0].charged_bytes);
    }
    return wire::Serialize(reply);
  }
  v1::PutSegmentsResponse reply;
  for (const cachestore::UploadResult& x : results) {
    v1::PutSegmentsResult* r = reply.add_results();
    r->mutable_ref()->set_round(x.id.round);
    r->mutable_ref()->set_segment(x.id.segment);
    r->set_code(static_cast<int>(x.status.code()));
    r->set_message(std::string(x.status.message()));
    if (x.info.has_value()) {
      *r->mutable_segment() = kvtier::ToProto(*x.info);
      r->set_charged_bytes(x.charged_bytes);
    }
  }
  return wire::Serialize(reply);
}

}  // namespace

// The transport of one upload (cachestore/upload.h holds its logic): checks
// the caller, turns each message into the upload's event (parsing only the
// header; a chunk's bytes are appended from gRPC's slices), runs what the
// upload schedules on the executor, and answers. The idle watchdog
// (services/common/idle_read.h) fails a stream whose client went silent.
class StoreService::PutReactor : public grpc::ServerReadReactor<grpc::ByteBuffer>,
                                 private cachestore::UploadCall {
 public:
  PutReactor(StoreService* svc, grpc::CallbackServerContext* ctx, grpc::ByteBuffer* resp,
             bool batch)
      : svc_(svc),
        resp_(resp),
        start_(absl::Now()),
        batch_(batch),
        method_(batch ? "PutSegments" : "PutSegment"),
        upload_(
            svc->store_, this,
            {.batch = batch, .method = method_, .max_chunk_bytes = svc->options_.max_chunk_bytes}) {
    absl::StatusOr<Principal> p = svc_->auth_->Authenticate(*ctx);
    absl::Status allowed = p.ok() ? Authenticator::RequireWrite(*p) : p.status();
    if (!allowed.ok()) {
      Answer(allowed, {});
      return;
    }
    principal_ = *std::move(p);
    svc_->Register(this);
    registered_ = true;
    upload_.Start();
  }

  // For the watchdog: since when the stream has waited for the client's
  // next message; nullopt while the store itself works (a slow fsync is not
  // the client's idleness).
  std::optional<absl::Time> waiting_since() const { return idle_.since(); }
  // Called by the watchdog under upload_mu_, while registered (so before
  // the answer), with what waiting_since() said: when it takes the stream,
  // the upload fails DEADLINE_EXCEEDED on the executor.
  void CancelIdle(absl::Time since) {
    if (!idle_.Take(since)) return;
    svc_->executor_->Schedule([this] {
      upload_.Fail(absl::DeadlineExceededError(
          absl::StrCat("upload idle for ", absl::FormatDuration(svc_->options_.upload_idle_timeout),
                       " (no message from the client); the store ended it")));
    });
  }

  void OnReadDone(bool ok) override {
    if (!idle_.ReadDone()) return;  // The watchdog failed the stream.
    if (!ok) {                      // The client half-closed (or the call broke).
      upload_.OnHalfClose();
      return;
    }
    // Fast path: the message is one field (1 = header, 2 = chunk); anything
    // else goes through the full protobuf parser.
    absl::StatusOr<wire::Field> field = wire::SingleField(req_);
    v1::PutSegmentRequest parsed;
    if (!field.ok()) {
      if (absl::Status s = wire::Parse(req_, &parsed); !s.ok()) {
        upload_.Fail(s);
        return;
      }
    }
    if (field.ok() ? field->number == 1 : parsed.has_header()) {
      v1::PutSegmentHeader h;
      if (field.ok() && !h.ParseFromString(field->ToString())) {
        upload_.OnHeader(absl::InvalidArgumentError("not a PutSegmentHeader"));
        return;
      }
      upload_.OnHeader(SpecOf(principal_.tenant, field.ok() ? h : parsed.header()));
    } else if (field.ok() ? field->number == 2 : parsed.has_chunk()) {
      upload_.OnChunk(field.ok() ? field->size : parsed.chunk().size(), [&](std::string* out) {
        if (field.ok()) {
          field->AppendTo(out);
        } else {
          out->append(parsed.chunk());
        }
      });
    } else {
      upload_.OnOtherMessage();
    }
  }

  void OnDone() override { delete this; }

 private:
  // cachestore::UploadCall.
  void Read() override {
    idle_.Waiting();
    StartRead(&req_);
  }
  void HeaderAccepted() override { StartSendInitialMetadata(); }
  void Schedule(std::function<void()> task) override { svc_->executor_->Schedule(std::move(task)); }
  absl::Status Admit(uint64_t bytes) override {
    return svc_->AdmitUpload(principal_.caller, bytes);
  }
  void Refund(uint64_t bytes) override { svc_->RefundUpload(principal_.caller, bytes); }
  void SegmentDone(const absl::Status& s) override {
    svc_->metrics_->CountSegmentPut(method_, s);
    if (!s.ok()) {
      LogInfo(absl::StrCat(method_, " rejected"), {{"tenant", principal_.tenant},
                                                   {"code", absl::StatusCodeToString(s.code())},
                                                   {"error", std::string(s.message())}});
    }
  }
  void Finish(const absl::Status& s, std::vector<cachestore::UploadResult> results) override {
    Answer(s, std::move(results));
  }

  void Answer(const absl::Status& s, std::vector<cachestore::UploadResult> results) {
    if (s.ok()) *resp_ = ReplyOf(results, batch_);
    if (!s.ok() && (batch_ || upload_.segments() == 0)) {
      LogInfo(absl::StrCat(method_, " failed"), {{"tenant", principal_.tenant},
                                                 {"code", absl::StatusCodeToString(s.code())},
                                                 {"error", std::string(s.message())},
                                                 {"results_lost", absl::StrCat(results.size())}});
    }
    if (registered_) svc_->Unregister(this);
    svc_->metrics_->ObserveRequest(method_, absl::Now() - start_, s);
    grpc::ServerReadReactor<grpc::ByteBuffer>::Finish(ToGrpc(s));
  }

  StoreService* const svc_;
  grpc::ByteBuffer* const resp_;
  const absl::Time start_;
  const bool batch_;          // PutSegments.
  const std::string method_;  // For errors, logs and metrics.
  Principal principal_;
  bool registered_ = false;  // With the watchdog.
  grpc::ByteBuffer req_;
  IdleRead idle_;
  cachestore::Upload upload_;
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
    const bool many = request_.ref_sessions_size() > 0;
    if (many &&
        (request_.ref_sessions_size() != request_.refs_size() || !request_.session_id().empty())) {
      Done(absl::InvalidArgumentError(absl::StrCat(
          "GetSegments with ref_sessions takes one session per ref (", request_.refs_size(),
          " refs, ", request_.ref_sessions_size(), " sessions) and no session_id")));
      return;
    }
    absl::flat_hash_set<std::tuple<std::string_view, uint32_t, uint32_t>> seen;
    for (int i = 0; i < request_.refs_size(); ++i) {
      const auto& r = request_.refs(i);
      if (!seen.insert({SessionOf(i), r.round(), r.segment()}).second) {
        Done(absl::InvalidArgumentError(absl::StrCat("GetSegments names session ", SessionOf(i),
                                                     " round ", r.round(), " segment ", r.segment(),
                                                     " twice")));
        return;
      }
    }
    if (many) {
      PrepareMany();
    } else {
      Prepare();
    }
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
    absl::StatusOr<std::vector<cachestore::SegmentInfo>> infos = svc_->store_->PrepareRead(
        principal_.tenant, request_.session_id(), ids, svc_->options_.max_get_bytes,
        !request_.uncounted(), request_.missing_ok() ? &missing_ : nullptr);
    if (!infos.ok()) {
      Done(infos.status());
      return;
    }
    ids_ = std::move(ids);
    Pump();
  }

  const std::string& SessionOf(size_t i) const {
    return request_.ref_sessions_size() > 0 ? request_.ref_sessions(static_cast<int>(i))
                                            : request_.session_id();
  }

  // Prepare for refs of several sessions: each session's refs are checked
  // together, in order of first appearance, within one byte budget.
  void PrepareMany() {
    const int n = request_.refs_size();
    ids_.resize(n);
    missing_.assign(n, false);
    std::vector<std::string_view> order;
    absl::flat_hash_map<std::string_view, std::vector<int>> by_session;
    for (int i = 0; i < n; ++i) {
      ids_[i] = {request_.refs(i).round(), request_.refs(i).segment()};
      auto [it, fresh] = by_session.try_emplace(SessionOf(i));
      if (fresh) order.push_back(it->first);
      it->second.push_back(i);
    }
    uint64_t budget = svc_->options_.max_get_bytes;
    for (std::string_view session : order) {
      const std::vector<int>& refs = by_session[session];
      std::vector<SegmentId> ids;
      ids.reserve(refs.size());
      for (int i : refs) ids.push_back(ids_[i]);
      std::vector<bool> missing;
      absl::StatusOr<std::vector<cachestore::SegmentInfo>> infos = svc_->store_->PrepareRead(
          principal_.tenant, std::string(session), ids, budget, !request_.uncounted(),
          request_.missing_ok() ? &missing : nullptr);
      if (!infos.ok() && absl::IsNotFound(infos.status()) && request_.missing_ok()) {
        for (int i : refs) missing_[i] = true;  // An unknown session.
        continue;
      }
      if (!infos.ok()) {
        Done(infos.status());
        return;
      }
      for (size_t j = 0; j < refs.size(); ++j) {
        if (j < missing.size() && missing[j]) missing_[refs[j]] = true;
      }
      for (const cachestore::SegmentInfo& info : *infos) budget -= info.payload_bytes;
    }
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
      if (!loaded.has_value() && !missing_.empty() && missing_[next_]) {
        loaded = absl::NotFoundError("not stored");  // Answered as missing below.
      }
      if (!loaded.has_value()) {
        loaded = svc_->store_->TryReadSegment(principal_.tenant, SessionOf(next_), ids_[next_]);
      }
      if (!loaded.has_value()) {
        // On disk: what is batched goes first; the read comes after it.
        if (!batch_.empty()) {
          WriteBatch();
          return;
        }
        svc_->executor_->Schedule([this] {
          Pump(svc_->store_->ReadSegment(principal_.tenant, SessionOf(next_), ids_[next_]));
        });
        return;
      }
      absl::StatusOr<cachestore::ReadResult> r = *std::move(loaded);
      loaded.reset();
      bool gone = false;
      if (!r.ok() && absl::IsNotFound(r.status()) && request_.missing_ok()) {
        // Not stored (or dropped since PrepareRead): a header saying so,
        // and no bytes.
        cachestore::ReadResult m;
        m.info.id = ids_[next_];
        m.payload = std::make_shared<const std::string>();
        r = std::move(m);
        gone = true;
      }
      if (!r.ok()) {
        Done(r.status());
        return;
      }
      ++next_;
      bytes_sent_ += r->payload->size();
      if (request_.accept_batches() &&
          r->payload->size() <= std::min(kBatchSegmentMax, svc_->options_.chunk_bytes)) {
        AddToBatch(*r, gone);
        if (batch_bytes_ >= svc_->options_.chunk_bytes) {
          WriteBatch();
          return;
        }
        continue;
      }
      current_ = *std::move(r);
      current_missing_ = gone;
      header_sent_ = false;
      offset_ = 0;
      if (!batch_.empty()) {
        WriteBatch();
        return;
      }
    }
  }

  // `missing`: only the ref, flagged (GetSegmentsRequest.missing_ok).
  v1::GetSegmentsHeader HeaderOf(const cachestore::ReadResult& r, bool missing) const {
    v1::GetSegmentsHeader h;
    if (missing) {
      h.mutable_segment()->mutable_ref()->set_round(r.info.id.round);
      h.mutable_segment()->mutable_ref()->set_segment(r.info.id.segment);
      h.set_missing(true);
      return h;
    }
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
      *header.mutable_header() = HeaderOf(current_, current_missing_);
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
  void AddToBatch(const cachestore::ReadResult& r, bool missing) {
    const std::string header = HeaderOf(r, missing).SerializeAsString();
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
    svc_->metrics_->ObserveRequest("GetSegments", absl::Now() - start_, s);
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
  bool current_missing_ = false;    // current_ is not stored: its header says so.
  std::vector<bool> missing_;       // Per id, with missing_ok: not stored.
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
    metrics_->ObserveRequest(method, absl::Now() - start, denied);
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
    metrics_->ObserveRequest(method, absl::Now() - start, s);
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

grpc::ServerUnaryReactor* StoreService::LookupChain(grpc::CallbackServerContext* ctx,
                                                    const grpc::ByteBuffer* raw,
                                                    grpc::ByteBuffer* out) {
  return Unary<v1::LookupChainRequest, v1::LookupChainResponse>(
      ctx, "LookupChain", false, raw, out,
      [this](const Principal& p, const v1::LookupChainRequest* req,
             v1::LookupChainResponse* resp) -> absl::Status {
        if (req->session_ids_size() == 0 || req->session_ids_size() > 4096) {
          return absl::InvalidArgumentError("LookupChain takes 1 to 4096 session ids");
        }
        std::vector<std::string> ids(req->session_ids().begin(), req->session_ids().end());
        auto r = store_->LookupChain(p.tenant, ids);
        if (!r.ok()) return r.status();
        resp->set_found(r->found);
        resp->set_found_bytes(r->found_bytes);
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
