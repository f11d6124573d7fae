#include "rpc/wire_format.h"

#include <algorithm>
#include <cstring>

#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/proto_buffer_writer.h"

namespace kvtier::wire {
namespace {

size_t PutVarint(uint64_t v, char* out) {
  size_t n = 0;
  while (v >= 0x80) {
    out[n++] = static_cast<char>(v | 0x80);
    v >>= 7;
  }
  out[n++] = static_cast<char>(v);
  return n;
}

void ReleaseOwner(void* p) { delete static_cast<std::shared_ptr<const std::string>*>(p); }
void NoRelease(void*) {}

}  // namespace

grpc::ByteBuffer BytesFieldMessage(int field, const char* data, size_t len,
                                   std::shared_ptr<const std::string> owner) {
  std::string head;
  AppendLengthDelimitedHead(field, len, &head);
  grpc::Slice slices[2] = {grpc::Slice(head.data(), head.size()), grpc::Slice()};
  if (owner != nullptr) {
    slices[1] = grpc::Slice(const_cast<char*>(data), len, ReleaseOwner,
                            new std::shared_ptr<const std::string>(std::move(owner)));
  } else {
    slices[1] = grpc::Slice(const_cast<char*>(data), len, NoRelease, nullptr);
  }
  return grpc::ByteBuffer(slices, len > 0 ? 2 : 1);
}

grpc::ByteBuffer BytesFieldMessage(int field, const std::vector<BytesPiece>& pieces) {
  constexpr size_t kCopyBelow = 256;
  size_t len = 0;
  for (const BytesPiece& p : pieces) len += p.len;
  std::string small;  // The field's head, then small pieces up to the next large one.
  AppendLengthDelimitedHead(field, len, &small);
  std::vector<grpc::Slice> slices;
  auto flush = [&] {
    if (small.empty()) return;
    slices.emplace_back(small.data(), small.size());
    small.clear();
  };
  for (const BytesPiece& p : pieces) {
    if (p.len == 0) continue;
    if (p.len < kCopyBelow) {
      small.append(p.data, p.len);
      continue;
    }
    flush();
    if (p.owner != nullptr) {
      slices.emplace_back(const_cast<char*>(p.data), p.len, ReleaseOwner,
                          new std::shared_ptr<const std::string>(p.owner));
    } else {
      slices.emplace_back(const_cast<char*>(p.data), p.len, NoRelease, nullptr);
    }
  }
  flush();
  return grpc::ByteBuffer(slices.data(), slices.size());
}

void AppendLengthDelimitedHead(int field, size_t len, std::string* out) {
  char head[20];
  size_t n = PutVarint((static_cast<uint64_t>(field) << 3) | 2, head);
  n += PutVarint(len, head + n);
  out->append(head, n);
}

grpc::ByteBuffer Serialize(const google::protobuf::MessageLite& m) {
  std::string s = m.SerializeAsString();
  grpc::Slice slice(s.data(), s.size());
  return grpc::ByteBuffer(&slice, 1);
}

absl::Status Parse(const grpc::ByteBuffer& b, google::protobuf::MessageLite* m) {
  grpc::ByteBuffer copy(b);  // Shares slices; the reader consumes its own view.
  grpc::ProtoBufferReader reader(&copy);
  if (!m->ParseFromZeroCopyStream(&reader)) {
    return absl::InvalidArgumentError("message does not parse as " + m->GetTypeName());
  }
  return absl::OkStatus();
}

void Field::AppendTo(std::string* out) const {
  for (const auto& [p, n] : spans) out->append(p, n);
}

std::string Field::ToString() const {
  std::string s;
  s.reserve(size);
  AppendTo(&s);
  return s;
}

absl::StatusOr<Field> SingleField(const grpc::ByteBuffer& b) {
  Field f;
  if (!b.Dump(&f.slices).ok()) return absl::FailedPreconditionError("unreadable buffer");
  FieldReader::Spans all;
  for (const grpc::Slice& s : f.slices) {
    all.push_back({reinterpret_cast<const char*>(s.begin()), s.size()});
  }
  FieldReader r(std::move(all));
  int type = 0, more = 0;
  FieldReader::Spans rest;
  if (!r.Next(&f.number, &f.spans, &type) || type != 2 || r.Next(&more, &rest) || !r.ok()) {
    return absl::FailedPreconditionError("not a single length-delimited field");
  }
  for (const auto& span : f.spans) f.size += span.second;
  return f;
}

bool FieldReader::Byte(uint8_t* b) {
  while (i_ < spans_.size() && off_ == spans_[i_].second) {
    ++i_;
    off_ = 0;
  }
  if (i_ == spans_.size()) return false;
  *b = static_cast<uint8_t>(spans_[i_].first[off_++]);
  return true;
}

bool FieldReader::Varint(uint64_t* v) {
  *v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    uint8_t b;
    if (!Byte(&b)) return false;
    *v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if ((b & 0x80) == 0) return true;
  }
  return false;
}

bool FieldReader::Take(size_t n, Spans* out) {
  while (n > 0) {
    if (i_ == spans_.size()) return false;
    const size_t k = std::min(spans_[i_].second - off_, n);
    if (k > 0 && out != nullptr) out->push_back({spans_[i_].first + off_, k});
    off_ += k;
    n -= k;
    if (off_ == spans_[i_].second) {
      ++i_;
      off_ = 0;
    }
  }
  return true;
}

bool FieldReader::Next(int* number, Spans* bytes, int* wire_type) {
  while (i_ < spans_.size() && off_ == spans_[i_].second) {
    ++i_;
    off_ = 0;
  }
  if (!ok_ || i_ == spans_.size()) return false;  // An earlier error, or the end.
  uint64_t tag, v;
  ok_ = Varint(&tag) && (tag >> 3) != 0 && (tag >> 3) <= 536870911;
  if (!ok_) return false;
  *number = static_cast<int>(tag >> 3);
  if (wire_type != nullptr) *wire_type = static_cast<int>(tag & 7);
  switch (tag & 7) {
    case 0:  // Varint.
      ok_ = Varint(&v);
      break;
    case 1:  // 64-bit.
      ok_ = Take(8, nullptr);
      break;
    case 2:  // Length-delimited.
      ok_ = Varint(&v) && Take(static_cast<size_t>(v), bytes);
      break;
    case 5:  // 32-bit.
      ok_ = Take(4, nullptr);
      break;
    default:  // Groups and invalid types: not in these messages.
      ok_ = false;
  }
  return ok_;
}

}  // namespace kvtier::wire
