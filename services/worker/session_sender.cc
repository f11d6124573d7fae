#include "services/worker/session_sender.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "encoded/encoded_tensor.h"
#include "kernels/crc32c.h"
#include "rpc/grpc_status.h"
#include "rpc/wire_format.h"
#include "services/worker/transfer_proto.h"
#include "worker/session.h"

namespace kvtier {

SessionSender::SessionSender(worker::Engine* engine, worker::SessionKey id,
                             std::shared_ptr<grpc::Channel> channel, std::string target,
                             std::string authorization, absl::Time deadline, size_t chunk_bytes)
    : transfer_(engine),
      id_(std::move(id)),
      target_(std::move(target)),
      authorization_(std::move(authorization)),
      deadline_(deadline),
      chunk_bytes_(std::max<size_t>(chunk_bytes, 4096)),
      channel_(std::move(channel)) {
  if (!authorization_.empty()) ctx_.AddMetadata("authorization", authorization_);
  ctx_.set_deadline(absl::ToChronoTime(deadline));
}

namespace {

// Device layers lent to a receiver whose transfer did not end with its
// answer: it may still be copying out of them (a cancelled call ends here at
// once), and CUDA leaves freeing them meanwhile undefined. They are kept
// for a grace period longer than any copy, then let go.
class LentLayers {
 public:
  static void Keep(std::vector<std::shared_ptr<void>> layers) {
    static LentLayers* kept = new LentLayers;
    const absl::Time now = absl::Now();
    absl::MutexLock lock(&kept->mu_);
    while (!kept->held_.empty() && kept->held_.front().first < now) kept->held_.pop_front();
    kept->held_.emplace_back(now + absl::Seconds(60), std::move(layers));
  }

 private:
  absl::Mutex mu_;
  std::deque<std::pair<absl::Time, std::vector<std::shared_ptr<void>>>> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

SessionSender::~SessionSender() {
  if (thread_.joinable()) {
    {
      absl::MutexLock lock(&mu_);
      // Unfinished: the receiver sees a cancelled stream and keeps nothing.
      if (!done_) CancelLocked();
    }
    thread_.join();
  }
  bool answered = false;
  {
    absl::MutexLock lock(&mu_);
    answered = answered_;
  }
  if (!lent_.empty() && !answered) LentLayers::Keep(std::move(lent_));
}

void SessionSender::CancelLocked() {
  ctx_.TryCancel();
  // The thread writes nothing more (the call is cancelled) and finishes.
  queue_.emplace_back(v1::TransferTail());
  finished_ = true;
}

absl::Status SessionSender::Begin() {
  KVT_ASSIGN_OR_RETURN(image_, transfer_.ExportSession(id_));
  incarnation_ = image_.incarnation;
  has_past_ = !image_.past.empty();
  on_device_ = image_.on_device;
  if (on_device_ && has_past_) {
    absl::StatusOr<worker::DeviceIdentity> offer = transfer_.OffersDeviceRounds();
    if (offer.ok()) {
      offer_ = IdentityToProto(*offer);
    } else {
      refusal_ = std::string(offer.status().message());
    }
  }
  call_ = std::make_unique<RawCall>(channel_, &ctx_, "/kvtier.v1.Worker/TransferSession");
  {
    absl::MutexLock lock(&mu_);
    v1::TransferHeader h = HeaderToProto(id_.session, image_);
    for (const std::string& a : stores_) h.add_store_addresses(a);
    queue_.emplace_back(std::move(h));
    report_.set_target(target_);
    report_.set_path("grpc");
  }
  thread_ = std::thread([this] { Run(); });
  return absl::OkStatus();
}

absl::Status SessionSender::SendLayer(int layer) {
  // A layer on the GPU is lent as it is: the thread copies it out over
  // gRPC, or names it for the receiver to copy (CUDA IPC).
  KVT_ASSIGN_OR_RETURN(worker::LayerImage li,
                       transfer_.ExportLayer(id_, layer, /*device_rounds=*/on_device_));
  absl::MutexLock lock(&mu_);
  if (!sent_layer_) {
    first_layer_ = std::chrono::steady_clock::now();
    sent_layer_ = true;
  }
  queue_.emplace_back(std::move(li));
  return absl::OkStatus();
}

absl::StatusOr<v1::TransferReport> SessionSender::Finish() {
  const auto wait_start = std::chrono::steady_clock::now();
  absl::Status tail = transfer_.ExportTail(id_, &image_);
  absl::MutexLock lock(&mu_);
  if (!tail.ok()) {
    // The receiver must not take a session whose state we cannot send.
    CancelLocked();
    mu_.Await(absl::Condition(&done_));
    return tail;
  }
  queue_.emplace_back(TailToProto(image_));
  finished_ = true;
  mu_.Await(absl::Condition(&done_));
  if (!failure_.ok() || !status_.ok()) {
    absl::Status s = !failure_.ok() ? failure_ : FromGrpc(status_);
    return absl::Status(s.code(), absl::StrCat("transfer of session ", id_.ToString(), " to ",
                                               target_, " failed: ", s.message()));
  }
  answered_ = true;  // The receiver has closed every handle it opened.
  if (link_ != nullptr) {
    // Both sides' operations on it have completed: it is kept for the next
    // hand-off to this receiver (a failed transfer destroys it with us).
    transfer_.device_links().Put(target_, nccl_id_, std::move(link_));
    report_.set_device_link_reused(link_reused_);
  }
  report_.set_transfer_ms(worker::MsSince(first_layer_));
  report_.set_exposed_ms(worker::MsSince(wait_start));
  LogDebug("hand-off finished", {{"session", id_.ToString()},
                                 {"wait_start_us", worker::MonoUs(wait_start)},
                                 {"now_us", worker::MonoUs(std::chrono::steady_clock::now())}});
  report_.set_drain_ms(
      std::max(0.0, std::chrono::duration<double, std::milli>(tail_written_ - wait_start).count()));
  if (on_device_ && device_path_.empty()) report_.set_device_refusal(refusal_);
  return report_;
}

std::string SessionSender::path() {
  absl::MutexLock lock(&mu_);
  return report_.path().empty() ? std::string("grpc") : report_.path();
}

void SessionSender::AskHeld() {
  if (!has_past_ || (incarnation_ == 0 && !offer_.has_value())) return;
  grpc::ClientContext ctx;
  if (!authorization_.empty()) ctx.AddMetadata("authorization", authorization_);
  ctx.set_deadline(absl::ToChronoTime(deadline_));
  v1::HeldRoundsRequest req;
  req.set_session_id(id_.session);
  req.set_incarnation(incarnation_);
  // An NCCL communicator kept from an earlier hand-off to this receiver,
  // offered for this one. Unless the receiver reserves it, it goes back to
  // the pool (the receiver's answer is what makes it safe to use, so a
  // communicator the receiver no longer holds is never used).
  std::optional<worker::LinkPool::Link> idle;
  if (offer_.has_value() && offer_->nccl()) {
    idle = transfer_.device_links().Take(target_);
    if (idle.has_value()) req.set_nccl_link(idle->id);
  }
  auto put_back = [&] {
    if (idle.has_value()) {
      transfer_.device_links().Put(target_, std::move(idle->id), std::move(idle->link));
    }
  };
  if (offer_.has_value()) *req.mutable_device() = *offer_;
  v1::HeldRoundsResponse resp;
  const grpc::Status st = v1::Worker::NewStub(channel_)->HeldRounds(&ctx, req, &resp);
  if (!st.ok()) {
    LogDebug("hand-off without reuse: HeldRounds failed",
             {{"session", id_.ToString()}, {"target", target_}, {"error", st.error_message()}});
    if (offer_.has_value()) refusal_ = absl::StrCat("HeldRounds failed: ", st.error_message());
    put_back();
    return;
  }
  if (offer_.has_value()) {
    auto offered = [&](const char* path) {
      return std::find(resp.device_paths().begin(), resp.device_paths().end(), path) !=
             resp.device_paths().end();
    };
    if (offered("cuda_ipc")) {
      device_path_ = "cuda_ipc";
      packs_ = resp.ipc_offsets() && transfer_.ipc_pack_bytes() > 0;
      put_back();
    } else if (offered("nccl") && idle.has_value() && resp.nccl_link() == idle->id) {
      device_path_ = "nccl";
      nccl_id_ = std::move(idle->id);
      link_ = std::move(idle->link);
      link_reused_ = true;
    } else if (offered("nccl")) {
      // The receiver no longer holds the offered communicator (if any):
      // ours is of no use, and a new one is formed.
      idle.reset();
      absl::StatusOr<std::string> id = worker::NewLinkId();
      if (id.ok()) {
        device_path_ = "nccl";
        nccl_id_ = *std::move(id);
      } else {
        refusal_ = absl::StrCat("NCCL: ", id.status().message());
      }
    } else {
      refusal_ = resp.device_refusal().empty() ? "the receiver predates the device paths"
                                               : resp.device_refusal();
      put_back();
    }
  }
  if (incarnation_ == 0) return;
  for (const v1::HeldRoundsResponse::Round& r : resp.rounds()) {
    held_.push_back({r.round(), {r.layers().begin(), r.layers().end()}});
  }
}

void SessionSender::JoinNccl() {
  absl::StatusOr<std::unique_ptr<worker::DeviceLink>> link =
      worker::JoinLink(nccl_id_, 0, std::min(deadline_, absl::Now() + absl::Seconds(30)));
  if (link.ok()) {
    link_ = *std::move(link);
    return;
  }
  LogWarn("hand-off over gRPC: the NCCL communicator did not form",
          {{"session", id_.ToString()}, {"target", target_}, {"error", link.status().ToString()}});
  device_path_.clear();
  refusal_ = absl::StrCat("NCCL: ", link.status().message());
}

void SessionSender::Fail(absl::Status st) {
  absl::MutexLock lock(&mu_);
  failure_ = std::move(st);
  ctx_.TryCancel();
}

bool SessionSender::PlaceDeviceRounds(worker::LayerImage* li, v1::TransferLayer* info,
                                      uint64_t* device_bytes,
                                      std::vector<std::shared_ptr<worker::DeviceLayer>>* sends) {
  *device_bytes = 0;
  if (li->device_rounds.empty()) return true;
  if (!device_path_.empty()) {
    const bool nccl = device_path_ == "nccl";
    if (packs_ && pack_ == nullptr && !pack_refused_) {
      absl::StatusOr<std::unique_ptr<worker::IpcPack>> pack =
          worker::NewIpcPack(transfer_.ipc_pack_bytes());
      if (pack.ok()) {
        pack_ = *std::move(pack);
        lent_.push_back(pack_);
      } else {
        pack_refused_ = true;
        LogWarn("device rounds not packed",
                {{"session", id_.ToString()}, {"error", pack.status().ToString()}});
      }
    }
    std::vector<v1::TransferDeviceRound> rounds;
    for (const worker::LayerImage::DeviceRound& d : li->device_rounds) {
      absl::StatusOr<worker::IpcPlace> place = worker::IpcPlace();
      if (!nccl && pack_ != nullptr) {
        place = pack_->Place(*d.layer);
      } else if (!nccl) {
        absl::StatusOr<std::string> handle = d.layer->IpcHandle();
        if (handle.ok()) {
          place->handle = *std::move(handle);
        } else {
          place = handle.status();
        }
      }
      if (!place.ok() || d.layer->unstaging().empty()) {
        // This layer goes over gRPC; the next ones try again.
        LogWarn("device round sent over gRPC", {{"session", id_.ToString()},
                                                {"round", d.round},
                                                {"error", place.status().ToString()}});
        rounds.clear();
        break;
      }
      rounds.push_back(DeviceRoundToProto(d.round, d.layer->staged_bytes(),
                                          std::move(place->handle), d.layer->unstaging()));
      rounds.back().set_ipc_offset(place->offset);
      *device_bytes += d.layer->staged_bytes();
    }
    if (!rounds.empty() && !nccl && pack_ != nullptr) {
      // The receiver may copy as soon as it reads the layer's start.
      if (absl::Status st = pack_->Sync(); !st.ok()) {
        Fail(std::move(st));
        return false;
      }
    }
    if (!rounds.empty()) {
      for (v1::TransferDeviceRound& r : rounds) *info->add_device_rounds() = std::move(r);
      for (worker::LayerImage::DeviceRound& d : li->device_rounds) {
        if (nccl) sends->push_back(d.layer);
        lent_.push_back(std::move(d.layer));
      }
      li->device_rounds.clear();
      return true;
    }
    *device_bytes = 0;
  }
  absl::Status st = li->ResolveDevice();
  if (st.ok()) return true;
  Fail(std::move(st));
  return false;
}

bool SessionSender::WriteLayer(worker::LayerImage li) {
  // The bytes stay where the working set holds them (past rounds) or where
  // the export put them (the open round); gRPC's slices reference them and
  // keep them alive. Rounds the receiver holds at this layer stay here, and
  // so do those the receiver copies from this GPU.
  const uint64_t reused_bytes = li.LeaveOut(held_);
  v1::TransferChunk start;
  v1::TransferLayer* info = start.mutable_layer_info();
  uint64_t device_bytes = 0;
  std::vector<std::shared_ptr<worker::DeviceLayer>> sends;
  if (!PlaceDeviceRounds(&li, info, &device_bytes, &sends)) return false;
  // Pieces that lie one after the other in the same buffer (a round's
  // tensors and their framing in its payload) go as one slice.
  std::vector<wire::BytesPiece> parts;
  for (const worker::LayerImage::Piece& p : li.past_pieces) {
    if (!parts.empty() && parts.back().owner == p.owner &&
        parts.back().data + parts.back().len == p.bytes.data()) {
      parts.back().len += p.bytes.size();
      continue;
    }
    parts.push_back({p.bytes.data(), p.bytes.size(), p.owner});
  }
  if (li.past != nullptr) parts.push_back({li.past->data(), li.past->size(), li.past});
  const uint64_t past_bytes = li.past_size();
  auto open = std::make_shared<const std::string>(std::move(li.open));
  parts.push_back({open->data(), open->size(), open});
  // The layer's checksum leaves out the past tensors' buffer data, which
  // their own crc32c covers (TransferHeader.tensor_checksums): the past
  // bytes are not read here. The pieces alternate framing and tensor.
  // A tensor's part comes from what the working set kept where it has it
  // (RoundLayer::outside): walking the fields of tensors long out of cache
  // waits on memory at every field and held up the stream.
  uint32_t crc = 0;
  for (size_t i = 0; i < li.past_pieces.size(); ++i) {
    const worker::LayerImage::Piece& piece = li.past_pieces[i];
    const std::string_view b = piece.bytes;
    if (i % 2 == 0) {
      crc = Crc32cExtend(crc, b.data(), b.size());
      continue;
    }
    if (piece.outside.has_value()) {
      crc = Crc32cCombine(crc, piece.outside->crc, piece.outside->len);
      continue;
    }
    absl::StatusOr<uint32_t> c = Crc32cOutsideBufferData(crc, b);
    if (!c.ok()) {
      Fail(absl::InternalError(absl::StrCat("layer ", li.layer, ": ", c.status().message())));
      return false;
    }
    crc = *c;
  }
  if (li.past != nullptr) {
    absl::StatusOr<uint32_t> c = Crc32cOutsidePayloadBufferData(crc, *li.past);
    if (!c.ok()) {
      Fail(absl::InternalError(absl::StrCat("layer ", li.layer, ": ", c.status().message())));
      return false;
    }
    crc = *c;
  }
  crc = Crc32cExtend(crc, open->data(), open->size());
  start.set_layer(static_cast<uint32_t>(li.layer));
  for (uint32_t r : li.rounds) info->add_rounds(r);
  for (uint32_t r : li.reused) info->add_reused_rounds(r);
  info->set_past_bytes(past_bytes);
  info->set_past_raw_bytes(li.past_raw_bytes);
  info->set_open_rows(li.open_rows);
  info->set_q_first(li.q_first);
  info->set_q_rows(li.q_rows);
  info->set_open_bytes(open->size());
  if (!call_->Write(wire::Serialize(start))) return false;
  // NCCL: the device rounds follow the start, in its order, as the
  // receiver posts their receives.
  for (const std::shared_ptr<worker::DeviceLayer>& layer : sends) {
    absl::Status sent = link_->Send(*layer, std::min(deadline_, absl::Now() + absl::Seconds(30)));
    if (!sent.ok()) {
      Fail(std::move(sent));
      return false;
    }
  }
  uint32_t chunks = 2;
  constexpr int kDataField = 8;  // TransferChunk.data
  // Data chunks of chunk_bytes_, each gathering as many pieces (or parts of
  // one) as fit.
  std::vector<wire::BytesPiece> chunk;
  size_t in_chunk = 0;
  auto flush = [&]() {
    if (in_chunk == 0) return true;
    ++chunks;
    const bool ok = call_->Write(wire::BytesFieldMessage(kDataField, chunk));
    chunk.clear();
    in_chunk = 0;
    return ok;
  };
  for (const wire::BytesPiece& p : parts) {
    for (size_t at = 0; at < p.len;) {
      const size_t n = std::min(chunk_bytes_ - in_chunk, p.len - at);
      chunk.push_back({p.data + at, n, p.owner});
      in_chunk += n;
      at += n;
      if (in_chunk == chunk_bytes_ && !flush()) return false;
    }
  }
  if (!flush()) return false;
  v1::TransferChunk end;
  end.set_layer(static_cast<uint32_t>(li.layer));
  end.set_layer_end(true);
  end.set_layer_crc32c(crc);
  if (!call_->Write(wire::Serialize(end))) return false;
  absl::MutexLock lock(&mu_);
  report_.set_past_bytes(report_.past_bytes() + past_bytes);
  report_.set_past_raw_bytes(report_.past_raw_bytes() + li.past_raw_bytes);
  report_.set_open_bytes(report_.open_bytes() + open->size());
  report_.set_wire_bytes(report_.wire_bytes() + past_bytes + open->size());
  report_.set_reused_bytes(report_.reused_bytes() + reused_bytes);
  report_.set_device_bytes(report_.device_bytes() + device_bytes);
  if (device_bytes > 0) report_.set_path(device_path_);
  report_.set_chunks(report_.chunks() + chunks);
  return true;
}

void SessionSender::Run() {
  bool broken = false;
  for (;;) {
    Item item;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](std::deque<Item>* q) { return !q->empty(); }, &queue_));
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    const bool last = std::holds_alternative<v1::TransferTail>(item);
    if (!broken) {
      if (auto* h = std::get_if<v1::TransferHeader>(&item)) {
        AskHeld();  // While the caller computes the first layer.
        if (!device_path_.empty()) *h->mutable_device() = *offer_;
        // Whether this transfer packs round layers is known once HeldRounds
        // answered; a pack that cannot be made later names layers as they
        // are, which a receiver keeping handles open reads all the same.
        h->set_ipc_packed(packs_);
        if (device_path_ == "nccl") {
          h->set_nccl_id(nccl_id_);
          h->set_nccl_reused(link_reused_);
        }
        h->set_tensor_checksums(true);
        v1::TransferChunk c;
        *c.mutable_header() = std::move(*h);
        broken = !call_->Write(wire::Serialize(c));
        // The receiver joins a new communicator as rank 1 when it reads the
        // header.
        if (!broken && device_path_ == "nccl" && !link_reused_) JoinNccl();
      } else if (auto* li = std::get_if<worker::LayerImage>(&item)) {
        broken = !WriteLayer(std::move(*li));
      } else {
        v1::TransferChunk c;
        *c.mutable_tail() = std::move(std::get<v1::TransferTail>(item));
        broken = !call_->Write(wire::Serialize(c));
        if (!broken) {
          const auto now = std::chrono::steady_clock::now();
          LogDebug("hand-off tail written",
                   {{"session", id_.ToString()}, {"now_us", worker::MonoUs(now)}});
          absl::MutexLock lock(&mu_);
          tail_written_ = now;
        }
        if (!broken) broken = !call_->WritesDone();
        grpc::ByteBuffer reply;
        v1::TransferSessionResponse answer;
        if (!broken && call_->Read(&reply) && wire::Parse(reply, &answer).ok()) {
          absl::MutexLock lock(&mu_);
          report_.set_receiver_import_ms(answer.import_ms());
          report_.set_receiver_device_copy_ms(answer.device_copy_ms());
          report_.set_receiver_tail_wait_ms(answer.tail_wait_ms());
          report_.set_receiver_span_ms(answer.span_ms());
          report_.set_receiver_busy_ms(answer.busy_ms());
        }
      }
    }
    if (last || broken) {
      // The call's status: the receiver's answer, or why the stream broke.
      grpc::Status st = call_->Finish();
      absl::MutexLock lock(&mu_);
      status_ = std::move(st);
      if (last || finished_) {
        done_ = true;
        return;
      }
      // Broken before the tail: the caller still queues the rest; drop it
      // until its Finish.
      mu_.Await(absl::Condition(&finished_));
      done_ = true;
      return;
    }
  }
}

}  // namespace kvtier
