// The decode side of kernels/codec.h: a tensor's header and buffers made
// into a view (checked against its layout), and rows decoded from it.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/codec.h"
#include "kernels/codec_internal.h"
#include "kernels/half.h"

namespace kvtier {

using internal::Dequant;
using internal::IsGear;
using internal::Layout;
using internal::MakeLayout;
using internal::QuantShape;
using internal::UseSimd;

absl::StatusOr<EncodedView> ViewOf(const TensorHeader& t, absl::Span<const BufferView> bufs) {
  KVT_ASSIGN_OR_RETURN(Layout l,
                       MakeLayout(t.codec, t.backbone, t.role, t.dtype, t.bits, t.group_size,
                                  t.residual_tokens, t.rank, t.outlier_fraction, t.shape));
  auto buf = [&](int i) { return reinterpret_cast<const uint8_t*>(bufs[i].data.data()); };
  // Every buffer's kind and exact size, in order.
  const std::vector<BufferSize> want = internal::BufferList(l);
  auto check_buffers = [&]() -> absl::Status {
    if (bufs.size() != want.size()) {
      return absl::InvalidArgumentError(absl::StrCat("codec ", CodecName(t.codec), " needs ",
                                                     want.size(), " buffers, tensor has ",
                                                     bufs.size()));
    }
    for (size_t i = 0; i < want.size(); ++i) {
      const BufferView& b = bufs[i];
      if (b.kind != want[i].kind || static_cast<int64_t>(b.data.size()) != want[i].bytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("buffer ", i, " is ", BufferKindName(b.kind), " of ", b.data.size(),
                         " bytes; the shape and parameters need ", BufferKindName(want[i].kind),
                         " of ", want[i].bytes));
      }
    }
    return absl::OkStatus();
  };
  if (t.codec == Codec::kRaw) {
    KVT_RETURN_IF_ERROR(check_buffers());
    return EncodedView::Raw(t.dtype, buf(0), l.slabs, l.tokens, l.d, l.tokens * l.d, l.d);
  }
  const bool grouped = t.codec == Codec::kKivi || (IsGear(t.codec) && t.backbone == Codec::kKivi);
  if (!grouped && t.group_size != 0) {
    return absl::InvalidArgumentError("KCVT takes no group_size");
  }
  if (t.residual_tokens > l.tokens) {
    return absl::InvalidArgumentError("residual_tokens exceeds the tensor's tokens");
  }
  if (!IsGear(t.codec) && (t.rank != 0 || t.backbone != Codec::kUnspecified)) {
    return absl::InvalidArgumentError("KIVI/KCVT take no rank or backbone");
  }
  KVT_RETURN_IF_ERROR(check_buffers());
  EncodedView v;
  v.codec = t.codec;
  v.role = t.role;
  v.dtype = t.dtype;
  v.bits = l.q.bits;
  v.group = l.q.group;
  v.slabs = l.slabs;
  v.tokens = l.tokens;
  v.head_dim = l.d;
  v.quantized = l.tq;
  v.residual = l.res;
  v.codes = buf(0);
  v.words_per_slab = internal::CodeWords(l.q);
  v.scales = reinterpret_cast<const uint16_t*>(buf(1));
  v.zeros = reinterpret_cast<const uint16_t*>(buf(2));
  v.groups_per_slab = internal::ScaleCount(l.q);
  int next = 3;
  if (l.res > 0) v.residual_data = buf(next++);
  v.slab_stride = l.res * l.d;
  v.token_stride = l.d;
  if (IsGear(t.codec) && l.rank > 0) {
    v.rank = l.rank;
    v.lowrank_a = reinterpret_cast<const uint16_t*>(buf(next++));
    v.lowrank_b = reinterpret_cast<const uint16_t*>(buf(next++));
  }
  if (t.codec == Codec::kGear) {
    v.outliers_per_row = l.outliers_per_row;
    v.sparse_rows_per_slab = l.sparse_rows;
    v.sparse_index_bytes = l.index_bytes;
    v.sparse_index = buf(next++);
    v.sparse_value = buf(next++);
    // Positions must be strictly increasing within each row and inside it.
    const int64_t rows = l.slabs * l.sparse_rows;
    for (int64_t r = 0; r < rows; ++r) {
      int64_t prev = -1;
      for (int k = 0; k < l.outliers_per_row; ++k) {
        const int64_t j =
            internal::ReadSparseIndex(v.sparse_index, l.index_bytes, r * l.outliers_per_row + k);
        if (j <= prev || j >= l.sparse_row_len) {
          return absl::InvalidArgumentError(
              absl::StrCat("sparse outlier position ", j, " in row ", r,
                           " is out of order or outside the row of ", l.sparse_row_len));
        }
        prev = j;
      }
    }
  }
  return v;
}

void DecodeRows(const EncodedView& v, int64_t s, int64_t t0, int64_t t1, float* out,
                KernelLevel level) {
  const int d = v.head_dim;
  if (v.codec == Codec::kRaw) {
    const int64_t base = s * v.slab_stride;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t at = base + t * v.token_stride;
      float* o = out + (t - t0) * d;
      // Whole rows at once (raw rows need not be aligned: byte offsets, and
      // WidenSimd reads with unaligned loads).
      const auto* bytes = static_cast<const uint8_t*>(v.raw);
      if (v.dtype == DType::kFp32) {
        std::memcpy(o, bytes + at * sizeof(float), sizeof(float) * d);
        continue;
      }
      if (UseSimd(level) && internal::WidenSimd(reinterpret_cast<const uint16_t*>(bytes + at * 2),
                                                v.dtype == DType::kBf16, d, o)) {
        continue;
      }
      for (int c = 0; c < d; ++c) {
        out[(t - t0) * d + c] =
            internal::LoadElement(v.dtype, v.raw, base + t * v.token_stride + c);
      }
    }
    return;
  }
  // Quantized rows [t0, min(t1, Tq)).
  const int64_t qe = std::min(t1, v.quantized);
  if (t0 < qe) {
    QuantShape q;
    q.key = v.role != TensorRole::kValue;
    q.bits = v.bits;
    q.group = v.group;
    q.tq = v.quantized;
    q.d = d;
    Dequant(q, v.codes + s * v.words_per_slab * 4, v.scales + s * v.groups_per_slab,
            v.zeros + s * v.groups_per_slab, t0, qe, out, level);
    if (v.rank > 0) {
      const uint16_t* a = v.lowrank_a + s * v.quantized * v.rank;
      const uint16_t* b16 = v.lowrank_b + s * v.rank * d;
      // B widened once; each row adds r scaled rows of it.
      std::vector<float> b(static_cast<size_t>(v.rank * d));
      for (size_t i = 0; i < b.size(); ++i) b[i] = HalfToFloat(internal::LoadU16(b16, i));
      for (int64_t t = t0; t < qe; ++t) {
        float* o = out + (t - t0) * d;
        for (int j = 0; j < v.rank; ++j) {
          const float aj = HalfToFloat(internal::LoadU16(a, t * v.rank + j));
          const float* bj = b.data() + j * d;
          if (!UseSimd(level) || !internal::AxpySimd(aj, bj, d, o)) {
            for (int c = 0; c < d; ++c) o[c] += aj * bj[c];
          }
        }
      }
    }
    if (v.outliers_per_row > 0) {
      const int opr = v.outliers_per_row;
      const bool key = v.role != TensorRole::kValue;
      const int64_t rows = v.sparse_rows_per_slab;
      auto value = [&](int64_t k) { return internal::LoadElement(v.dtype, v.sparse_value, k); };
      if (key) {  // Rows are channels; positions are tokens, in order.
        for (int c = 0; c < rows; ++c) {
          const int64_t base = (s * rows + c) * opr;
          // The first position at or after t0.
          int lo = 0, hi = opr;
          while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (internal::ReadSparseIndex(v.sparse_index, v.sparse_index_bytes, base + mid) < t0) {
              lo = mid + 1;
            } else {
              hi = mid;
            }
          }
          for (int k = lo; k < opr; ++k) {
            const int64_t t =
                internal::ReadSparseIndex(v.sparse_index, v.sparse_index_bytes, base + k);
            if (t >= qe) break;
            out[(t - t0) * d + c] = value(base + k);
          }
        }
      } else {  // Rows are tokens; positions are channels.
        for (int64_t t = t0; t < qe; ++t) {
          const int64_t base = (s * rows + t) * opr;
          for (int k = 0; k < opr; ++k) {
            const int64_t c =
                internal::ReadSparseIndex(v.sparse_index, v.sparse_index_bytes, base + k);
            out[(t - t0) * d + c] = value(base + k);
          }
        }
      }
    }
  }
  // Residual rows.
  for (int64_t t = std::max(t0, v.quantized); t < t1; ++t) {
    const int64_t r = t - v.quantized;
    for (int c = 0; c < d; ++c) {
      out[(t - t0) * d + c] = internal::LoadElement(v.dtype, v.residual_data,
                                                    s * v.slab_stride + r * v.token_stride + c);
    }
  }
}

std::vector<float> DecodeAll(const EncodedView& v, KernelLevel level) {
  std::vector<float> out(static_cast<size_t>(v.slabs * v.tokens * v.head_dim));
  for (int64_t s = 0; s < v.slabs; ++s) {
    DecodeRows(v, s, 0, v.tokens, out.data() + s * v.tokens * v.head_dim, level);
  }
  return out;
}

}  // namespace kvtier
