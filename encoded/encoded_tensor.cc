#include "encoded/encoded_tensor.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "kernels/crc32c.h"

namespace kvtier {

int DTypeSize(v1::DType dtype) { return DTypeSize(static_cast<DType>(dtype)); }

uint32_t ComputeTensorCrc(const v1::EncodedTensor& t) {
  uint32_t crc = 0;
  for (const auto& b : t.buffers()) crc = Crc32cExtend(crc, b.data().data(), b.data().size());
  return crc;
}

void SealTensor(v1::EncodedTensor* t) {
  t->set_format_version(kEncodedTensorFormatVersion);
  t->set_crc32c(ComputeTensorCrc(*t));
}

namespace {

absl::Status ValidateParams(const v1::EncodedTensor& t) {
  const v1::CodecParams& p = t.params();
  switch (t.codec()) {
    case v1::CODEC_RAW:
      if (p.bits() != 0 || p.group_size() != 0 || p.rank() != 0 || p.outlier_fraction() != 0) {
        return absl::InvalidArgumentError("CODEC_RAW takes no quantization parameters");
      }
      return absl::OkStatus();
    case v1::CODEC_KIVI:
    case v1::CODEC_KCVT:
      if (p.bits() != 2 && p.bits() != 4 && p.bits() != 8) {
        return absl::InvalidArgumentError(absl::StrCat("bits must be 2, 4 or 8, got ", p.bits()));
      }
      if (t.codec() == v1::CODEC_KIVI && p.group_size() == 0) {
        return absl::InvalidArgumentError("CODEC_KIVI needs group_size >= 1");
      }
      break;
    case v1::CODEC_GEAR:
    case v1::CODEC_GEAR_L:
      if (p.bits() != 2 && p.bits() != 4) {
        return absl::InvalidArgumentError(absl::StrCat("GEAR bits must be 2 or 4, got ", p.bits()));
      }
      if (p.backbone() != v1::CODEC_KIVI && p.backbone() != v1::CODEC_KCVT) {
        return absl::InvalidArgumentError("GEAR backbone must be CODEC_KIVI or CODEC_KCVT");
      }
      if (!(p.outlier_fraction() >= 0.0f && p.outlier_fraction() <= 0.5f)) {
        return absl::InvalidArgumentError("outlier_fraction must be in [0, 0.5]");
      }
      if (t.codec() == v1::CODEC_GEAR_L && p.outlier_fraction() != 0.0f) {
        return absl::InvalidArgumentError("GEAR-L has no sparse outliers");
      }
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown codec ", t.codec()));
  }
  if (t.role() != v1::TENSOR_ROLE_KEY && t.role() != v1::TENSOR_ROLE_VALUE) {
    return absl::InvalidArgumentError("a quantized tensor must say whether it holds K or V");
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

// The checks of ValidateTensor over tensor metadata `t` (whose own buffers
// are ignored) and the buffers in `bufs`.
absl::Status ValidateTensorView(const v1::EncodedTensor& t, const std::vector<BufferView>& bufs,
                                bool verify_crc = true) {
  if (t.format_version() == 0 || t.format_version() > kEncodedTensorFormatVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported EncodedTensor format_version ", t.format_version()));
  }
  const int dsize = DTypeSize(t.dtype());
  if (dsize == 0) return absl::InvalidArgumentError("tensor dtype is unspecified or unknown");
  if (t.shape_size() < 1 || t.shape_size() > 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor shape must have 1 to 8 dimensions, got ", t.shape_size()));
  }
  uint64_t elements = 1;
  for (int64_t d : t.shape()) {
    if (d < 1 || d >= (int64_t{1} << 31)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor dimension ", d, " out of range"));
    }
    elements *= static_cast<uint64_t>(d);
    if (elements >= (uint64_t{1} << 40)) {
      return absl::InvalidArgumentError("tensor has too many elements");
    }
  }
  if (auto s = ValidateParams(t); !s.ok()) return s;
  if (bufs.empty()) return absl::InvalidArgumentError("tensor has no buffers");
  if (t.codec() == v1::CODEC_RAW) {
    if (bufs.size() != 1 || bufs[0].kind != BufferKind::kRaw) {
      return absl::InvalidArgumentError("CODEC_RAW needs exactly one BUFFER_RAW");
    }
    const uint64_t want = elements * static_cast<uint64_t>(dsize);
    if (bufs[0].data.size() != want) {
      return absl::InvalidArgumentError(
          absl::StrCat("raw buffer holds ", bufs[0].data.size(), " bytes, shape needs ", want));
    }
  }
  if (!verify_crc) return absl::OkStatus();
  uint32_t crc = 0;
  for (const BufferView& b : bufs) crc = Crc32cExtend(crc, b.data.data(), b.data.size());
  if (crc != t.crc32c()) return absl::DataLossError("tensor crc32c does not match its buffers");
  return absl::OkStatus();
}

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;

// Reads one length-delimited field's bytes as a view into `base`.
bool ReadView(CodedInputStream* in, const char* base, std::string_view* out) {
  uint32_t len;
  if (!in->ReadVarint32(&len)) return false;
  const int pos = in->CurrentPosition();
  if (!in->Skip(static_cast<int>(len))) return false;
  *out = std::string_view(base + pos, len);
  return true;
}

// Parses a Buffer message in place.
bool ParseBuffer(std::string_view bytes, BufferView* out) {
  CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                      static_cast<int>(bytes.size()));
  *out = BufferView();
  for (uint32_t tag; (tag = in.ReadTag()) != 0;) {
    const int field = static_cast<int>(WireFormatLite::GetTagFieldNumber(tag));
    const auto type = WireFormatLite::GetTagWireType(tag);
    if (field == 1 && type == WireFormatLite::WIRETYPE_VARINT) {
      uint64_t v;
      if (!in.ReadVarint64(&v)) return false;
      out->kind = static_cast<BufferKind>(static_cast<int32_t>(v));
    } else if (field == 2 && type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      if (!ReadView(&in, bytes.data(), &out->data)) return false;
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      return false;
    }
  }
  return in.ConsumedEntireMessage();
}

// Splits an EncodedTensor message into its metadata (parsed normally, without
// buffers) and views of its buffers.
absl::Status SplitTensorBytes(std::string_view bytes, TensorParts* out) {
  CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                      static_cast<int>(bytes.size()));
  std::string meta;
  out->buffers.clear();
  for (;;) {
    const int start = in.CurrentPosition();
    const uint32_t tag = in.ReadTag();
    if (tag == 0) break;
    if (WireFormatLite::GetTagFieldNumber(tag) == 8 &&
        WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      std::string_view view;
      BufferView b;
      if (!ReadView(&in, bytes.data(), &view) || !ParseBuffer(view, &b)) {
        return absl::InvalidArgumentError("tensor buffer does not parse");
      }
      out->buffers.push_back(b);
      continue;
    }
    if (!WireFormatLite::SkipField(&in, tag)) {
      return absl::InvalidArgumentError("tensor does not parse");
    }
    meta.append(bytes.data() + start, in.CurrentPosition() - start);
  }
  if (!in.ConsumedEntireMessage()) return absl::InvalidArgumentError("tensor does not parse");
  if (!out->meta.ParseFromString(meta)) return absl::InvalidArgumentError("tensor does not parse");
  out->bytes = bytes;
  return absl::OkStatus();
}

// Extends `*crc` over bytes[*from, to), moves *from to `to` and counts the
// bytes in *covered (when not null).
void ExtendTo(const std::string_view bytes, size_t to, size_t* from, uint32_t* crc,
              uint64_t* covered = nullptr) {
  *crc = Crc32cExtend(*crc, bytes.data() + *from, to - *from);
  if (covered != nullptr) *covered += to - *from;
  *from = to;
}

// Reads `in` up to its next length-delimited field `field`, skipping the
// others, and past it: *at is where its bytes start (`base` plus the
// stream's position), *len their size. False at the message's end, with *ok
// false when the bytes did not parse.
bool NextBytesField(CodedInputStream* in, int field, size_t base, size_t* at, uint32_t* len,
                    bool* ok) {
  for (uint32_t tag; (tag = in->ReadTag()) != 0;) {
    if (static_cast<int>(WireFormatLite::GetTagFieldNumber(tag)) != field ||
        WireFormatLite::GetTagWireType(tag) != WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      if (!WireFormatLite::SkipField(in, tag)) break;
      continue;
    }
    if (!in->ReadVarint32(len)) break;
    *at = base + static_cast<size_t>(in->CurrentPosition());
    if (!in->Skip(static_cast<int>(*len))) break;
    return true;
  }
  *ok = in->ConsumedEntireMessage();
  return false;
}

// Crc32cOutsideBufferData over bytes[begin, end) of `bytes`, from `*from`
// (everything before `begin` not yet checksummed is included); *covered
// (when not null) counts the bytes it extended over.
bool ExtendOutsideBufferData(std::string_view bytes, size_t begin, size_t end, size_t* from,
                             uint32_t* crc, uint64_t* covered = nullptr) {
  auto stream = [&](size_t at, size_t n) {
    return CodedInputStream(reinterpret_cast<const uint8_t*>(bytes.data() + at),
                            static_cast<int>(n));
  };
  CodedInputStream in = stream(begin, end - begin);
  size_t at = 0;
  uint32_t len = 0;
  bool ok = true;
  while (NextBytesField(&in, 8, begin, &at, &len, &ok)) {  // EncodedTensor.buffers
    // The Buffer message at [at, at + len): every data field is left out.
    CodedInputStream buf = stream(at, len);
    size_t data = 0;
    uint32_t n = 0;
    bool buf_ok = true;
    while (NextBytesField(&buf, 2, at, &data, &n, &buf_ok)) {  // Buffer.data
      ExtendTo(bytes, data, from, crc, covered);
      *from = data + n;
    }
    if (!buf_ok) return false;
  }
  if (!ok) return false;
  ExtendTo(bytes, end, from, crc, covered);
  return true;
}

}  // namespace

absl::StatusOr<uint32_t> Crc32cOutsideBufferData(uint32_t crc, std::string_view tensor) {
  if (tensor.size() > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError("tensor over 2 GiB");
  }
  size_t from = 0;
  if (!ExtendOutsideBufferData(tensor, 0, tensor.size(), &from, &crc)) {
    return absl::InvalidArgumentError("tensor does not parse");
  }
  return crc;
}

absl::StatusOr<uint32_t> Crc32cOutsidePayloadBufferData(uint32_t crc, std::string_view payload) {
  if (payload.size() > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError("segment payload over 2 GiB");
  }
  CodedInputStream in(reinterpret_cast<const uint8_t*>(payload.data()),
                      static_cast<int>(payload.size()));
  in.SetTotalBytesLimit(INT32_MAX);
  size_t from = 0, at = 0;
  uint32_t len = 0;
  bool ok = true;
  while (NextBytesField(&in, 1, 0, &at, &len, &ok)) {  // SegmentPayload.tensors
    if (!ExtendOutsideBufferData(payload, at, at + len, &from, &crc)) {
      return absl::InvalidArgumentError("segment payload tensor does not parse");
    }
  }
  if (!ok) return absl::InvalidArgumentError("segment payload is not a serialized SegmentPayload");
  ExtendTo(payload, payload.size(), &from, &crc);
  return crc;
}

absl::Status ValidateTensor(const v1::EncodedTensor& t, bool verify_crc) {
  std::vector<BufferView> bufs;
  bufs.reserve(t.buffers_size());
  for (const auto& b : t.buffers()) bufs.push_back({static_cast<BufferKind>(b.kind()), b.data()});
  return ValidateTensorView(t, bufs, verify_crc);
}

absl::StatusOr<int> ValidatePayloadBytes(std::string_view bytes) {
  KVT_ASSIGN_OR_RETURN(std::vector<TensorParts> parts, SplitPayload(bytes, /*verify_crc=*/true));
  if (parts.empty()) return absl::InvalidArgumentError("segment payload holds no tensors");
  return static_cast<int>(parts.size());
}

absl::StatusOr<v1::SegmentPayload> ParseAndValidatePayload(std::string_view bytes) {
  v1::SegmentPayload payload;
  if (!payload.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::InvalidArgumentError("segment payload is not a serialized SegmentPayload");
  }
  if (payload.tensors_size() == 0) {
    return absl::InvalidArgumentError("segment payload holds no tensors");
  }
  for (int i = 0; i < payload.tensors_size(); ++i) {
    absl::Status s = ValidateTensor(payload.tensors(i));
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("tensor ", i, ": ", s.message()));
    }
  }
  return payload;
}

}  // namespace kvtier

namespace kvtier {

absl::StatusOr<std::vector<TensorParts>> SplitPayload(std::string_view payload, bool verify_crc,
                                                      uint32_t* outside_crc) {
  if (payload.size() > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError("segment payload over 2 GiB");
  }
  CodedInputStream in(reinterpret_cast<const uint8_t*>(payload.data()),
                      static_cast<int>(payload.size()));
  in.SetTotalBytesLimit(INT32_MAX);
  std::vector<TensorParts> out;
  size_t from = 0;  // Where *outside_crc has reached.
  for (uint32_t tag; (tag = in.ReadTag()) != 0;) {
    if (WireFormatLite::GetTagFieldNumber(tag) == 1 &&
        WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      std::string_view view;
      if (!ReadView(&in, payload.data(), &view)) {
        return absl::InvalidArgumentError("segment payload is not a serialized SegmentPayload");
      }
      TensorParts& t = out.emplace_back();
      size_t own_from = 0;
      if (!ExtendOutsideBufferData(view, 0, view.size(), &own_from, &t.outside.crc,
                                   &t.outside.len)) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", out.size() - 1, ": segment payload tensor does not parse"));
      }
      if (outside_crc != nullptr) {
        // The framing before the tensor, then the tensor's own part.
        const size_t at = static_cast<size_t>(view.data() - payload.data());
        ExtendTo(payload, at, &from, outside_crc);
        *outside_crc = Crc32cCombine(*outside_crc, t.outside.crc, t.outside.len);
        from = at + view.size();
      }
      absl::Status s = SplitTensorBytes(view, &t);
      if (s.ok()) s = ValidateTensorView(t.meta, t.buffers, verify_crc);
      if (!s.ok()) {
        return absl::Status(s.code(), absl::StrCat("tensor ", out.size() - 1, ": ", s.message()));
      }
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      return absl::InvalidArgumentError("segment payload is not a serialized SegmentPayload");
    }
  }
  if (!in.ConsumedEntireMessage()) {
    return absl::InvalidArgumentError("segment payload is not a serialized SegmentPayload");
  }
  if (outside_crc != nullptr) ExtendTo(payload, payload.size(), &from, outside_crc);
  return out;
}

}  // namespace kvtier
