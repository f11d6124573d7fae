#include "client/store_client.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "kernels/crc32c.h"
#include "rpc/grpc_status.h"
#include "rpc/raw_call.h"
#include "rpc/transport_args.h"
#include "rpc/wire_format.h"

namespace kvtier {

StoreClient::StoreClient(StoreClientOptions options, std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(v1::Store::NewStub(channel_)) {}

absl::StatusOr<std::unique_ptr<StoreClient>> StoreClient::Connect(StoreClientOptions options) {
  if (options.target.empty()) return absl::InvalidArgumentError("StoreClient needs a target");
  if (options.chunk_bytes == 0 || options.chunk_bytes > (size_t{4} << 20)) {
    return absl::InvalidArgumentError("chunk_bytes must be in [1, 4 MiB]");
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(8 << 20);
  ApplyBulkTransportArgs(&args);
  ApplyReconnectArgs(&args);
  std::shared_ptr<grpc::ChannelCredentials> creds =
      ClientChannelCredentials(ClientTls{options.tls_root_certs, options.tls_server_name,
                                         options.tls_cert_chain, options.tls_private_key},
                               &args);
  auto channel = grpc::CreateCustomChannel(options.target, creds, args);
  return std::unique_ptr<StoreClient>(new StoreClient(std::move(options), std::move(channel)));
}

std::unique_ptr<grpc::ClientContext> StoreClient::NewContext(const CallOptions& call) const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  if (!options_.token.empty()) ctx->AddMetadata("authorization", "Bearer " + options_.token);
  if (!call.tenant.empty()) ctx->AddMetadata("kvtier-tenant", call.tenant);
  ctx->set_deadline(absl::ToChronoTime(call.DeadlineOr(options_.deadline)));
  return ctx;
}

namespace {

// A header message for `a` and its payload.
grpc::ByteBuffer HeaderMessage(const PutSegmentArgs& a, std::string_view payload) {
  v1::PutSegmentRequest req;
  v1::PutSegmentHeader* h = req.mutable_header();
  h->set_session_id(a.session_id);
  h->mutable_ref()->set_round(a.round);
  h->mutable_ref()->set_segment(a.segment);
  h->set_layer_begin(a.layer_begin);
  h->set_layer_end(a.layer_end);
  h->set_payload_bytes(payload.size());
  h->set_payload_crc32c(Crc32c(payload));
  if (a.round_summary != nullptr) *h->mutable_round_summary() = *a.round_summary;
  if (a.session_ttl_seconds.has_value()) h->set_session_ttl_seconds(*a.session_ttl_seconds);
  return wire::Serialize(req);
}

// Writes `payload`'s chunks; false once a write fails (the server finished
// the call). Chunks reference `payload` directly: it outlives the call.
bool WriteChunks(RawCall& call, std::string_view payload, size_t chunk_bytes) {
  bool ok = true;
  for (size_t off = 0; ok && off < payload.size(); off += chunk_bytes) {
    ok = call.Write(wire::BytesFieldMessage(2, payload.data() + off,
                                            std::min(chunk_bytes, payload.size() - off), nullptr));
  }
  return ok;
}

// Ends an upload whose messages are written (`ok`: every write went
// through): half-closes, reads the one reply and the call's status. A failed
// write means the server already finished the call: its status comes from
// Finish().
template <typename Response>
absl::StatusOr<Response> FinishUpload(RawCall& call, bool ok, const char* method) {
  if (ok) ok = call.WritesDone();
  grpc::ByteBuffer reply;
  const bool got_reply = ok && call.Read(&reply);
  grpc::Status s = call.Finish();
  if (!s.ok()) return FromGrpc(s);
  if (!got_reply) return absl::InternalError(absl::StrCat(method, " finished OK without a reply"));
  Response resp;
  if (absl::Status p = wire::Parse(reply, &resp); !p.ok()) return p;
  return resp;
}

}  // namespace

absl::StatusOr<v1::PutSegmentResponse> StoreClient::PutSegment(const PutSegmentArgs& a,
                                                               std::string_view payload,
                                                               const CallOptions& call_options) {
  auto ctx = NewContext(call_options);
  RawCall call(channel_, ctx.get(), "/kvtier.v1.Store/PutSegment");
  const bool ok =
      call.Write(HeaderMessage(a, payload)) && WriteChunks(call, payload, options_.chunk_bytes);
  return FinishUpload<v1::PutSegmentResponse>(call, ok, "PutSegment");
}

absl::StatusOr<std::vector<absl::StatusOr<v1::PutSegmentResponse>>> StoreClient::PutSegments(
    const std::vector<PutSegmentsItem>& items, const CallOptions& call_options) {
  if (items.empty() || items.size() > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("PutSegments takes 1 to 4096 segments, got ", items.size()));
  }
  auto ctx = NewContext(call_options);
  RawCall call(channel_, ctx.get(), "/kvtier.v1.Store/PutSegments");
  bool ok = true;
  for (size_t i = 0; ok && i < items.size(); ++i) {
    ok = call.Write(HeaderMessage(items[i].args, items[i].payload)) &&
         WriteChunks(call, items[i].payload, options_.chunk_bytes);
  }
  KVT_ASSIGN_OR_RETURN(v1::PutSegmentsResponse resp,
                       FinishUpload<v1::PutSegmentsResponse>(call, ok, "PutSegments"));
  if (resp.results_size() != static_cast<int>(items.size())) {
    return absl::InternalError(absl::StrCat("PutSegments answered ", resp.results_size(),
                                            " results for ", items.size(), " segments"));
  }
  std::vector<absl::StatusOr<v1::PutSegmentResponse>> out;
  out.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    v1::PutSegmentsResult& r = *resp.mutable_results(static_cast<int>(i));
    if (r.ref().round() != items[i].args.round || r.ref().segment() != items[i].args.segment) {
      return absl::InternalError(absl::StrCat("PutSegments result ", i, " names round ",
                                              r.ref().round(), " segment ", r.ref().segment()));
    }
    if (r.code() != 0) {
      const int code = r.code() > 0 && r.code() <= 16 ? r.code() : 2;  // Else UNKNOWN.
      out.push_back(absl::Status(static_cast<absl::StatusCode>(code), r.message()));
      continue;
    }
    v1::PutSegmentResponse one;
    *one.mutable_segment() = std::move(*r.mutable_segment());
    one.set_charged_bytes(r.charged_bytes());
    out.push_back(std::move(one));
  }
  return out;
}

absl::StatusOr<std::vector<FetchedSegment>> StoreClient::GetSegments(
    const std::string& session_id, const std::vector<v1::SegmentRef>& refs,
    const CallOptions& call_options, bool uncounted, bool missing_ok) {
  auto ctx = NewContext(call_options);
  RawCall call(channel_, ctx.get(), "/kvtier.v1.Store/GetSegments");
  v1::GetSegmentsRequest req;
  req.set_session_id(session_id);
  for (const auto& r : refs) *req.add_refs() = r;
  req.set_uncounted(uncounted);
  req.set_accept_batches(true);
  req.set_missing_ok(missing_ok);
  std::vector<FetchedSegment> out;
  std::vector<uint32_t> crcs;  // Running CRC-32C of each segment's payload.
  absl::Status protocol;
  // A segment's header starts it; its bytes follow, checksummed as they
  // land, while they are still in cache.
  auto start = [&](const v1::GetSegmentsHeader& header) {
    FetchedSegment f;
    f.info = header.segment();
    f.served_from = header.served_from();
    if (header.missing() && (!missing_ok || f.info.payload_bytes() != 0)) {
      protocol = absl::InternalError("GetSegments sent a missing segment that was not asked for");
      return false;
    }
    f.missing = header.missing();
    if (f.info.payload_bytes() > (uint64_t{4} << 30)) {
      protocol = absl::InternalError("GetSegments announced an implausible segment size");
      return false;
    }
    f.payload.reserve(f.info.payload_bytes());
    out.push_back(std::move(f));
    crcs.push_back(0);
    return true;
  };
  auto take = [&](const char* p, size_t n) {
    if (out.empty() || out.back().payload.size() + n > out.back().info.payload_bytes()) {
      protocol = absl::InternalError("GetSegments sent bytes outside a segment");
      return false;
    }
    std::string& payload = out.back().payload;
    payload.append(p, n);
    crcs.back() = Crc32cExtend(crcs.back(), p, n);
    return true;
  };
  // GetSegmentsResponse.batch: whole segments, each a header and its payload.
  auto take_batch = [&](const wire::FieldReader::Spans& batch) {
    wire::FieldReader segments(batch);
    int number;
    wire::FieldReader::Spans item;
    for (; segments.Next(&number, &item); item.clear()) {
      if (number != 1) continue;  // GetSegmentsBatch.segments
      wire::FieldReader fields(item);
      wire::FieldReader::Spans bytes, payload;
      std::string header_bytes;
      bool has_header = false;
      for (; fields.Next(&number, &bytes); bytes.clear()) {
        if (number == 1) {
          has_header = true;
          header_bytes.clear();
          for (const auto& [p, n] : bytes) header_bytes.append(p, n);
        } else if (number == 2) {
          payload = bytes;
        }
      }
      v1::GetSegmentsHeader header;
      if (!fields.ok() || !has_header || !header.ParseFromString(header_bytes)) {
        protocol = absl::InternalError("GetSegments batch does not parse");
        return;
      }
      if (!start(header)) return;
      for (const auto& [p, n] : payload) {
        if (!take(p, n)) return;
      }
      if (out.back().payload.size() != out.back().info.payload_bytes()) {
        protocol = absl::InternalError("GetSegments batched a segment with part of its bytes");
        return;
      }
    }
    if (!segments.ok()) protocol = absl::InternalError("GetSegments batch does not parse");
  };
  if (call.Write(wire::Serialize(req)) && call.WritesDone()) {
    grpc::ByteBuffer msg;
    while (protocol.ok() && call.Read(&msg)) {
      constexpr int kHeader = 1, kChunk = 2, kBatch = 3;
      absl::StatusOr<wire::Field> field = wire::SingleField(msg);
      if (field.ok() && field->number == kChunk) {
        for (const auto& [p, n] : field->spans) {
          if (!take(p, n)) break;
        }
        continue;
      }
      if (field.ok() && field->number == kBatch) {
        take_batch(field->spans);
        continue;
      }
      v1::GetSegmentsResponse parsed;
      if (field.ok() && field->number == kHeader) {
        if (!parsed.mutable_header()->ParseFromString(field->ToString())) {
          protocol = absl::InternalError("GetSegments header does not parse");
          break;
        }
      } else if (protocol = wire::Parse(msg, &parsed); !protocol.ok()) {
        break;
      }
      switch (parsed.msg_case()) {
        case v1::GetSegmentsResponse::kHeader:
          start(parsed.header());
          break;
        case v1::GetSegmentsResponse::kChunk:
          take(parsed.chunk().data(), parsed.chunk().size());
          break;
        case v1::GetSegmentsResponse::kBatch: {
          // Parsed whole (a peer's framing other than ours): its segments'
          // bytes are in the parsed message.
          const std::string batch = parsed.batch().SerializeAsString();
          take_batch({{batch.data(), batch.size()}});
          break;
        }
        default:
          protocol = absl::InternalError("GetSegments sent an empty message");
      }
    }
  }
  if (!protocol.ok()) ctx->TryCancel();
  grpc::Status s = call.Finish();
  if (!protocol.ok()) return protocol;
  if (!s.ok()) return FromGrpc(s);
  if (out.size() != refs.size()) {
    return absl::InternalError(
        absl::StrCat("GetSegments returned ", out.size(), " of ", refs.size(), " segments"));
  }
  for (size_t i = 0; i < out.size(); ++i) {
    const FetchedSegment& f = out[i];
    if (f.payload.size() != f.info.payload_bytes() || crcs[i] != f.info.payload_crc32c()) {
      return absl::DataLossError(absl::StrCat("round ", f.info.ref().round(), " segment ",
                                              f.info.ref().segment(),
                                              " arrived with a bad checksum"));
    }
  }
  return out;
}

namespace {

template <typename Resp>
absl::StatusOr<Resp> Finish(const grpc::Status& s, Resp resp) {
  if (!s.ok()) return FromGrpc(s);
  return resp;
}

}  // namespace

absl::StatusOr<v1::ListRoundsResponse> StoreClient::ListRounds(const std::string& session_id,
                                                               const CallOptions& call) {
  auto ctx = NewContext(call);
  v1::ListRoundsRequest req;
  req.set_session_id(session_id);
  v1::ListRoundsResponse resp;
  grpc::Status s = stub_->ListRounds(ctx.get(), req, &resp);
  return Finish(s, std::move(resp));
}

absl::StatusOr<v1::ListSessionsResponse> StoreClient::ListSessions(
    const v1::ListSessionsRequest& req, const CallOptions& call) {
  auto ctx = NewContext(call);
  v1::ListSessionsResponse resp;
  grpc::Status s = stub_->ListSessions(ctx.get(), req, &resp);
  return Finish(s, std::move(resp));
}

absl::StatusOr<v1::DropRoundsResponse> StoreClient::DropRounds(const std::string& session_id,
                                                               const std::vector<uint32_t>& rounds,
                                                               const CallOptions& call) {
  auto ctx = NewContext(call);
  v1::DropRoundsRequest req;
  req.set_session_id(session_id);
  for (uint32_t r : rounds) req.add_rounds(r);
  v1::DropRoundsResponse resp;
  grpc::Status s = stub_->DropRounds(ctx.get(), req, &resp);
  return Finish(s, std::move(resp));
}

absl::StatusOr<v1::DropSegmentsResponse> StoreClient::DropSegments(
    const std::string& session_id, const std::vector<v1::SegmentRef>& refs,
    const CallOptions& call) {
  auto ctx = NewContext(call);
  v1::DropSegmentsRequest req;
  req.set_session_id(session_id);
  for (const v1::SegmentRef& r : refs) *req.add_segments() = r;
  v1::DropSegmentsResponse resp;
  grpc::Status s = stub_->DropSegments(ctx.get(), req, &resp);
  return Finish(s, std::move(resp));
}

absl::StatusOr<v1::RecordRecallsResponse> StoreClient::RecordRecalls(
    const std::string& session_id, const std::vector<uint32_t>& rounds, const CallOptions& call) {
  auto ctx = NewContext(call);
  v1::RecordRecallsRequest req;
  req.set_session_id(session_id);
  for (uint32_t r : rounds) req.add_rounds(r);
  v1::RecordRecallsResponse resp;
  grpc::Status s = stub_->RecordRecalls(ctx.get(), req, &resp);
  return Finish(s, std::move(resp));
}

absl::StatusOr<v1::DeleteSessionResponse> StoreClient::DeleteSession(const std::string& session_id,
                                                                     const CallOptions& call) {
  auto ctx = NewContext(call);
  v1::DeleteSessionRequest req;
  req.set_session_id(session_id);
  v1::DeleteSessionResponse resp;
  grpc::Status s = stub_->DeleteSession(ctx.get(), req, &resp);
  return Finish(s, std::move(resp));
}

absl::Status StoreClient::PinSession(const std::string& session_id, bool pinned,
                                     const CallOptions& call) {
  auto ctx = NewContext(call);
  v1::PinSessionRequest req;
  req.set_session_id(session_id);
  req.set_pinned(pinned);
  v1::PinSessionResponse resp;
  return FromGrpc(stub_->PinSession(ctx.get(), req, &resp));
}

absl::StatusOr<v1::StatsResponse> StoreClient::Stats(const CallOptions& call) {
  auto ctx = NewContext(call);
  v1::StatsResponse resp;
  grpc::Status s = stub_->Stats(ctx.get(), v1::StatsRequest(), &resp);
  return Finish(s, std::move(resp));
}

}  // namespace kvtier
