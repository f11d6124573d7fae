// WorkerService's hand-off methods: TransferSession (receiving), SendSession
// (sending a session between steps), and the senders the Prefill stream
// uses for transfer_to (docs/transfer.md).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <optional>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "encoded/encoded_tensor.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "kernels/crc32c.h"
#include "rpc/grpc_status.h"
#include "rpc/transport_args.h"
#include "rpc/wire_format.h"
#include "services/common/idle_read.h"
#include "services/worker/transfer_proto.h"
#include "services/worker/worker_service.h"
#include "worker/device/attention.h"
#include "worker/session.h"

namespace kvtier {

std::shared_ptr<grpc::Channel> WorkerService::PeerChannel(const std::string& target) {
  absl::MutexLock lock(&peers_mu_);
  auto it = peers_.find(target);
  if (it != peers_.end()) return it->second;
  grpc::ChannelArguments args;
  ApplyBulkTransportArgs(&args);
  ApplyReconnectArgs(&args);
  auto channel = grpc::CreateCustomChannel(
      target,
      ClientChannelCredentials(
          ClientTls{options_.peer_tls_root_certs, options_.peer_tls_server_name,
                    options_.peer_tls_cert_chain, options_.peer_tls_private_key},
          &args),
      args);
  peers_.emplace(target, channel);
  return channel;
}

absl::StatusOr<std::unique_ptr<SessionSender>> WorkerService::NewSender(
    const grpc::CallbackServerContext& ctx, const worker::SessionKey& id,
    const std::string& target) {
  if (known_peers_ != nullptr) KVT_RETURN_IF_ERROR(known_peers_->Check({target}, StoreCall(ctx)));
  std::string authorization;
  auto it = ctx.client_metadata().find("authorization");
  if (it != ctx.client_metadata().end()) authorization.assign(it->second.data(), it->second.size());
  auto sender = std::make_unique<SessionSender>(engine_, id, PeerChannel(target), target,
                                                std::move(authorization), StoreCall(ctx).deadline,
                                                options_.max_response_bytes);
  if (replicas_ != nullptr) sender->SetStores(replicas_->Replicas(id.tenant, id.session));
  return sender;
}

absl::Status WorkerService::DoSendSession(grpc::CallbackServerContext& ctx,
                                          const v1::SendSessionRequest& req,
                                          v1::SendSessionResponse* resp) {
  KVT_ASSIGN_OR_RETURN(worker::SessionKey id, Key(ctx, req.session_id()));
  if (req.target().empty()) return absl::InvalidArgumentError("SendSession needs a target");
  KVT_ASSIGN_OR_RETURN(worker::ModelShape shape, engine_->Shape(id));
  KVT_ASSIGN_OR_RETURN(std::unique_ptr<SessionSender> sender, NewSender(ctx, id, req.target()));
  absl::Status sent = sender->Begin();
  for (int l = 0; sent.ok() && l < shape.layers; ++l) sent = sender->SendLayer(l);
  absl::StatusOr<v1::TransferReport> report =
      sent.ok() ? sender->Finish() : absl::StatusOr<v1::TransferReport>(sent);
  metrics_->Sent(sender->path(), report);
  sender.reset();  // Unfinished, it cancels: the receiver keeps nothing.
  KVT_RETURN_IF_ERROR(report.status());
  ForgetMoved(id);
  *resp->mutable_report() = std::move(*report);
  return absl::OkStatus();
}

void WorkerService::ForgetMoved(const worker::SessionKey& id) {
  // Deliberately ignored: NOT_FOUND only if it was closed meanwhile. Its
  // past rounds stay in the hand-off cache for when it comes back.
  transfer_.ForgetSession(id, /*keep_rounds=*/true).IgnoreError();
  if (policies_ != nullptr) policies_->Forget(id);
  if (replicas_ != nullptr) replicas_->Forget(id.tenant, id.session);
  LogDebug("session handed off", {{"session", id.ToString()}});
}

absl::Status WorkerService::DoHeldRounds(grpc::CallbackServerContext& ctx,
                                         const v1::HeldRoundsRequest& req,
                                         v1::HeldRoundsResponse* resp) {
  KVT_ASSIGN_OR_RETURN(worker::SessionKey id, Key(ctx, req.session_id()));
  // Kept for the hand-off that asks: until its deadline, at most 10 minutes.
  const absl::Time lease =
      std::min(absl::FromChrono(ctx.deadline()), absl::Now() + absl::Minutes(10));
  for (const worker::HandoffCache::Held& h : transfer_.HeldRounds(id, req.incarnation(), lease)) {
    v1::HeldRoundsResponse::Round* r = resp->add_rounds();
    r->set_round(h.round);
    for (uint32_t l : h.layers) r->add_layers(l);
  }
  if (req.has_device()) {
    const worker::DeviceIdentity peer = IdentityFromProto(req.device());
    const absl::StatusOr<std::string> path = transfer_.AcceptsDeviceRounds(peer);
    if (path.ok()) {
      resp->add_device_paths(*path);
      resp->set_ipc_offsets(*path == "cuda_ipc");
      // A communicator of an earlier hand-off from this sender, reserved
      // for its next transfer when this worker holds it too.
      if (*path == "nccl" && !req.nccl_link().empty() &&
          transfer_.device_links().Promise(worker::ProcessKey(peer), req.nccl_link())) {
        resp->set_nccl_link(req.nccl_link());
      }
    } else {
      resp->set_device_refusal(std::string(path.status().message()));
    }
  }
  return absl::OkStatus();
}

// ---- TransferSession ----

// Chunks are taken in order, one at a time: a data-only chunk that finds
// nothing queued is copied into its layer on gRPC's thread (TakeDataHere),
// everything else on the compute executor (layer starts and ends, whose
// checks read the whole layer, the tail's import, and any chunk that arrives
// while the executor drains). The session is imported when the tail
// arrives, and nothing stays on any other path. gRPC reads the next messages
// (up to kReadAhead) while a chunk is taken, so that their delivery overlaps
// the copying. Exactly one Finish(), from the executor.
class WorkerService::TransferReactor : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  TransferReactor(WorkerService* svc, grpc::CallbackServerContext* ctx, grpc::ByteBuffer* resp)
      : svc_(svc), ctx_(ctx), resp_(resp) {
    reading_ = true;
    StartRead(&msg_);
  }

  void OnReadDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    reading_ = false;
    if (finished_) return;  // A read that Finish cut short.
    if (ok && !draining_ && queued_.empty() && TakeDataHere(msg_)) {
      ReadAheadLocked();
      return;
    }
    if (ok) {
      last_read_ = std::chrono::steady_clock::now();
      queued_.emplace_back();
      queued_.back().Swap(&msg_);
      ReadAheadLocked();
    } else {
      stream_ended_ = true;
    }
    if (!draining_) {
      draining_ = true;
      svc_->compute_->Schedule([this] { Drain(); });
    }
  }

  void OnDone() override { delete this; }

 private:
  // At most this many messages are read ahead of the chunk being taken.
  static constexpr size_t kReadAhead = 4;

  void ReadAheadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (reading_ || finished_ || stream_ended_ || queued_.size() >= kReadAhead) return;
    reading_ = true;
    StartRead(&msg_);
  }

  // A data chunk with nothing ahead of it is copied into the layer here, on
  // gRPC's thread (nothing else touches the layer while nothing drains),
  // instead of a hop to the executor; false leaves the message to Drain
  // (anything but data that fits the layer, whose errors Drain reports).
  bool TakeDataHere(const grpc::ByteBuffer& msg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    constexpr int kDataField = 8;  // TransferChunk.data
    if (!gathering_) return false;
    absl::StatusOr<wire::Field> f = wire::SingleField(msg);
    if (!f.ok() || f->number != kDataField ||
        past_.size() + layer_.open.size() + f->size > past_bytes_ + open_bytes_) {
      return false;
    }
    for (const auto& [p, n] : f->spans) {
      if (!TakeData(p, n).ok()) return false;  // Not reached: the size was checked.
    }
    return true;
  }

  // Takes the queued messages in order until none is left (the next read's
  // OnReadDone schedules another Drain) or the transfer ends.
  void Drain() {
    for (;;) {
      grpc::ByteBuffer m;
      bool ended = false;
      {
        absl::MutexLock lock(&mu_);
        if (!queued_.empty()) {
          m.Swap(&queued_.front());
          queued_.pop_front();
          ReadAheadLocked();
        } else if (stream_ended_) {
          finished_ = true;
          ended = true;
        } else {
          draining_ = false;
          return;
        }
      }
      if (ended) {
        End(absl::AbortedError(absl::StrCat("the transfer stream ended before its tail (after ",
                                            layers_.size(), " layers); nothing was kept")));
        return;
      }
      const auto start = std::chrono::steady_clock::now();
      if (!header_taken_.has_value()) header_taken_ = start;
      absl::Status s = Take(m);
      busy_ms_ += worker::MsSince(start);
      if (!s.ok() || imported_) {
        {
          absl::MutexLock lock(&mu_);
          finished_ = true;
        }
        End(s);
        return;
      }
    }
  }

  // One message: a data-only chunk straight from gRPC's slices, anything
  // else parsed and taken field by field (header, layer start, data, layer
  // end, tail; one message may carry several).
  absl::Status Take(const grpc::ByteBuffer& msg) {
    constexpr int kDataField = 8;  // TransferChunk.data
    if (absl::StatusOr<wire::Field> f = wire::SingleField(msg); f.ok() && f->number == kDataField) {
      for (const auto& [p, n] : f->spans) KVT_RETURN_IF_ERROR(TakeData(p, n));
      return absl::OkStatus();
    }
    chunk_.Clear();
    KVT_RETURN_IF_ERROR(wire::Parse(msg, &chunk_));
    // Each part's time, for the debug log's breakdown (End).
    auto timed = [](double* ms, auto&& part) {
      const auto start = std::chrono::steady_clock::now();
      absl::Status st = part();
      *ms += worker::MsSince(start);
      return st;
    };
    if (chunk_.has_header() || !image_.has_value()) {
      KVT_RETURN_IF_ERROR(timed(&header_ms_, [&] { return TakeHeader(); }));
    }
    if (chunk_.has_layer_info()) {
      KVT_RETURN_IF_ERROR(timed(&start_ms_, [&] { return StartLayer(); }));
    }
    if (!chunk_.data().empty()) {
      KVT_RETURN_IF_ERROR(TakeData(chunk_.data().data(), chunk_.data().size()));
    }
    if (chunk_.layer_end()) KVT_RETURN_IF_ERROR(timed(&end_ms_, [&] { return EndLayer(); }));
    if (chunk_.has_tail()) return TakeTail();
    return absl::OkStatus();
  }

  absl::Status TakeHeader() {
    if (image_.has_value()) return absl::InvalidArgumentError("a second transfer header");
    if (!chunk_.has_header()) {
      return absl::InvalidArgumentError("the first TransferChunk must carry the header");
    }
    KVT_ASSIGN_OR_RETURN(id_, svc_->Key(*ctx_, chunk_.header().session_id()));
    hold_ = svc_->transfer_.HoldIncoming(id_->tenant);
    stores_.assign(chunk_.header().store_addresses().begin(),
                   chunk_.header().store_addresses().end());
    if (!stores_.empty()) {
      if (svc_->replicas_ == nullptr) {
        return absl::FailedPreconditionError("this worker cannot use per-session store replicas");
      }
      // Before any layer is taken: a header naming a store this worker does
      // not know ends the stream here, and nothing is dialled.
      KVT_RETURN_IF_ERROR(svc_->replicas_->CheckReplicas(stores_, svc_->StoreCall(*ctx_)));
    }
    KVT_ASSIGN_OR_RETURN(image_, HeaderFromProto(chunk_.header()));
    tensor_checksums_ = chunk_.header().tensor_checksums();
    if (chunk_.header().has_device()) {
      // Checked again here: the stream, not HeldRounds, is what carries the
      // handles this worker will open.
      peer_ = IdentityFromProto(chunk_.header().device());
      ipc_packed_ = chunk_.header().ipc_packed();
      device_path_ = svc_->transfer_.AcceptsDeviceRounds(*peer_);
      if (device_path_->ok() && **device_path_ == "nccl") {
        nccl_id_ = chunk_.header().nccl_id();
        if (nccl_id_.empty()) {
          device_path_ = absl::InvalidArgumentError("the NCCL path without a communicator id");
        } else if (chunk_.header().nccl_reused()) {
          // Promised on HeldRounds; when it is gone, the sender's sends
          // find no receive and its transfer fails by its deadline.
          absl::StatusOr<std::unique_ptr<worker::DeviceLink>> link =
              svc_->transfer_.device_links().TakePromised(worker::ProcessKey(*peer_), nccl_id_);
          if (link.ok()) {
            link_ = *std::move(link);
          } else {
            device_path_ = link.status();
          }
        } else {
          // The sender joins as rank 0 once it wrote the header.
          absl::StatusOr<std::unique_ptr<worker::DeviceLink>> link =
              worker::JoinLink(chunk_.header().nccl_id(), 1, DeviceDeadline());
          if (link.ok()) {
            link_ = *std::move(link);
          } else {
            device_path_ = link.status();
            svc_->transfer_.DeviceRoundsFailed(*peer_, "nccl", link.status());
          }
        }
      }
    }
    KVT_RETURN_IF_ERROR(svc_->transfer_.CheckImport(*id_, 0));
    // The import is done layer by layer as they arrive (open rounds, and
    // for a session going on this worker's GPU its device side), rather
    // than all at the tail.
    prep_ = svc_->transfer_.BeginImport(image_->shape, image_->policy);
    return absl::OkStatus();
  }

  absl::Status StartLayer() {
    const int layers = image_->shape.layers;
    if (gathering_ || static_cast<int>(chunk_.layer()) != static_cast<int>(layers_.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("transfer layer ", chunk_.layer(), " starts where ",
                       gathering_ ? absl::StrCat("layer ", layer_.layer, " has not ended")
                       : layers_.size() < static_cast<size_t>(layers)
                           ? absl::StrCat("layer ", layers_.size(), " belongs")
                           : std::string("the tail belongs")));
    }
    const v1::TransferLayer& info = chunk_.layer_info();
    uint64_t staged = 0;
    for (const v1::TransferDeviceRound& r : info.device_rounds()) {
      staged += std::min<uint64_t>(r.staged_bytes(), uint64_t{1} << 48);
    }
    // Refused before anything is allocated for it. What arrived so far is
    // in the hold, which the engine counts already.
    KVT_RETURN_IF_ERROR(
        svc_->transfer_.CheckImport(*id_, staged + info.past_bytes() + info.open_bytes()));
    layer_ = worker::LayerImage();
    const auto copy_start = std::chrono::steady_clock::now();
    absl::Status took = TakeDeviceRounds(info);
    if (!info.device_rounds().empty()) device_copy_ms_ += worker::MsSince(copy_start);
    if (absl::Status st = std::move(took); !st.ok()) {
      // A path that failed once with this sender is not offered to it again
      // (its next hand-offs go over gRPC), unless memory ran out.
      if (peer_.has_value() && device_path_.has_value() && device_path_->ok() &&
          !absl::IsResourceExhausted(st)) {
        svc_->transfer_.DeviceRoundsFailed(*peer_, **device_path_, st);
      }
      return st;
    }
    layer_.layer = static_cast<int>(layers_.size());
    layer_.rounds.assign(info.rounds().begin(), info.rounds().end());
    layer_.reused.assign(info.reused_rounds().begin(), info.reused_rounds().end());
    layer_.past_raw_bytes = info.past_raw_bytes();
    layer_.open_rows = info.open_rows();
    layer_.q_first = info.q_first();
    layer_.q_rows = info.q_rows();
    past_bytes_ = info.past_bytes();
    open_bytes_ = info.open_bytes();
    past_.clear();
    constexpr uint64_t kReserveCap = uint64_t{64} << 20;
    past_.reserve(std::min(past_bytes_, kReserveCap));
    layer_.open.reserve(std::min(open_bytes_, kReserveCap));
    crc_ = 0;
    gathering_ = true;
    return absl::OkStatus();
  }

  // The layer's rounds on the sender's GPU: each checked against its own
  // layout, then copied device to device.
  absl::Status TakeDeviceRounds(const v1::TransferLayer& info) {
    if (info.device_rounds().empty()) return absl::OkStatus();
    if (!device_path_.has_value()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "layer ", chunk_.layer(), " carries device rounds; the header named no sender device"));
    }
    if (!device_path_->ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "layer ", chunk_.layer(),
          " carries device rounds this worker cannot take: ", device_path_->status().message()));
    }
    const bool nccl = **device_path_ == "nccl";
    const worker::ModelShape& sh = image_->shape;
    for (const v1::TransferDeviceRound& r : info.device_rounds()) {
      KVT_ASSIGN_OR_RETURN(std::vector<worker::Unstaging> tensors, StagedTensorsFromProto(r));
      KVT_ASSIGN_OR_RETURN(
          worker::DeviceRoundLayout layout,
          worker::CheckDeviceRound(std::move(tensors), r.staged_bytes(), sh.kv_heads, sh.head_dim));
      worker::LayerImage::DeviceRound d;
      d.round = r.round();
      d.lens = layout.lens;
      d.bytes = layout.bytes;
      if (nccl != r.ipc_handle().empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "device round ", r.round(),
            nccl ? " carries an IPC handle on the NCCL path" : " carries no IPC handle"));
      }
      if (nccl) {
        KVT_ASSIGN_OR_RETURN(d.layer, link_->Receive(std::move(layout), DeviceDeadline()));
      } else {
        if (ipc_ == nullptr) ipc_ = worker::NewIpcSource(ipc_packed_);
        KVT_ASSIGN_OR_RETURN(d.layer,
                             ipc_->CopyLayer(r.ipc_handle(), r.ipc_offset(), std::move(layout)));
      }
      KVT_RETURN_IF_ERROR(Hold(r.staged_bytes()));
      device_bytes_ += r.staged_bytes();
      layer_.device_rounds.push_back(std::move(d));
    }
    return absl::OkStatus();
  }

  // How long a device wait (NCCL) may take: the call's deadline, at most
  // 30 s from now.
  absl::Time DeviceDeadline() const {
    return std::min(absl::FromChrono(ctx_->deadline()), absl::Now() + absl::Seconds(30));
  }

  // Counts `n` bytes received against the worker's and the tenant's
  // working-set budgets until the session is imported.
  absl::Status Hold(uint64_t n) {
    absl::Status st = hold_->Grow(n);
    if (st.ok()) return st;
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot take session ", id_->ToString(), ": ", st.message()));
  }

  absl::Status TakeData(const char* p, size_t n) {
    if (!gathering_) return absl::InvalidArgumentError("transfer data outside a layer");
    if (past_.size() + layer_.open.size() + n > past_bytes_ + open_bytes_) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", layer_.layer, " carries more than the ", past_bytes_ + open_bytes_,
                       " bytes its start announced"));
    }
    KVT_RETURN_IF_ERROR(Hold(n));
    const size_t to_past = std::min<size_t>(n, past_bytes_ - past_.size());
    // The past part is checked at the layer's end, against its tensors'
    // own checksums, where the sender said so.
    crc_ = Crc32cExtend(crc_, p, tensor_checksums_ ? 0 : n);
    past_.append(p, to_past);
    layer_.open.append(p + to_past, n - to_past);
    received_ += n;
    return absl::OkStatus();
  }

  absl::Status EndLayer() {
    if (!gathering_ || static_cast<int>(chunk_.layer()) != layer_.layer) {
      return absl::InvalidArgumentError(
          absl::StrCat("transfer layer ", chunk_.layer(), " ends where it did not start"));
    }
    if (past_.size() != past_bytes_ || layer_.open.size() != open_bytes_) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", layer_.layer, " ended after ", past_.size() + layer_.open.size(),
                       " of the ", past_bytes_ + open_bytes_, " bytes it announced"));
    }
    layer_.past = std::make_shared<const std::string>(std::move(past_));
    past_ = std::string();
    if (tensor_checksums_) {
      // One pass over the past tensors, tensor by tensor while each is in
      // cache: everything but their buffer data goes into the layer's
      // crc32c (with the open round), and that data is checked against each
      // tensor's own crc32c: every byte once. The tensors are split into the
      // round layers the import takes as they are.
      uint32_t outside = 0;
      if (absl::Status st =
              layer_.CheckPast(image_->shape.kv_heads, image_->shape.head_dim, &outside);
          !st.ok()) {
        return absl::Status(
            st.code(), absl::StrCat("layer ", layer_.layer, " of the transfer",
                                    absl::IsDataLoss(st) ? " is corrupt" : "", ": ", st.message()));
      }
      crc_ = Crc32cExtend(outside, layer_.open.data(), layer_.open.size());
    }
    if (crc_ != chunk_.layer_crc32c()) {
      return absl::DataLossError(absl::StrCat("layer ", layer_.layer,
                                              " of the transfer is corrupt: crc32c ", crc_,
                                              ", the sender's ", chunk_.layer_crc32c()));
    }
    if (prep_ != nullptr) {
      const auto start = std::chrono::steady_clock::now();
      absl::Status st = svc_->transfer_.PrepareLayer(*prep_, layer_);
      if (prep_->device != nullptr) device_copy_ms_ += worker::MsSince(start);
      if (!st.ok()) {
        return absl::Status(st.code(),
                            absl::StrCat("layer ", layer_.layer,
                                         " of the transfer could not be taken in: ", st.message()));
      }
    }
    layers_.push_back(std::move(layer_));
    gathering_ = false;
    last_layer_end_ = std::chrono::steady_clock::now();
    return absl::OkStatus();
  }

  absl::Status TakeTail() {
    const int layers = image_->shape.layers;
    if (static_cast<int>(layers_.size()) != layers || gathering_) {
      return absl::InvalidArgumentError(
          absl::StrCat("the tail arrived after ", layers_.size(), " of ", layers, " layers"));
    }
    const auto tail_start = std::chrono::steady_clock::now();
    std::chrono::steady_clock::time_point tail_read;
    {
      absl::MutexLock lock(&mu_);
      tail_read = last_read_;  // The tail was the last read.
    }
    const double tail_wait_ms = worker::MsSince(tail_read);
    // Steady-clock times (one clock for every process on a host), to line
    // this up with the sender's "hand-off tail written".
    LogDebug("hand-off tail taken", {{"session", id_->ToString()},
                                     {"tail_read_us", worker::MonoUs(tail_read)},
                                     {"last_layer_end_us", worker::MonoUs(last_layer_end_)},
                                     {"now_us", worker::MonoUs(tail_start)}});
    TailFromProto(chunk_.tail(), &*image_);
    if (!stores_.empty()) {
      KVT_RETURN_IF_ERROR(
          svc_->replicas_->SetReplicas(id_->tenant, id_->session, stores_, svc_->StoreCall(*ctx_)));
    }
    const auto import_start = std::chrono::steady_clock::now();
    absl::Status s = svc_->transfer_.ImportSession(*id_, *image_, std::move(layers_),
                                                   &reused_bytes_, std::move(prep_));
    const double import_ms = worker::MsSince(import_start);
    hold_.reset();  // Imported: the session's own bytes count now.
    if (!s.ok()) {
      if (!stores_.empty() && !absl::IsAlreadyExists(s)) {
        svc_->replicas_->Forget(id_->tenant, id_->session);
      }
      return s;
    }
    v1::TransferSessionResponse resp;
    resp.set_bytes_received(received_);
    resp.set_import_ms(import_ms);
    resp.set_device_copy_ms(device_copy_ms_);
    resp.set_tail_wait_ms(tail_wait_ms);
    resp.set_span_ms(header_taken_.has_value() ? worker::MsSince(*header_taken_) : 0);
    resp.set_busy_ms(busy_ms_ + worker::MsSince(tail_start));
    *resp_ = wire::Serialize(resp);
    imported_ = true;
    return absl::OkStatus();
  }

  void End(const absl::Status& s) {
    if (!s.ok()) {
      LogWarn("session transfer refused",
              {{"session", id_.has_value() ? id_->ToString() : std::string("?")},
               {"error", s.ToString()}});
    } else {
      LogDebug("session transfer received",
               {{"session", id_->ToString()},
                {"busy_ms", busy_ms_},
                {"header_ms", header_ms_},
                {"layer_starts_ms", start_ms_},
                {"layer_ends_ms", end_ms_},
                {"device_ms", device_copy_ms_},
                {"answered_us", worker::MonoUs(std::chrono::steady_clock::now())}});
    }
    svc_->metrics_->Transfer("received",
                             device_bytes_ > 0 && device_path_.has_value() && device_path_->ok()
                                 ? **device_path_
                                 : std::string("grpc"),
                             s.ok(), received_ + device_bytes_, reused_bytes_);
    if (s.ok() && link_ != nullptr) {
      // Every receive on it has completed: it is kept for this sender's
      // next hand-off (put back before the sender hears the answer, so
      // that its next offer finds it).
      svc_->transfer_.device_links().Put(worker::ProcessKey(*peer_), std::move(nccl_id_),
                                         std::move(link_));
    }
    link_.reset();
    // The sender's allocations are closed before it hears the answer, after
    // which it may free them.
    ipc_.reset();
    // What arrived and was not imported goes before the sender hears the
    // answer, and so do the working-set bytes it held.
    layers_.clear();
    layer_ = worker::LayerImage();
    past_ = std::string();
    hold_.reset();
    svc_->UpdateWorkingSet();
    Finish(svc_->Done("TransferSession", s));
  }

  WorkerService* const svc_;
  grpc::CallbackServerContext* const ctx_;
  grpc::ByteBuffer* const resp_;
  // The read in flight lands in msg_, then joins queued_.
  absl::Mutex mu_;
  grpc::ByteBuffer msg_ ABSL_GUARDED_BY(mu_);
  std::deque<grpc::ByteBuffer> queued_ ABSL_GUARDED_BY(mu_);
  bool reading_ ABSL_GUARDED_BY(mu_) = false;       // A StartRead is outstanding.
  bool draining_ ABSL_GUARDED_BY(mu_) = false;      // A Drain is scheduled or runs.
  bool stream_ended_ ABSL_GUARDED_BY(mu_) = false;  // A read failed: no more come.
  // When the last message went to the queue (the tail's, once it is taken).
  std::chrono::steady_clock::time_point last_read_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // End was reached.
  v1::TransferChunk chunk_;
  std::optional<worker::SessionKey> id_;
  std::optional<worker::SessionImage> image_;
  std::vector<std::string> stores_;
  std::vector<worker::LayerImage> layers_;
  // The layer being gathered.
  bool gathering_ = false;
  worker::LayerImage layer_;
  std::string past_;
  uint64_t past_bytes_ = 0, open_bytes_ = 0;
  uint32_t crc_ = 0;
  // The header's tensor_checksums: crc_ leaves out the past bytes, which
  // EndLayer checks.
  bool tensor_checksums_ = false;
  uint64_t received_ = 0;
  // What has arrived, counted in the working set (from the header on).
  std::unique_ptr<worker::Engine::IncomingHold> hold_;
  uint64_t reused_bytes_ = 0;  // Taken from this worker's hand-off cache.
  // The header's sender device: the device path this worker takes its
  // device rounds by, or why none; on the NCCL path, the communicator.
  std::optional<worker::DeviceIdentity> peer_;
  std::optional<absl::StatusOr<std::string>> device_path_;
  std::string nccl_id_;
  std::unique_ptr<worker::DeviceLink> link_;
  // The CUDA IPC path: the sender's allocations this transfer opened, kept
  // open until it ends when the sender packs round layers.
  std::unique_ptr<worker::IpcSource> ipc_;
  bool ipc_packed_ = false;
  uint64_t device_bytes_ = 0;  // Copied device to device.
  double device_copy_ms_ = 0;  // Spent copying them, and placing layers on the GPU.
  std::unique_ptr<worker::PreparedImport> prep_;  // BeginImport's.
  // When the executor took the first message, and its time in Take() since.
  std::optional<std::chrono::steady_clock::time_point> header_taken_;
  double busy_ms_ = 0;
  double header_ms_ = 0, start_ms_ = 0, end_ms_ = 0;  // Of busy_ms_.
  std::chrono::steady_clock::time_point last_layer_end_;
  bool imported_ = false;
};

grpc::ServerReadReactor<grpc::ByteBuffer>* WorkerService::TransferSession(
    grpc::CallbackServerContext* ctx, grpc::ByteBuffer* resp) {
  return new TransferReactor(this, ctx, resp);
}

}  // namespace kvtier
