// The raw wire framing of PutSegment and GetSegments (rpc/wire_format.h):
// what the store does with each message it reads, and what the client does
// with each one it receives, on bytes split across several slices the way
// gRPC hands them over.
#include <string>
#include <vector>

#include "fuzz/fuzz_target.h"
#include "kvtier/v1/store.pb.h"
#include "rpc/wire_format.h"
#include "testing/test_util.h"

namespace {

// The message as gRPC may deliver it: in 1 to 4 slices, cut where the first
// input byte says.
grpc::ByteBuffer Slices(const std::string& msg, uint8_t cuts) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (int i = 0; i < (cuts & 3) && at < msg.size(); ++i) {
    const size_t len = 1 + ((cuts >> (2 + 2 * i)) & 3) * (msg.size() - at) / 4;
    slices.emplace_back(msg.data() + at, std::min(len, msg.size() - at));
    at += slices.back().size();
  }
  if (at < msg.size() || slices.empty()) slices.emplace_back(msg.data() + at, msg.size() - at);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string msg(reinterpret_cast<const char*>(data + 1), size - 1);
  const grpc::ByteBuffer b = Slices(msg, data[0]);
  // The store's fast path: one length-delimited field, bytes left in place.
  absl::StatusOr<kvtier::wire::Field> f = kvtier::wire::SingleField(b);
  if (f.ok()) {
    std::string joined;
    f->AppendTo(&joined);
    if (joined.size() != f->size || joined != f->ToString()) __builtin_trap();
    kvtier::v1::PutSegmentHeader h;
    if (f->number == 1) (void)h.ParseFromString(joined);
    // The client's walk of a GetSegments batch: the same fields whether the
    // bytes lie in gRPC's slices or in one piece, nested a level down too.
    auto walk = [](const kvtier::wire::FieldReader::Spans& spans) {
      std::string out;
      kvtier::wire::FieldReader r(spans);
      int number = 0;
      kvtier::wire::FieldReader::Spans bytes;
      for (; r.Next(&number, &bytes); bytes.clear()) {
        out += std::to_string(number) + ":";
        kvtier::wire::FieldReader inner(bytes);
        kvtier::wire::FieldReader::Spans nested;
        while (inner.Next(&number, &nested)) {
          out += std::to_string(number) + ",";
          for (const auto& [p, n] : nested) out.append(p, n);
          nested.clear();
        }
        out += inner.ok() ? ";" : "!;";
      }
      return out + (r.ok() ? "ok" : "bad");
    };
    if (walk(f->spans) != walk({{joined.data(), joined.size()}})) __builtin_trap();
  }
  // The slow path, and the client's side of GetSegments.
  kvtier::v1::PutSegmentRequest put;
  kvtier::v1::GetSegmentsRequest get;
  kvtier::v1::GetSegmentsResponse resp;
  absl::Status p1 = kvtier::wire::Parse(b, &put);
  (void)kvtier::wire::Parse(b, &get);
  (void)kvtier::wire::Parse(b, &resp);
  // A field the fast path found must parse the same way in full.
  if (f.ok() && p1.ok() && f->number == 2 && put.has_chunk() && put.chunk() != f->ToString()) {
    __builtin_trap();
  }
  // Round trip what parsed.
  if (p1.ok()) {
    kvtier::v1::PutSegmentRequest again;
    if (!kvtier::wire::Parse(kvtier::wire::Serialize(put), &again).ok()) __builtin_trap();
  }
  return 0;
}

namespace kvtier::fuzz {

std::vector<std::string> Seeds() {
  std::vector<std::string> seeds;
  v1::PutSegmentRequest h;
  h.mutable_header()->set_session_id("chat-1");
  h.mutable_header()->mutable_ref()->set_round(3);
  h.mutable_header()->set_layer_end(2);
  h.mutable_header()->set_payload_bytes(4096);
  h.mutable_header()->set_session_ttl_seconds(0);
  v1::PutSegmentRequest c;
  c.set_chunk(testing::MakePayload(600, 1));
  v1::GetSegmentsRequest g;
  g.set_session_id("chat-1");
  g.add_refs()->set_round(1);
  g.add_refs()->set_segment(1);
  v1::GetSegmentsResponse batch;
  for (int i = 0; i < 2; ++i) {
    auto* item = batch.mutable_batch()->add_segments();
    item->mutable_header()->mutable_segment()->set_payload_bytes(300);
    item->set_payload(testing::MakePayload(300, i + 2));
  }
  v1::GetSegmentsResponse r;
  r.mutable_header()->mutable_segment()->set_payload_bytes(600);
  for (uint8_t cuts : {0x00, 0x01, 0x27, 0xff}) {
    for (const auto* m :
         std::vector<const google::protobuf::MessageLite*>{&h, &c, &g, &r, &batch}) {
      seeds.push_back(std::string(1, static_cast<char>(cuts)) + m->SerializeAsString());
    }
  }
  return seeds;
}

}  // namespace kvtier::fuzz
