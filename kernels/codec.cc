#include "kernels/codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "kernels/codec_internal.h"
#include "kernels/crc32c.h"
#include "kernels/encoded_tensor.h"
#include "kernels/half.h"

namespace kvtier {

using internal::QuantShape;

namespace internal {

bool IsGear(v1::Codec c) { return c == v1::CODEC_GEAR || c == v1::CODEC_GEAR_L; }
bool IsQuantized(v1::Codec c) { return c != v1::CODEC_RAW; }

bool UseSimd(KernelLevel level) {
  return level != KernelLevel::kReference && internal::SimdAvailable();
}

const char* DTypeName(v1::DType d) {
  switch (d) {
    case v1::DTYPE_FP32:
      return "fp32";
    case v1::DTYPE_BF16:
      return "bf16";
    default:
      return "fp16";
  }
}

absl::StatusOr<Layout> MakeLayout(v1::Codec codec, v1::Codec backbone, v1::TensorRole role,
                                  v1::DType dtype, int bits, int group, int64_t residual, int rank,
                                  float outlier_fraction, absl::Span<const int64_t> shape) {
  Layout l;
  l.codec = codec;
  l.backbone = IsGear(codec) ? backbone : codec;
  l.key = role != v1::TENSOR_ROLE_VALUE;
  l.dsize = DTypeSize(dtype);
  if (l.dsize == 0) return absl::InvalidArgumentError("dtype is unspecified or unknown");
  if (shape.size() < 2 || shape.size() > 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shape must be [..., tokens, head_dim] with 2 to 8 dimensions, got ", shape.size()));
  }
  l.slabs = 1;
  for (size_t i = 0; i + 2 < shape.size(); ++i) {
    if (shape[i] < 1 || shape[i] >= (int64_t{1} << 31)) {
      return absl::InvalidArgumentError(absl::StrCat("dimension ", shape[i], " out of range"));
    }
    l.slabs *= shape[i];
  }
  l.tokens = shape[shape.size() - 2];
  const int64_t d = shape[shape.size() - 1];
  if (l.tokens < 1 || l.tokens >= (int64_t{1} << 31) || d < 1 || d > 65536) {
    return absl::InvalidArgumentError(absl::StrCat("tokens (", l.tokens, ") and head_dim (", d,
                                                   ") must be >= 1, head_dim <= 65536"));
  }
  if (static_cast<double>(l.slabs) * l.tokens * d >= static_cast<double>(int64_t{1} << 40)) {
    return absl::InvalidArgumentError("tensor has too many elements");
  }
  l.d = static_cast<int>(d);
  if (!IsQuantized(codec)) {
    l.res = l.tokens;
    return l;
  }
  if (residual < 0) return absl::InvalidArgumentError("residual_tokens must be >= 0");
  l.res = std::min<int64_t>(residual, l.tokens);
  l.tq = l.tokens - l.res;
  l.q.key = l.key;
  l.q.bits = bits;
  l.q.tq = l.tq;
  l.q.d = l.d;
  if (l.backbone == v1::CODEC_KCVT) {
    l.q.group = l.key ? static_cast<int>(std::max<int64_t>(l.tq, 1)) : l.d;
  } else {
    if (group < 1) return absl::InvalidArgumentError("group_size must be >= 1");
    l.q.group = l.key ? group : std::min(group, l.d);
  }
  if (IsGear(codec)) {
    if (rank < 0 || rank > l.d) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank must be in [0, head_dim=", l.d, "], got ", rank));
    }
    l.rank = rank;
    if (codec == v1::CODEC_GEAR) {
      l.sparse_rows = l.key ? l.d : l.tq;
      l.sparse_row_len = l.key ? l.tq : l.d;
      int64_t m = std::llround(static_cast<double>(outlier_fraction) * l.sparse_row_len / 2.0);
      m = std::min<int64_t>(m, l.sparse_row_len / 2);
      l.outliers_per_row = static_cast<int>(2 * m);
      l.index_bytes = l.sparse_row_len <= 65536 ? 2 : 4;
    }
  }
  return l;
}

void Dequant(const QuantShape& q, const uint8_t* codes, const uint16_t* scales,
             const uint16_t* zeros, int64_t t0, int64_t t1, float* out, KernelLevel level) {
  if (UseSimd(level) && internal::DequantRowsSimd(q, codes, scales, zeros, t0, t1, out)) return;
  internal::DequantRowsRef(q, codes, scales, zeros, t0, t1, out);
}

}  // namespace internal

namespace {

using internal::Dequant;
using internal::DTypeName;
using internal::IsGear;
using internal::IsQuantized;
using internal::Layout;
using internal::MakeLayout;
using internal::UseSimd;

absl::StatusOr<Layout> LayoutFor(const CodecConfig& c, v1::TensorRole role,
                                 absl::Span<const int64_t> shape) {
  return MakeLayout(c.codec, c.backbone, role, c.dtype, c.bits, c.group_size, c.residual_tokens,
                    c.rank, c.outlier_fraction, shape);
}

void StoreElement(v1::DType dtype, float x, uint8_t* out, int64_t index) {
  switch (dtype) {
    case v1::DTYPE_FP16: {
      const uint16_t h = FloatToHalf(x);
      std::memcpy(out + index * 2, &h, 2);
      break;
    }
    case v1::DTYPE_BF16: {
      const uint16_t h = FloatToBf16(x);
      std::memcpy(out + index * 2, &h, 2);
      break;
    }
    default:
      std::memcpy(out + index * 4, &x, 4);
  }
}

uint8_t* AddBuffer(v1::EncodedTensor* t, v1::BufferKind kind, int64_t bytes) {
  v1::Buffer* b = t->add_buffers();
  b->set_kind(kind);
  b->mutable_data()->assign(static_cast<size_t>(bytes), '\0');
  return reinterpret_cast<uint8_t*>(b->mutable_data()->data());
}

// SplitMix64: the deterministic source of the power iteration's start.
uint64_t SplitMix(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// One element of a GEAR outlier row: its value and position in the row.
struct RowValue {
  float value;
  int64_t pos;
};

// Ascending by value, ties by position.
struct ValueLess {
  bool operator()(const RowValue& a, const RowValue& b) const {
    return a.value < b.value || (a.value == b.value && a.pos < b.pos);
  }
};
struct ValueGreater {
  bool operator()(const RowValue& a, const RowValue& b) const { return ValueLess()(b, a); }
};

// The m smallest and the m largest of a row's elements under ValueLess,
// offered in position order, in two heaps of at most m. Since positions
// ascend, a later element that ties a kept one counts as larger: it can
// join the largest on a tie, never the smallest. So once the heaps are full,
// an element strictly between the two tops' values joins neither, and
// Wants() (two float comparisons) turns it away.
class Extremes {
 public:
  explicit Extremes(int m) : m_(m) {}
  void Clear() {
    low_.clear();
    high_.clear();
    below_ = std::numeric_limits<float>::infinity();
    from_ = -std::numeric_limits<float>::infinity();
  }
  // NaN is offered too, so that the heaps fill whatever the row holds (the
  // input check refuses the tensor afterwards).
  bool Wants(float value) const { return !(value >= below_ && value < from_); }
  void Add(float value, int64_t pos) {
    const RowValue e{value, pos};
    // Max-heap: its top is the largest of the smallest.
    if (Offer(low_, e, ValueLess()) && static_cast<int>(low_.size()) == m_) {
      below_ = low_.front().value;
    }
    // Min-heap: its top is the smallest of the largest.
    if (Offer(high_, e, ValueGreater()) && static_cast<int>(high_.size()) == m_) {
      from_ = high_.front().value;
    }
  }
  // The positions of both sets, ascending. The sets are disjoint when the
  // row holds at least 2m elements.
  void Picked(std::vector<int64_t>* out) const {
    out->clear();
    for (const RowValue& e : low_) out->push_back(e.pos);
    for (const RowValue& e : high_) out->push_back(e.pos);
    std::sort(out->begin(), out->end());
  }

 private:
  // True when e joined the heap.
  template <typename Cmp>
  bool Offer(std::vector<RowValue>& heap, const RowValue& e, Cmp cmp) {
    if (static_cast<int>(heap.size()) < m_) {
      heap.push_back(e);
      std::push_heap(heap.begin(), heap.end(), cmp);
      return true;
    }
    if (m_ == 0 || !cmp(e, heap.front())) return false;
    std::pop_heap(heap.begin(), heap.end(), cmp);
    heap.back() = e;
    std::push_heap(heap.begin(), heap.end(), cmp);
    return true;
  }

  int m_;
  std::vector<RowValue> low_, high_;
  float below_ = std::numeric_limits<float>::infinity();  // Smaller values join low_.
  float from_ = -std::numeric_limits<float>::infinity();  // Values from here on may join high_.
};

// Rank-r approximation R ~ A * B of an [n, d] matrix by power (subspace)
// iteration (ALGORITHMS.md §3): P (d x r) random, then three times
// Y = R P, P = R^T Y, orthonormalized; finally A = R P, B = P^T. P is held
// as r columns of d, so that both products run along R's rows: Y's
// elements as dot products, P's columns as scaled sums of rows (AVX2 when
// Acc is float and the CPU has it; every sum in row order otherwise).
template <typename Acc>
void LowRank(const float* r_mat, int64_t n, int d, int rank, uint64_t seed, std::vector<float>* a,
             std::vector<float>* b) {
  std::vector<Acc> p(static_cast<size_t>(d) * rank), y(static_cast<size_t>(n) * rank);
  uint64_t st = seed;
  // The start draws P row by row (k, then j), as it always has.
  for (int k = 0; k < d; ++k) {
    for (int j = 0; j < rank; ++j) {
      p[j * d + k] = static_cast<Acc>((SplitMix(&st) >> 11) * 0x1.0p-53 * 2.0 - 1.0);
    }
  }
  constexpr bool kFloat = std::is_same_v<Acc, float>;
  const bool simd = kFloat && internal::SimdAvailable();
  auto orthonormalize = [&] {
    for (int j = 0; j < rank; ++j) {
      Acc* pj = p.data() + j * d;
      for (int i = 0; i < j; ++i) {
        const Acc* pi = p.data() + i * d;
        Acc dot = 0;
        for (int k = 0; k < d; ++k) dot += pi[k] * pj[k];
        for (int k = 0; k < d; ++k) pj[k] -= dot * pi[k];
      }
      Acc norm = 0;
      for (int k = 0; k < d; ++k) norm += pj[k] * pj[k];
      norm = std::sqrt(norm);
      const Acc inv = norm > Acc(1e-20) ? Acc(1) / norm : Acc(0);
      for (int k = 0; k < d; ++k) pj[k] *= inv;
    }
  };
  auto times_p = [&] {  // y = R p
    for (int64_t t = 0; t < n; ++t) {
      const float* row = r_mat + t * d;
      for (int j = 0; j < rank; ++j) {
        const Acc* pj = p.data() + j * d;
        Acc acc = 0;
        if constexpr (kFloat) {
          if (simd && internal::DotSimd(row, pj, d, &acc)) {
            y[t * rank + j] = acc;
            continue;
          }
        }
        for (int k = 0; k < d; ++k) acc += static_cast<Acc>(row[k]) * pj[k];
        y[t * rank + j] = acc;
      }
    }
  };
  orthonormalize();
  for (int it = 0; it < 3; ++it) {
    times_p();
    std::fill(p.begin(), p.end(), Acc(0));  // p = R^T y
    for (int64_t t = 0; t < n; ++t) {
      const float* row = r_mat + t * d;
      for (int j = 0; j < rank; ++j) {
        Acc* pj = p.data() + j * d;
        const Acc w = y[t * rank + j];
        if constexpr (kFloat) {
          if (simd && internal::AxpySimd(w, row, d, pj)) continue;
        }
        for (int k = 0; k < d; ++k) pj[k] += static_cast<Acc>(row[k]) * w;
      }
    }
    orthonormalize();
  }
  times_p();
  a->resize(static_cast<size_t>(n) * rank);
  b->resize(static_cast<size_t>(rank) * d);
  for (size_t i = 0; i < a->size(); ++i) (*a)[i] = static_cast<float>(y[i]);
  for (size_t i = 0; i < b->size(); ++i) (*b)[i] = static_cast<float>(p[i]);
}

// The vectorized kernels write every code; this zeroes the last word's
// padding.
void ZeroCodePadding(const QuantShape& q, uint8_t* codes) {
  const int64_t bytes = internal::CodeWords(q) * 4, used = (q.tq * q.d * q.bits + 7) / 8;
  std::memset(codes + used, 0, static_cast<size_t>(bytes - used));
}

// True when a kernel's largest |x| (float bits, as QuantizeSlabSimd reports
// it) is finite and within fp16 range: the input check, passed.
bool WithinHalfRange(uint32_t max_abs_bits) {
  uint32_t limit_bits;
  std::memcpy(&limit_bits, &kHalfMax, 4);
  return max_abs_bits <= limit_bits;
}

// Quantizes one slab into `codes` (every byte written, whatever it held).
// Returns true when the vectorized kernel ran, which then raised
// *max_abs_bits (when not null) to the largest |x| it read.
bool Quantize(const QuantShape& q, const float* x, uint8_t* codes, uint16_t* scales,
              uint16_t* zeros, KernelLevel level, uint32_t* max_abs_bits = nullptr) {
  if (UseSimd(level) && internal::QuantizeSlabSimd(q, x, codes, scales, zeros, max_abs_bits)) {
    ZeroCodePadding(q, codes);
    return true;
  }
  // The reference ORs codes into their words.
  std::memset(codes, 0, static_cast<size_t>(internal::CodeWords(q) * 4));
  internal::QuantizeSlabRef(q, x, codes, scales, zeros);
  return false;
}

}  // namespace

namespace {

// Where each of a tensor's buffers is written (null: the codec has none).
struct BufferPtrs {
  uint8_t* raw = nullptr;
  uint8_t* codes = nullptr;
  uint16_t* scales = nullptr;
  uint16_t* zeros = nullptr;
  uint8_t* residual = nullptr;
  uint16_t* a = nullptr;
  uint16_t* b = nullptr;
  uint8_t* sparse_index = nullptr;
  uint8_t* sparse_value = nullptr;
};

// The buffers a tensor of this layout has, in the format's order, with their
// sizes in bytes.
std::vector<std::pair<v1::BufferKind, int64_t>> BufferList(const CodecConfig& c, const Layout& l) {
  std::vector<std::pair<v1::BufferKind, int64_t>> out;
  if (c.codec == v1::CODEC_RAW) {
    out.emplace_back(v1::BUFFER_RAW, l.slabs * l.tokens * l.d * l.dsize);
    return out;
  }
  out.emplace_back(v1::BUFFER_CODES, l.code_bytes());
  out.emplace_back(v1::BUFFER_SCALES, l.scale_bytes());
  out.emplace_back(v1::BUFFER_ZEROS, l.scale_bytes());
  if (l.res > 0) out.emplace_back(v1::BUFFER_RESIDUAL, l.residual_bytes());
  if (IsGear(c.codec) && l.rank > 0) {
    out.emplace_back(v1::BUFFER_LOWRANK_A, l.a_bytes());
    out.emplace_back(v1::BUFFER_LOWRANK_B, l.b_bytes());
  }
  if (c.codec == v1::CODEC_GEAR) {
    out.emplace_back(v1::BUFFER_SPARSE_INDEX, l.sparse_count() * l.index_bytes);
    out.emplace_back(v1::BUFFER_SPARSE_VALUE, l.sparse_count() * l.dsize);
  }
  return out;
}

// Points `out`'s member for `kind` at p.
void SetBuffer(v1::BufferKind kind, uint8_t* p, BufferPtrs* out) {
  switch (kind) {
    case v1::BUFFER_RAW:
      out->raw = p;
      break;
    case v1::BUFFER_CODES:
      out->codes = p;
      break;
    case v1::BUFFER_SCALES:
      out->scales = reinterpret_cast<uint16_t*>(p);
      break;
    case v1::BUFFER_ZEROS:
      out->zeros = reinterpret_cast<uint16_t*>(p);
      break;
    case v1::BUFFER_RESIDUAL:
      out->residual = p;
      break;
    case v1::BUFFER_LOWRANK_A:
      out->a = reinterpret_cast<uint16_t*>(p);
      break;
    case v1::BUFFER_LOWRANK_B:
      out->b = reinterpret_cast<uint16_t*>(p);
      break;
    case v1::BUFFER_SPARSE_INDEX:
      out->sparse_index = p;
      break;
    case v1::BUFFER_SPARSE_VALUE:
      out->sparse_value = p;
      break;
    default:
      break;
  }
}

// The layout of a tensor Encode accepts: a valid config, a role for a
// quantized tensor, a valid shape.
absl::StatusOr<Layout> EncodableLayout(const CodecConfig& c, v1::TensorRole role,
                                       absl::Span<const int64_t> shape) {
  KVT_RETURN_IF_ERROR(ValidateCodecConfig(c));
  if (IsQuantized(c.codec) && role != v1::TENSOR_ROLE_KEY && role != v1::TENSOR_ROLE_VALUE) {
    return absl::InvalidArgumentError("a quantized tensor must be a KEY or a VALUE");
  }
  return LayoutFor(c, role, shape);
}

// INVALID_ARGUMENT unless every input element can be stored.
absl::Status CheckInput(const CodecConfig& c, const Layout& l, const float* data) {
  const int64_t n = l.slabs * l.tokens * l.d;
  const float limit = (IsQuantized(c.codec) || c.dtype == v1::DTYPE_FP16)
                          ? kHalfMax
                          : std::numeric_limits<float>::max();
  int64_t bad = -1;
  if (!internal::FirstOutOfRangeSimd(data, n, limit, &bad)) {
    for (int64_t i = 0; i < n && bad < 0; ++i) {
      if (!(std::fabs(data[i]) <= limit)) bad = i;
    }
  }
  if (bad >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("element ", bad, " is ", data[bad], ": inputs must be finite",
                     limit == kHalfMax ? " and within fp16 range" : ""));
  }
  return absl::OkStatus();
}

// Every field of the tensor but its buffers and checksum.
v1::EncodedTensor TensorMeta(const CodecConfig& c, const Layout& l, v1::TensorRole role,
                             absl::Span<const int64_t> shape) {
  v1::EncodedTensor t;
  t.set_format_version(kEncodedTensorFormatVersion);
  t.set_codec(c.codec);
  CodecConfig eff = c;
  eff.residual_tokens = static_cast<int>(l.res);
  *t.mutable_params() = ToParams(eff);
  t.set_role(role);
  t.set_dtype(c.dtype);
  for (int64_t s : shape) t.add_shape(s);
  return t;
}

// Encodes `data` into the buffers at `out`, which hold whatever was there
// before (every byte is written). `data` is checked (CheckInput) unless
// `fused` is not null: then data may be anything, and *fused says whether
// the check ran inside the encoding (KIVI/KCVT without a residual, every
// slab through the vectorized kernel) and found every element in range.
// When it says false the caller checks `data` itself.
void EncodeBuffers(const CodecConfig& c, const Layout& l, const float* data, const BufferPtrs& out,
                   KernelLevel level, bool* fused = nullptr) {
  if (fused != nullptr) *fused = false;
  const int64_t n = l.slabs * l.tokens * l.d;
  if (c.codec == v1::CODEC_RAW) {
    for (int64_t i = 0; i < n; ++i) StoreElement(c.dtype, data[i], out.raw, i);
    return;
  }
  const int64_t slab_elems = l.tokens * l.d;
  const int64_t words = internal::CodeWords(l.q);
  const int64_t scount = internal::ScaleCount(l.q);
  const bool fusing = fused != nullptr && !IsGear(c.codec) && l.res == 0;
  if (fused != nullptr) *fused = fusing;
  uint32_t max_abs_bits = 0;
  if (l.res > 0) {
    for (int64_t s = 0; s < l.slabs; ++s) {
      const float* src = data + s * slab_elems + l.tq * l.d;
      for (int64_t i = 0; i < l.res * l.d; ++i)
        StoreElement(c.dtype, src[i], out.residual, s * l.res * l.d + i);
    }
  }
  uint16_t* a16 = out.a;
  uint16_t* b16 = out.b;
  uint8_t* sidx = out.sparse_index;
  uint8_t* sval = out.sparse_value;
  std::vector<float> work, deq, a, b;
  std::vector<Extremes> extremes;
  std::vector<double> sums;
  std::vector<int64_t> picked;
  std::vector<uint8_t> is_outlier;
  for (int64_t s = 0; s < l.slabs; ++s) {
    const float* x = data + s * slab_elems;
    uint8_t* sc = out.codes + s * words * 4;
    uint16_t* ss = out.scales + s * scount;
    uint16_t* sz = out.zeros + s * scount;
    if (!IsGear(c.codec)) {
      if (!Quantize(l.q, x, sc, ss, sz, level, fusing ? &max_abs_bits : nullptr) && fusing) {
        *fused = false;
      }
      continue;
    }
    // GEAR: S (outliers), then Q of the remainder, then L of what Q missed.
    const int64_t qn = l.tq * l.d;
    work.assign(x, x + qn);
    is_outlier.assign(static_cast<size_t>(qn), 0);
    if (l.outliers_per_row > 0) {
      const int m = l.outliers_per_row / 2;
      const int64_t row_len = l.sparse_row_len;
      auto elem = [&](int64_t row, int64_t j) { return l.key ? j * l.d + row : row * l.d + j; };
      // Each row's m smallest and m largest values, ascending by value and
      // ties by position so that the choice is deterministic, and its sum in
      // position order. x is read once, in order: a K row is a channel, so
      // every channel's selection runs at once, token by token.
      extremes.assign(static_cast<size_t>(l.key ? l.sparse_rows : 1), Extremes(m));
      sums.assign(extremes.size(), 0.0);
      if (l.key) {
        for (int64_t t = 0; t < l.tq; ++t) {
          const float* xt = x + t * l.d;
          for (int ch = 0; ch < l.d; ++ch) {
            if (extremes[ch].Wants(xt[ch])) extremes[ch].Add(xt[ch], t);
            sums[ch] += xt[ch];
          }
        }
      }
      for (int64_t row = 0; row < l.sparse_rows; ++row) {
        Extremes* ex = &extremes[l.key ? row : 0];
        double sum = 0;
        if (l.key) {
          sum = sums[row];
        } else {
          ex->Clear();
          const float* xr = x + row * l.d;
          for (int ch = 0; ch < l.d; ++ch) {
            if (ex->Wants(xr[ch])) ex->Add(xr[ch], ch);
            sum += xr[ch];
          }
        }
        ex->Picked(&picked);
        for (int64_t j : picked) sum -= x[elem(row, j)];
        const float mean = static_cast<float>(sum / static_cast<double>(row_len - 2 * m));
        const int64_t base = (s * l.sparse_rows + row) * l.outliers_per_row;
        for (int k = 0; k < 2 * m; ++k) {
          const int64_t e = elem(row, picked[k]);
          if (l.index_bytes == 2) {
            const uint16_t v = static_cast<uint16_t>(picked[k]);
            std::memcpy(sidx + (base + k) * 2, &v, 2);
          } else {
            const uint32_t v = static_cast<uint32_t>(picked[k]);
            std::memcpy(sidx + (base + k) * 4, &v, 4);
          }
          StoreElement(c.dtype, x[e], sval, base + k);
          work[e] = mean;
          is_outlier[e] = 1;
        }
      }
    }
    Quantize(l.q, work.data(), sc, ss, sz, level);
    if (l.rank > 0 && l.tq > 0) {
      deq.resize(static_cast<size_t>(qn));
      Dequant(l.q, sc, ss, sz, 0, l.tq, deq.data(), level);
      for (int64_t i = 0; i < qn; ++i) work[i] = is_outlier[i] ? 0.0f : x[i] - deq[i];
      const uint64_t seed = 0x6765617200000000ull ^ static_cast<uint64_t>(s);
      if (level == KernelLevel::kReference) {
        LowRank<double>(work.data(), l.tq, l.d, l.rank, seed, &a, &b);
      } else {
        LowRank<float>(work.data(), l.tq, l.d, l.rank, seed, &a, &b);
      }
      for (size_t i = 0; i < a.size(); ++i) {
        internal::StoreU16(a16, s * l.tq * l.rank + static_cast<int64_t>(i), FloatToHalf(a[i]));
      }
      for (size_t i = 0; i < b.size(); ++i) {
        internal::StoreU16(b16, s * l.rank * l.d + static_cast<int64_t>(i), FloatToHalf(b[i]));
      }
    }
  }
  if (fusing && *fused) *fused = WithinHalfRange(max_abs_bits);
}

}  // namespace

absl::StatusOr<int64_t> EncodedBufferBytes(const CodecConfig& c, v1::TensorRole role,
                                           absl::Span<const int64_t> shape) {
  KVT_RETURN_IF_ERROR(ValidateCodecConfig(c));
  KVT_ASSIGN_OR_RETURN(Layout l, LayoutFor(c, role, shape));
  int64_t total = 0;
  for (const auto& [kind, bytes] : BufferList(c, l)) total += bytes;
  return total;
}

absl::StatusOr<v1::EncodedTensor> Encode(const CodecConfig& c, v1::TensorRole role,
                                         absl::Span<const int64_t> shape, const float* data,
                                         KernelLevel level) {
  KVT_ASSIGN_OR_RETURN(Layout l, EncodableLayout(c, role, shape));
  v1::EncodedTensor t = TensorMeta(c, l, role, shape);
  BufferPtrs out;
  for (const auto& [kind, bytes] : BufferList(c, l))
    SetBuffer(kind, AddBuffer(&t, kind, bytes), &out);
  // The input check rides along with the quantizer's pass where it can; a
  // check it could not do, or one that failed, runs in full (and names the
  // element).
  bool fused = false;
  EncodeBuffers(c, l, data, out, level, &fused);
  if (!fused) KVT_RETURN_IF_ERROR(CheckInput(c, l, data));
  SealTensor(&t);
  return t;
}

namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedOutputStream;

constexpr uint32_t kBuffersTag = (8 << 3) | 2;  // EncodedTensor.buffers
constexpr uint32_t kKindTag = (1 << 3) | 0;     // Buffer.kind
constexpr uint32_t kDataTag = (2 << 3) | 2;     // Buffer.data
constexpr uint32_t kCrcTag = (9 << 3) | 5;      // EncodedTensor.crc32c

// Serialized size of a Buffer message holding `bytes` bytes of `kind`.
size_t BufferMessageSize(v1::BufferKind kind, int64_t bytes) {
  size_t n = 1 + CodedOutputStream::VarintSize32SignExtended(kind);
  if (bytes > 0) n += 1 + CodedOutputStream::VarintSize64(bytes) + static_cast<size_t>(bytes);
  return n;
}

}  // namespace

absl::StatusOr<TensorEncoder> TensorEncoder::Make(const CodecConfig& c, v1::TensorRole role,
                                                  absl::Span<const int64_t> shape,
                                                  uint32_t layer_begin) {
  KVT_ASSIGN_OR_RETURN(Layout l, EncodableLayout(c, role, shape));
  TensorEncoder e;
  e.config_ = c;
  e.role_ = role;
  e.shape_.assign(shape.begin(), shape.end());
  v1::EncodedTensor meta = TensorMeta(c, l, role, shape);
  meta.set_layer_begin(layer_begin);
  e.meta_ = meta.SerializeAsString();
  e.size_ = e.meta_.size();
  for (const auto& [kind, bytes] : BufferList(c, l)) {
    const size_t m = BufferMessageSize(kind, bytes);
    e.size_ += 1 + CodedOutputStream::VarintSize64(m) + m;
  }
  e.size_ += 1 + 4;  // The checksum, always written.
  return e;
}

namespace {

using Regions = std::vector<std::pair<const uint8_t*, size_t>>;

// Writes a tensor's serialized fields up to its checksum at `out`: `meta`,
// then each buffer's framing with room for its bytes (recorded in `bufs`
// and `regions`). Returns where the checksum goes.
uint8_t* LayOut(const std::string& meta,
                const std::vector<std::pair<v1::BufferKind, int64_t>>& list, uint8_t* out,
                BufferPtrs* bufs, Regions* regions) {
  uint8_t* p = std::copy(meta.begin(), meta.end(), out);
  for (const auto& [kind, bytes] : list) {
    p = CodedOutputStream::WriteVarint32ToArray(kBuffersTag, p);
    p = CodedOutputStream::WriteVarint64ToArray(BufferMessageSize(kind, bytes), p);
    p = CodedOutputStream::WriteVarint32ToArray(kKindTag, p);
    p = CodedOutputStream::WriteVarint32SignExtendedToArray(kind, p);
    if (bytes > 0) {
      p = CodedOutputStream::WriteVarint32ToArray(kDataTag, p);
      p = CodedOutputStream::WriteVarint64ToArray(static_cast<uint64_t>(bytes), p);
    }
    SetBuffer(kind, p, bufs);
    regions->emplace_back(p, static_cast<size_t>(bytes));
    p += bytes;
  }
  return p;
}

// Writes the checksum of the filled `regions` at p; returns the tensor's end.
uint8_t* Seal(const Regions& regions, uint8_t* p) {
  uint32_t crc = 0;
  for (const auto& [at, n] : regions) crc = Crc32cExtend(crc, at, n);
  p = CodedOutputStream::WriteVarint32ToArray(kCrcTag, p);
  return WireFormatLite::WriteFixed32NoTagToArray(crc, p);
}

}  // namespace

absl::StatusOr<uint8_t*> TensorEncoder::EncodeTo(const float* data, uint8_t* out,
                                                 KernelLevel level) const {
  KVT_ASSIGN_OR_RETURN(Layout l, LayoutFor(config_, role_, shape_));
  BufferPtrs bufs;
  Regions regions;
  uint8_t* p = LayOut(meta_, BufferList(config_, l), out, &bufs, &regions);
  // As in Encode: the check fused into the quantizer's pass where it can be.
  bool fused = false;
  EncodeBuffers(config_, l, data, bufs, level, &fused);
  if (!fused) KVT_RETURN_IF_ERROR(CheckInput(config_, l, data));
  return Seal(regions, p);
}

absl::StatusOr<uint8_t*> TensorEncoder::EncodeTo(const void* data, v1::DType dtype, uint8_t* out,
                                                 std::vector<float>* scratch,
                                                 KernelLevel level) const {
  if (dtype == v1::DTYPE_FP32) return EncodeTo(static_cast<const float*>(data), out, level);
  if (dtype != v1::DTYPE_FP16 && dtype != v1::DTYPE_BF16) {
    return absl::InvalidArgumentError("input dtype must be fp16, bf16 or fp32");
  }
  KVT_ASSIGN_OR_RETURN(Layout l, LayoutFor(config_, role_, shape_));
  const int64_t n = l.slabs * l.tokens * l.d;
  if (config_.codec == v1::CODEC_RAW && config_.dtype == dtype) {
    // Stored as it is held. fp16 input holds no value beyond fp16 range;
    // non-finite elements are refused as Encode refuses them.
    const auto* x = static_cast<const uint16_t*>(data);
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t exp_all = dtype == v1::DTYPE_FP16 ? 0x7c00 : 0x7f80;
      if ((x[i] & exp_all) == exp_all) {
        return absl::InvalidArgumentError(
            absl::StrCat("element ", i, " is not finite: inputs must be finite"));
      }
    }
    BufferPtrs bufs;
    Regions regions;
    uint8_t* p = LayOut(meta_, BufferList(config_, l), out, &bufs, &regions);
    std::memcpy(bufs.raw, data, static_cast<size_t>(n) * 2);
    return Seal(regions, p);
  }
  if ((config_.codec == v1::CODEC_KIVI || config_.codec == v1::CODEC_KCVT) && l.res == 0 &&
      UseSimd(level)) {
    // Quantized straight from the 16-bit input, with the input check in the
    // same pass; anything it cannot do (or input it refuses) goes the widened
    // way below, which re-encodes and names the bad element.
    BufferPtrs bufs;
    Regions regions;
    uint8_t* p = LayOut(meta_, BufferList(config_, l), out, &bufs, &regions);
    const int64_t slab_elems = l.tokens * l.d, words = internal::CodeWords(l.q),
                  scount = internal::ScaleCount(l.q);
    uint32_t max_abs_bits = 0;
    bool done = true;
    for (int64_t s = 0; s < l.slabs && done; ++s) {
      uint8_t* codes = bufs.codes + s * words * 4;
      done = internal::QuantizeSlab16Simd(l.q, static_cast<const uint16_t*>(data) + s * slab_elems,
                                          dtype == v1::DTYPE_BF16, codes, bufs.scales + s * scount,
                                          bufs.zeros + s * scount, &max_abs_bits);
      if (done) ZeroCodePadding(l.q, codes);
    }
    if (done && WithinHalfRange(max_abs_bits)) return Seal(regions, p);
  }
  scratch->resize(static_cast<size_t>(n));
  const auto* x = static_cast<const uint16_t*>(data);
  if (UseSimd(level) && internal::WidenSimd(x, dtype == v1::DTYPE_BF16, n, scratch->data())) {
    // Widened.
  } else if (dtype == v1::DTYPE_FP16) {
    for (int64_t i = 0; i < n; ++i) (*scratch)[i] = HalfToFloat(x[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) (*scratch)[i] = Bf16ToFloat(x[i]);
  }
  return EncodeTo(scratch->data(), out, level);
}

EncodedView EncodedView::Raw(v1::DType dtype, const void* data, int64_t slabs, int64_t tokens,
                             int head_dim, int64_t slab_stride, int64_t token_stride) {
  EncodedView v;
  v.codec = v1::CODEC_RAW;
  v.dtype = dtype;
  v.slabs = slabs;
  v.tokens = tokens;
  v.head_dim = head_dim;
  v.residual = tokens;
  v.raw = data;
  v.slab_stride = slab_stride;
  v.token_stride = token_stride;
  return v;
}

}  // namespace kvtier
