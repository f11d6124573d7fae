#include "cachestore/upload.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/crc32c.h"

namespace kvtier::cachestore {

const char* UploadStateName(Upload::State s) {
  switch (s) {
    case Upload::State::kHeader:
      return "header";
    case Upload::State::kBeginning:
      return "beginning";
    case Upload::State::kPayload:
      return "payload";
    case Upload::State::kSkipping:
      return "skipping";
    case Upload::State::kCommitting:
      return "committing";
    case Upload::State::kSyncing:
      return "syncing";
    case Upload::State::kFailing:
      return "failing";
    case Upload::State::kDone:
      return "done";
  }
  return "?";
}

Upload::Upload(Store* store, UploadCall* call, Options options)
    : store_(store), call_(call), options_(std::move(options)) {}

void Upload::Start() { Read(); }

void Upload::Read() { call_->Read(); }

void Upload::OnHeader(absl::StatusOr<WriteSpec> spec) {
  if (state_ == State::kPayload || state_ == State::kSkipping) {
    Fail(absl::InvalidArgumentError(
        options_.batch
            ? absl::StrCat("a header came before segment ", segments_, "'s last byte")
            : absl::StrCat("only one header is allowed per ", options_.method, " stream")));
    return;
  }
  if (options_.batch && segments_ == options_.max_batch_segments) {
    Done(absl::InvalidArgumentError(absl::StrCat(options_.method, " takes at most ",
                                                 options_.max_batch_segments, " segments a call")));
    return;
  }
  if (!spec.ok()) {
    Done(absl::InvalidArgumentError(
        absl::StrCat(options_.method, " header does not parse: ", spec.status().message())));
    return;
  }
  spec_ = *std::move(spec);
  ++segments_;
  if (!Admit()) return;
  std::optional<absl::StatusOr<WriteTicket>> t = store_->TryBeginWrite(spec_);
  if (t.has_value()) {
    Started(*std::move(t));
    return;
  }
  state_ = State::kBeginning;
  call_->Schedule([this] { Started(store_->BeginWrite(spec_)); });
}

void Upload::OnChunk(size_t size, absl::FunctionRef<void(std::string*)> append) {
  if (state_ == State::kHeader) {
    OnOtherMessage();
    return;
  }
  if (size > options_.max_chunk_bytes) {
    Fail(absl::InvalidArgumentError(
        absl::StrCat("chunk of ", size, " bytes exceeds ", options_.max_chunk_bytes)));
    return;
  }
  if (state_ == State::kSkipping) {
    if (size > skip_) {
      Done(absl::OutOfRangeError(absl::StrCat("oversize stream: segment ", segments_,
                                              " has fewer declared payload bytes left")));
      return;
    }
    skip_ -= size;
    if (skip_ == 0) state_ = State::kHeader;
    Read();
    return;
  }
  if (buffer_.size() + size > payload_bytes_) {
    Fail(absl::OutOfRangeError(absl::StrCat("oversize stream: more than the declared ",
                                            payload_bytes_, " payload bytes")));
    return;
  }
  // Checksum each chunk as it lands, while it is still in cache.
  const size_t at = buffer_.size();
  append(&buffer_);
  crc_ = Crc32cExtend(crc_, buffer_.data() + at, buffer_.size() - at);
  if (streaming_) {
    received_.store(buffer_.size(), std::memory_order_release);
    KickWriter();
  }
  if (options_.batch && buffer_.size() == payload_bytes_) {
    CommitSegment();  // Reads on once it has committed.
    return;
  }
  Read();
}

void Upload::OnOtherMessage() {
  if (state_ == State::kHeader) {
    Done(absl::InvalidArgumentError(
        segments_ == 0 ? absl::StrCat("the first ", options_.method, " message must be the header")
                       : absl::StrCat("after segment ", segments_,
                                      "'s last byte the next message must be a header")));
    return;
  }
  Fail(absl::InvalidArgumentError(absl::StrCat(options_.method, " segment ", segments_,
                                               ": a message that is neither header nor chunk")));
}

void Upload::OnHalfClose() {
  const bool in_segment = state_ == State::kPayload || state_ == State::kSkipping;
  if (options_.batch) {
    if (in_segment) {
      const uint64_t got =
          state_ == State::kSkipping ? spec_.payload_bytes - skip_ : buffer_.size();
      Fail(absl::OutOfRangeError(absl::StrCat("truncated stream: segment ", segments_, " got ", got,
                                              " of ", spec_.payload_bytes, " payload bytes")));
    } else if (segments_ == 0) {
      Done(absl::InvalidArgumentError(
          absl::StrCat(options_.method, " stream ended without a header")));
    } else if (store_->options().sync_writes) {
      // The batch's commits were not synced one by one: one WAL sync for
      // all of them before any is acknowledged.
      state_ = State::kSyncing;
      call_->Schedule([this] {
        absl::Status synced = store_->SyncWrites();
        if (!synced.ok()) {
          Done(synced);
          return;
        }
        state_ = State::kDone;
        call_->Finish(absl::OkStatus(), std::move(results_));
      });
    } else {
      state_ = State::kDone;
      call_->Finish(absl::OkStatus(), std::move(results_));
    }
    return;
  }
  if (!in_segment) {
    Done(absl::InvalidArgumentError(
        absl::StrCat(options_.method, " stream ended without a header")));
  } else if (buffer_.size() != payload_bytes_) {
    Fail(absl::OutOfRangeError(absl::StrCat("truncated stream: got ", buffer_.size(), " of ",
                                            payload_bytes_, " payload bytes")));
  } else {
    CommitSegment();
  }
}

bool Upload::Admit() {
  // The size's range first: a header declaring 2^64 - 1 bytes is out of
  // range, not a request that merely does not fit right now.
  const uint64_t max_segment = store_->options().max_segment_bytes;
  if (spec_.payload_bytes == 0 || spec_.payload_bytes > max_segment) {
    Refused(absl::OutOfRangeError(
        absl::StrCat("payload_bytes ", spec_.payload_bytes, " outside [1, ", max_segment, "]")));
    return false;
  }
  if (absl::Status s = call_->Admit(spec_.payload_bytes); !s.ok()) {
    Refused(s);
    return false;
  }
  inflight_bytes_ = spec_.payload_bytes;
  return true;
}

void Upload::Started(absl::StatusOr<WriteTicket> t) {
  if (!t.ok()) {
    Refused(t.status());
    return;
  }
  ticket_ = *std::move(t);
  state_ = State::kPayload;
  buffer_.reserve(spec_.payload_bytes);
  // buffer_ never reallocates from here on (appends stay within the
  // declared size), so the writer task reads the received bytes through
  // base_ while events append after them.
  base_ = buffer_.data();
  payload_bytes_ = spec_.payload_bytes;
  streaming_ = spec_.payload_bytes > store_->options().inline_payload_max_bytes;
  // A batch's client streams without waiting for the header's acceptance.
  if (!options_.batch) call_->HeaderAccepted();
  Read();
}

void Upload::Refused(const absl::Status& s) {
  if (!options_.batch) {
    Done(s);
    return;
  }
  EndSegment(s);
  skip_ = spec_.payload_bytes;
  state_ = skip_ != 0 ? State::kSkipping : State::kHeader;
  Read();
}

void Upload::CommitSegment() {
  state_ = State::kCommitting;
  // No writer task ever ran for an inline payload.
  if (!streaming_ && TryCommitNow()) return;
  RunAfterWrites([this] { Commit(); });
}

bool Upload::TryCommitNow() {
  const uint64_t bytes = ticket_.spec().payload_bytes;
  std::optional<absl::StatusOr<SegmentInfo>> info =
      store_->TryCommitWrite(ticket_, buffer_, crc_, /*defer_sync=*/options_.batch);
  if (!info.has_value()) return false;
  Committed(*std::move(info), bytes);
  return true;
}

void Upload::Commit() {
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
  Committed(store_->CommitWrite(std::move(ticket_), std::move(buffer_), crc_,
                                /*defer_sync=*/options_.batch),
            bytes);
}

void Upload::Committed(const absl::StatusOr<SegmentInfo>& info, uint64_t bytes) {
  if (options_.batch) {
    EndSegment(info.status(), info.ok() ? &*info : nullptr, bytes);
    state_ = State::kHeader;
    Read();
    return;
  }
  if (info.ok()) results_.push_back({spec_.id, absl::OkStatus(), *info, bytes});
  Done(info.status());
}

void Upload::EndSegment(const absl::Status& s, const SegmentInfo* info, uint64_t bytes) {
  // Abort a pending write before the client hears the outcome, so that a
  // retry never meets the failed upload's reservation (ALREADY_EXISTS).
  ticket_ = WriteTicket();
  call_->Refund(inflight_bytes_);
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
  if (segments_ == 0) return;  // No header yet: no segment.
  call_->SegmentDone(s);
  if (!options_.batch) return;
  UploadResult r{spec_.id, s, std::nullopt, 0};
  if (info != nullptr) {
    r.info = *info;
    r.charged_bytes = bytes;
  }
  results_.push_back(std::move(r));
}

void Upload::KickWriter() {
  {
    absl::MutexLock lock(&write_mu_);
    if (writer_running_) return;
    const size_t received = received_.load(std::memory_order_acquire);
    if (received - streamed_ < kWriteBatch && received != payload_bytes_) return;
    writer_running_ = true;
  }
  call_->Schedule([this] { WriteChunks(); });
}

void Upload::WriteChunks() {
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
    absl::Status s = store_->WriteChunk(ticket_, std::string_view(base_ + from, to - from));
    absl::MutexLock lock(&write_mu_);
    streamed_ = to;
    if (!s.ok()) write_status_ = s;
  }
  if (then) then();
}

void Upload::RunAfterWrites(std::function<void()> fn) {
  {
    absl::MutexLock lock(&write_mu_);
    if (writer_running_) {
      after_writes_ = std::move(fn);
      return;
    }
  }
  call_->Schedule(std::move(fn));
}

void Upload::Fail(const absl::Status& s) {
  if (state_ == State::kDone) return;
  if (!ticket_.valid()) {
    Done(s);
    return;
  }
  // The writer task may be using the ticket.
  state_ = State::kFailing;
  RunAfterWrites([this, s] { Done(s); });
}

void Upload::Done(const absl::Status& s) {
  if (options_.batch) {
    if (ticket_.valid() || inflight_bytes_ != 0) EndSegment(absl::CancelledError("call failed"));
  } else {
    EndSegment(s);
  }
  state_ = State::kDone;
  call_->Finish(s, std::move(results_));
}

}  // namespace kvtier::cachestore
