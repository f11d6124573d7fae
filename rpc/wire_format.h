// Hand-framed protobuf messages for the two hot streams (PutSegment chunks
// and GetSegments chunks), so payload bytes move between the application and
// gRPC without being copied into or out of protobuf objects.
//
// The framing is exactly protobuf's: a message with one length-delimited
// field is the bytes tag, varint(length), then the field's bytes. Anything
// that is not one such field falls back to a full protobuf parse, so any
// conforming peer interoperates.
#ifndef KVTIER_RPC_WIRE_FORMAT_H_
#define KVTIER_RPC_WIRE_FORMAT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/support/byte_buffer.h"

namespace kvtier::wire {

// A message of one length-delimited field `field` whose bytes are
// [data, data+len). No copy: the buffer references the memory, which `owner`
// keeps alive until gRPC lets go of it (owner may be null when the caller
// guarantees the memory outlives the call).
grpc::ByteBuffer BytesFieldMessage(int field, const char* data, size_t len,
                                   std::shared_ptr<const std::string> owner);

// The same over several pieces, in order (one field holding their
// concatenation): pieces of at least 256 bytes are referenced, smaller ones
// copied into the message.
struct BytesPiece {
  const char* data = nullptr;
  size_t len = 0;
  std::shared_ptr<const std::string> owner;
};
grpc::ByteBuffer BytesFieldMessage(int field, const std::vector<BytesPiece>& pieces);

// Appends the head of a length-delimited field: its tag, then `len` as a
// varint (the field's bytes follow it).
void AppendLengthDelimitedHead(int field, size_t len, std::string* out);

// Serializes a protobuf message into a ByteBuffer (one copy, for small
// messages).
grpc::ByteBuffer Serialize(const google::protobuf::MessageLite& m);
// Parses a ByteBuffer into `m`. INVALID_ARGUMENT when it does not parse.
absl::Status Parse(const grpc::ByteBuffer& b, google::protobuf::MessageLite* m);

// A received message split into its single top-level field, without copying
// the field's bytes out of gRPC's slices.
struct Field {
  int number = 0;
  std::vector<grpc::Slice> slices;                    // Keeps the bytes alive.
  std::vector<std::pair<const char*, size_t>> spans;  // The field's bytes, in order.
  size_t size = 0;
  void AppendTo(std::string* out) const;
  std::string ToString() const;
};

// Splits `b` if it is exactly one length-delimited field; nullopt-like error
// (FAILED_PRECONDITION) otherwise, in which case the caller should use
// Parse() on the whole message.
absl::StatusOr<Field> SingleField(const grpc::ByteBuffer& b);

// Walks the fields of a message whose bytes lie in `spans` (a Field's, for
// a nested message), in order, without copying them.
class FieldReader {
 public:
  using Spans = std::vector<std::pair<const char*, size_t>>;
  explicit FieldReader(Spans spans) : spans_(std::move(spans)) {}
  // The next field: its number, its wire type (when `wire_type` is not
  // null) and, for a length-delimited one, the spans of its bytes (appended
  // to `bytes`; other wire types are skipped and leave it empty). False at
  // the end; then ok() tells whether the bytes parsed.
  bool Next(int* number, Spans* bytes, int* wire_type = nullptr);
  bool ok() const { return ok_; }

 private:
  bool Byte(uint8_t* b);
  bool Varint(uint64_t* v);
  bool Take(size_t n, Spans* out);
  Spans spans_;
  size_t i_ = 0, off_ = 0;
  bool ok_ = true;
};

}  // namespace kvtier::wire

#endif  // KVTIER_RPC_WIRE_FORMAT_H_
