#include "rpc/wire_format.h"

#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kvtier/v1/store.pb.h"

namespace kvtier::wire {
namespace {

using Spans = FieldReader::Spans;

// `s` cut into pieces of `step` bytes (the last shorter), as gRPC's slices
// may cut a message.
Spans Cut(const std::string& s, size_t step) {
  Spans out;
  for (size_t at = 0; at < s.size(); at += step) {
    out.push_back({s.data() + at, std::min(step, s.size() - at)});
  }
  return out;
}

std::string Join(const Spans& spans) {
  std::string s;
  for (const auto& [p, n] : spans) s.append(p, n);
  return s;
}

// A GetSegmentsBatch framed by hand (what the store sends) reads back field
// by field, wherever the bytes are cut, and parses as protobuf does.
TEST(WireFormat, FieldReaderWalksAHandFramedBatchAcrossAnyCut) {
  std::vector<std::pair<v1::GetSegmentsHeader, std::string>> segments;
  std::string batch;
  for (int i = 0; i < 3; ++i) {
    v1::GetSegmentsHeader h;
    h.mutable_segment()->mutable_ref()->set_round(static_cast<uint32_t>(i));
    h.mutable_segment()->set_payload_bytes(100 + 200 * i);
    const std::string payload(100 + 200 * i, static_cast<char>('a' + i));
    std::string item;
    AppendLengthDelimitedHead(1, h.ByteSizeLong(), &item);
    item += h.SerializeAsString();
    AppendLengthDelimitedHead(2, payload.size(), &item);
    item += payload;
    AppendLengthDelimitedHead(1, item.size(), &batch);
    batch += item;
    segments.push_back({h, payload});
  }
  // Protobuf reads the same bytes as the batch they describe.
  v1::GetSegmentsBatch parsed;
  ASSERT_TRUE(parsed.ParseFromString(batch));
  ASSERT_EQ(parsed.segments_size(), 3);
  EXPECT_EQ(parsed.segments(2).payload(), segments[2].second);

  for (size_t step : {size_t{1}, size_t{3}, size_t{64}, batch.size()}) {
    FieldReader outer(Cut(batch, step));
    int number = 0;
    Spans item;
    size_t seen = 0;
    for (; outer.Next(&number, &item); item.clear(), ++seen) {
      ASSERT_EQ(number, 1);
      ASSERT_LT(seen, segments.size());
      FieldReader inner(item);
      Spans bytes;
      std::vector<std::pair<int, std::string>> fields;
      for (; inner.Next(&number, &bytes); bytes.clear()) fields.push_back({number, Join(bytes)});
      EXPECT_TRUE(inner.ok());
      ASSERT_EQ(fields.size(), 2u);
      EXPECT_EQ(fields[0].first, 1);
      EXPECT_EQ(fields[0].second, segments[seen].first.SerializeAsString());
      EXPECT_EQ(fields[1].first, 2);
      EXPECT_EQ(fields[1].second, segments[seen].second);
    }
    EXPECT_TRUE(outer.ok()) << "step " << step;
    EXPECT_EQ(seen, segments.size()) << "step " << step;
  }
}

// Other wire types are stepped over; truncated or invalid bytes stop the
// walk with ok() false.
TEST(WireFormat, FieldReaderSkipsScalarsAndRejectsBrokenBytes) {
  v1::GetSegmentsHeader h;
  h.set_served_from(v1::TIER_DISK);           // Field 2, varint.
  h.mutable_segment()->set_payload_bytes(7);  // Field 1, bytes.
  const std::string bytes = h.SerializeAsString();
  std::vector<int> numbers;
  FieldReader r(Cut(bytes, 2));
  int number = 0;
  Spans s;
  for (; r.Next(&number, &s); s.clear()) numbers.push_back(number);
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(numbers, (std::vector<int>{1, 2}));

  for (const std::string& broken : {std::string("\x0a\x05"
                                                "abc",
                                                5),                     // Short bytes.
                                    std::string("\x0a", 1),             // No length.
                                    std::string("\x00\x01", 2),         // Field 0.
                                    std::string("\x0b\x00", 2),         // A group.
                                    std::string("\x09\x01\x02", 3)}) {  // Short fixed64.
    FieldReader b(Cut(broken, 1));
    while (b.Next(&number, &s)) s.clear();
    EXPECT_FALSE(b.ok()) << "bytes of size " << broken.size();
  }
  // Nothing at all is an empty, well-formed message.
  FieldReader empty(Spans{});
  EXPECT_FALSE(empty.Next(&number, &s));
  EXPECT_TRUE(empty.ok());
}

}  // namespace
}  // namespace kvtier::wire
