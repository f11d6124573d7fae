#include "worker/device_layout.h"

#include <cstring>

namespace kvtier::worker {
namespace {

int DtypeCode(v1::DType t) { return t == v1::DTYPE_FP32 ? 0 : t == v1::DTYPE_FP16 ? 1 : 2; }
int64_t DtypeBytes(v1::DType t) { return t == v1::DTYPE_FP32 ? 4 : 2; }

// Appends `bytes` at a 256-byte boundary and returns the offset.
size_t Stage(std::vector<uint8_t>* host, const void* src, size_t bytes) {
  const size_t off = (host->size() + 255) / 256 * 256;
  host->resize(off + bytes);
  if (bytes > 0) std::memcpy(host->data() + off, src, bytes);
  return off;
}

}  // namespace

absl::StatusOr<StagedKv> StageView(const EncodedView& v, int head_dim, std::vector<uint8_t>* host) {
  const int d = head_dim;
  if (v.slabs != 1 || v.head_dim != d) {
    return absl::InvalidArgumentError("device layers hold [1, tokens, head_dim] tensors");
  }
  StagedKv p;
  p.kv.dtype = DtypeCode(v.dtype);
  const int64_t eb = DtypeBytes(v.dtype);
  if (v.codec == v1::CODEC_RAW) {
    p.kv.quantized_kind = 0;
    p.kv.token_stride = d;  // Encoded raw tensors are dense.
    p.raw = Stage(host, v.raw, static_cast<size_t>(v.tokens * d * eb));
    return p;
  }
  if ((v.codec != v1::CODEC_KIVI && v.codec != v1::CODEC_KCVT) || v.rank > 0 ||
      v.outliers_per_row > 0) {
    return absl::UnimplementedError("the device working set reads raw, KIVI and KCVT tensors only");
  }
  p.kv.quantized_kind = 1;
  p.kv.bits = v.bits;
  p.kv.group = v.group;
  p.kv.key = v.role != v1::TENSOR_ROLE_VALUE ? 1 : 0;
  p.kv.quantized = v.quantized;
  p.codes = Stage(host, v.codes, static_cast<size_t>(v.words_per_slab) * 4);
  p.scales = Stage(host, v.scales, static_cast<size_t>(v.groups_per_slab) * 2);
  p.zeros = Stage(host, v.zeros, static_cast<size_t>(v.groups_per_slab) * 2);
  if (v.residual > 0) {
    p.residual = Stage(host, v.residual_data, static_cast<size_t>(v.residual * d * eb));
  }
  return p;
}

cuda::SegKv PlaceStaged(const StagedKv& s, const uint8_t* base) {
  cuda::SegKv kv = s.kv;
  if (kv.quantized_kind == 0) {
    kv.raw = base + s.raw;
  } else {
    kv.codes = reinterpret_cast<const uint32_t*>(base + s.codes);
    kv.scales = reinterpret_cast<const uint16_t*>(base + s.scales);
    kv.zeros = reinterpret_cast<const uint16_t*>(base + s.zeros);
    kv.residual = base + s.residual;  // Read only for rows past `quantized`.
  }
  return kv;
}

}  // namespace kvtier::worker
