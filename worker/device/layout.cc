#include "worker/device/layout.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "worker/device/attention.h"

namespace kvtier::worker {
namespace {

int DtypeCode(DType t) { return t == DType::kFp32 ? 0 : t == DType::kFp16 ? 1 : 2; }
int64_t DtypeBytes(DType t) { return t == DType::kFp32 ? 4 : 2; }

// Where the staged array ends: `host`'s size, or a bare count where nothing
// is copied (LayOutView).
struct StagedEnd {
  std::vector<uint8_t>* host = nullptr;
  size_t end = 0;
};

// Appends `bytes` at a 256-byte boundary and returns the offset.
size_t Stage(StagedEnd* to, const void* src, size_t bytes, StagedKv* p) {
  const size_t off = (to->end + 255) / 256 * 256;
  to->end = off + bytes;
  if (to->host != nullptr) to->host->resize(to->end);
  if (bytes > 0) {
    if (to->host != nullptr) std::memcpy(to->host->data() + off, src, bytes);
    p->regions.push_back({static_cast<const uint8_t*>(src), off, bytes});
  }
  return off;
}

absl::StatusOr<StagedKv> StageInto(const EncodedView& v, int head_dim, StagedEnd* host);

}  // namespace

absl::StatusOr<StagedKv> StageView(const EncodedView& v, int head_dim, std::vector<uint8_t>* host) {
  StagedEnd to{host, host->size()};
  return StageInto(v, head_dim, &to);
}

absl::StatusOr<StagedKv> LayOutView(const EncodedView& v, int head_dim, size_t* staged_end) {
  StagedEnd to{nullptr, *staged_end};
  absl::StatusOr<StagedKv> p = StageInto(v, head_dim, &to);
  *staged_end = to.end;
  return p;
}

namespace {

absl::StatusOr<StagedKv> StageInto(const EncodedView& v, int head_dim, StagedEnd* host) {
  const int d = head_dim;
  if (v.slabs != 1 || v.head_dim != d) {
    return absl::InvalidArgumentError("device layers hold [1, tokens, head_dim] tensors");
  }
  StagedKv p;
  p.kv.dtype = DtypeCode(v.dtype);
  const int64_t eb = DtypeBytes(v.dtype);
  if (v.codec == Codec::kRaw) {
    p.kv.quantized_kind = 0;
    p.kv.token_stride = d;  // Encoded raw tensors are dense.
    p.raw = Stage(host, v.raw, static_cast<size_t>(v.tokens * d * eb), &p);
    return p;
  }
  if ((v.codec != Codec::kKivi && v.codec != Codec::kKcvt) || v.rank > 0 ||
      v.outliers_per_row > 0) {
    return absl::UnimplementedError("the device working set reads raw, KIVI and KCVT tensors only");
  }
  p.kv.quantized_kind = 1;
  p.kv.bits = v.bits;
  p.kv.group = v.group;
  p.kv.key = v.role != TensorRole::kValue ? 1 : 0;
  p.kv.quantized = v.quantized;
  p.codes = Stage(host, v.codes, static_cast<size_t>(v.words_per_slab) * 4, &p);
  p.scales = Stage(host, v.scales, static_cast<size_t>(v.groups_per_slab) * 2, &p);
  p.zeros = Stage(host, v.zeros, static_cast<size_t>(v.groups_per_slab) * 2, &p);
  if (v.residual > 0) {
    p.residual = Stage(host, v.residual_data, static_cast<size_t>(v.residual * d * eb), &p);
  }
  return p;
}

}  // namespace

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

size_t Unstaging::bytes() const {
  size_t n = rest.size();
  for (const Cut& c : cuts) n += c.size;
  return n;
}

absl::StatusOr<Unstaging> PlanUnstaging(std::string_view tensor, const StagedKv& staged) {
  std::vector<StagedRegion> regions = staged.regions;
  std::sort(regions.begin(), regions.end(),
            [](const StagedRegion& a, const StagedRegion& b) { return a.src < b.src; });
  const auto* begin = reinterpret_cast<const uint8_t*>(tensor.data());
  const auto* end = begin + tensor.size();
  Unstaging u;
  const uint8_t* at = begin;  // Bytes before `at` are placed.
  for (const StagedRegion& r : regions) {
    // Compared as addresses: the regions point into the tensor's bytes.
    const auto a = reinterpret_cast<uintptr_t>(r.src);
    if (a < reinterpret_cast<uintptr_t>(at) || r.size > static_cast<size_t>(end - begin) ||
        a > reinterpret_cast<uintptr_t>(end) - r.size) {
      return absl::InternalError(
          "a staged buffer does not lie inside its serialized tensor (or overlaps another)");
    }
    const size_t gap = static_cast<size_t>(a - reinterpret_cast<uintptr_t>(at));
    u.rest.append(reinterpret_cast<const char*>(at), gap);
    u.cuts.push_back({u.rest.size(), r.offset, r.size});
    at = r.src + r.size;
  }
  u.rest.append(reinterpret_cast<const char*>(at), static_cast<size_t>(end - at));
  return u;
}

absl::Status Unstage(const Unstaging& u, const uint8_t* base, size_t size, std::string* out) {
  out->reserve(out->size() + u.bytes());
  size_t from = 0;
  for (const Unstaging::Cut& c : u.cuts) {
    if (c.offset > size || c.size > size - c.offset || c.at < from || c.at > u.rest.size()) {
      return absl::InternalError(absl::StrCat("staged region [", c.offset, ", +", c.size,
                                              ") outside the ", size, " staged bytes"));
    }
    out->append(u.rest, from, c.at - from);
    out->append(reinterpret_cast<const char*>(base + c.offset), c.size);
    from = c.at;
  }
  out->append(u.rest, from, std::string::npos);
  return absl::OkStatus();
}

absl::Status DeviceLayer::Serialized(std::vector<std::string>* tensors) const {
  if (unstaging_.empty()) {
    return absl::InternalError(
        "this device layer was uploaded without its serialized tensors: it cannot be read back");
  }
  std::string staged;
  KVT_RETURN_IF_ERROR(Download(&staged));
  tensors->assign(unstaging_.size(), std::string());
  for (size_t i = 0; i < unstaging_.size(); ++i) {
    KVT_RETURN_IF_ERROR(Unstage(unstaging_[i], reinterpret_cast<const uint8_t*>(staged.data()),
                                staged.size(), &(*tensors)[i]));
  }
  return absl::OkStatus();
}

}  // namespace kvtier::worker
