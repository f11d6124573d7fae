#include "kernels/codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/codec_internal.h"
#include "kernels/half.h"

namespace kvtier {

using internal::QuantShape;

namespace internal {

bool IsGear(Codec c) { return c == Codec::kGear || c == Codec::kGearL; }
bool IsQuantized(Codec c) { return c != Codec::kRaw; }

bool UseSimd(KernelLevel level) {
  return level != KernelLevel::kReference && internal::SimdAvailable();
}

absl::StatusOr<Layout> MakeLayout(Codec codec, Codec backbone, TensorRole role, DType dtype,
                                  int bits, int group, int64_t residual, int rank,
                                  float outlier_fraction, absl::Span<const int64_t> shape) {
  Layout l;
  l.codec = codec;
  l.backbone = IsGear(codec) ? backbone : codec;
  l.key = role != TensorRole::kValue;
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
  if (l.backbone == Codec::kKcvt) {
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
    if (codec == Codec::kGear) {
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

std::vector<BufferSize> BufferList(const Layout& l) {
  std::vector<BufferSize> out;
  if (l.codec == Codec::kRaw) {
    out.push_back({BufferKind::kRaw, l.slabs * l.tokens * l.d * l.dsize});
    return out;
  }
  out.push_back({BufferKind::kCodes, l.code_bytes()});
  out.push_back({BufferKind::kScales, l.scale_bytes()});
  out.push_back({BufferKind::kZeros, l.scale_bytes()});
  if (l.res > 0) out.push_back({BufferKind::kResidual, l.residual_bytes()});
  if (IsGear(l.codec) && l.rank > 0) {
    out.push_back({BufferKind::kLowrankA, l.a_bytes()});
    out.push_back({BufferKind::kLowrankB, l.b_bytes()});
  }
  if (l.codec == Codec::kGear) {
    out.push_back({BufferKind::kSparseIndex, l.sparse_count() * l.index_bytes});
    out.push_back({BufferKind::kSparseValue, l.sparse_count() * l.dsize});
  }
  return out;
}

}  // namespace internal

namespace {

using internal::BufferList;
using internal::Dequant;
using internal::IsGear;
using internal::IsQuantized;
using internal::Layout;
using internal::MakeLayout;
using internal::UseSimd;

absl::StatusOr<Layout> LayoutFor(const CodecConfig& c, TensorRole role,
                                 absl::Span<const int64_t> shape) {
  return MakeLayout(c.codec, c.backbone, role, c.dtype, c.bits, c.group_size, c.residual_tokens,
                    c.rank, c.outlier_fraction, shape);
}

void StoreElement(DType dtype, float x, uint8_t* out, int64_t index) {
  switch (dtype) {
    case DType::kFp16: {
      const uint16_t h = FloatToHalf(x);
      std::memcpy(out + index * 2, &h, 2);
      break;
    }
    case DType::kBf16: {
      const uint16_t h = FloatToBf16(x);
      std::memcpy(out + index * 2, &h, 2);
      break;
    }
    default:
      std::memcpy(out + index * 4, &x, 4);
  }
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

// Points `out`'s member for `kind` at p.
void SetBuffer(BufferKind kind, uint8_t* p, BufferPtrs* out) {
  switch (kind) {
    case BufferKind::kRaw:
      out->raw = p;
      break;
    case BufferKind::kCodes:
      out->codes = p;
      break;
    case BufferKind::kScales:
      out->scales = reinterpret_cast<uint16_t*>(p);
      break;
    case BufferKind::kZeros:
      out->zeros = reinterpret_cast<uint16_t*>(p);
      break;
    case BufferKind::kResidual:
      out->residual = p;
      break;
    case BufferKind::kLowrankA:
      out->a = reinterpret_cast<uint16_t*>(p);
      break;
    case BufferKind::kLowrankB:
      out->b = reinterpret_cast<uint16_t*>(p);
      break;
    case BufferKind::kSparseIndex:
      out->sparse_index = p;
      break;
    case BufferKind::kSparseValue:
      out->sparse_value = p;
      break;
    default:
      break;
  }
}

// The layout of a tensor Encode accepts: a valid config, a role for a
// quantized tensor, a valid shape.
absl::StatusOr<Layout> EncodableLayout(const CodecConfig& c, TensorRole role,
                                       absl::Span<const int64_t> shape) {
  KVT_RETURN_IF_ERROR(ValidateCodecConfig(c));
  if (IsQuantized(c.codec) && role != TensorRole::kKey && role != TensorRole::kValue) {
    return absl::InvalidArgumentError("a quantized tensor must be a KEY or a VALUE");
  }
  return LayoutFor(c, role, shape);
}

// INVALID_ARGUMENT unless every input element can be stored.
absl::Status CheckInput(const CodecConfig& c, const Layout& l, const float* data) {
  const int64_t n = l.slabs * l.tokens * l.d;
  const float limit = (IsQuantized(c.codec) || c.dtype == DType::kFp16)
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

// The header a tensor of this config and layout carries.
TensorHeader HeaderFor(const CodecConfig& c, const Layout& l, TensorRole role,
                       absl::Span<const int64_t> shape) {
  TensorHeader h = ParamsHeader(c);
  h.role = role;
  h.dtype = c.dtype;
  h.shape.assign(shape.begin(), shape.end());
  if (c.codec != Codec::kRaw) h.residual_tokens = l.res;
  return h;
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
  if (c.codec == Codec::kRaw) {
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

TensorHeader ParamsHeader(const CodecConfig& c) {
  TensorHeader h;
  h.codec = c.codec;
  if (c.codec == Codec::kRaw) return h;
  h.bits = c.bits;
  const bool grouped = c.codec == Codec::kKivi || (IsGear(c.codec) && c.backbone == Codec::kKivi);
  if (grouped) h.group_size = c.group_size;
  h.residual_tokens = c.residual_tokens;
  h.block_tokens = c.block_tokens;
  if (IsGear(c.codec)) {
    h.rank = c.rank;
    h.backbone = c.backbone;
    if (c.codec == Codec::kGear) h.outlier_fraction = c.outlier_fraction;
  }
  return h;
}

absl::StatusOr<int64_t> EncodedBufferBytes(const CodecConfig& c, TensorRole role,
                                           absl::Span<const int64_t> shape) {
  KVT_RETURN_IF_ERROR(ValidateCodecConfig(c));
  KVT_ASSIGN_OR_RETURN(Layout l, LayoutFor(c, role, shape));
  int64_t total = 0;
  for (const BufferSize& b : BufferList(l)) total += b.bytes;
  return total;
}

absl::StatusOr<BlockEncoder> BlockEncoder::Make(const CodecConfig& c, TensorRole role,
                                                absl::Span<const int64_t> shape) {
  KVT_ASSIGN_OR_RETURN(Layout l, EncodableLayout(c, role, shape));
  BlockEncoder e;
  e.config_ = c;
  e.role_ = role;
  e.header_ = HeaderFor(c, l, role, shape);
  e.buffers_ = BufferList(l);
  return e;
}

int64_t BlockEncoder::buffer_bytes() const {
  int64_t total = 0;
  for (const BufferSize& b : buffers_) total += b.bytes;
  return total;
}

namespace {

// The buffers at `out`, in `list`'s order, by kind.
BufferPtrs PointersOf(const std::vector<BufferSize>& list, absl::Span<uint8_t* const> out) {
  BufferPtrs p;
  for (size_t i = 0; i < list.size(); ++i) SetBuffer(list[i].kind, out[i], &p);
  return p;
}

}  // namespace

absl::Status BlockEncoder::EncodeInto(const float* data, absl::Span<uint8_t* const> out,
                                      KernelLevel level) const {
  if (out.size() != buffers_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the tensor has ", buffers_.size(), " buffers, ", out.size(), " given"));
  }
  KVT_ASSIGN_OR_RETURN(Layout l, LayoutFor(config_, role_, header_.shape));
  // The input check rides along with the quantizer's pass where it can; a
  // check it could not do, or one that failed, runs in full (and names the
  // element).
  bool fused = false;
  EncodeBuffers(config_, l, data, PointersOf(buffers_, out), level, &fused);
  if (!fused) KVT_RETURN_IF_ERROR(CheckInput(config_, l, data));
  return absl::OkStatus();
}

absl::Status BlockEncoder::EncodeInto(const void* data, DType dtype, absl::Span<uint8_t* const> out,
                                      std::vector<float>* scratch, KernelLevel level) const {
  if (dtype == DType::kFp32) return EncodeInto(static_cast<const float*>(data), out, level);
  if (dtype != DType::kFp16 && dtype != DType::kBf16) {
    return absl::InvalidArgumentError("input dtype must be fp16, bf16 or fp32");
  }
  if (out.size() != buffers_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the tensor has ", buffers_.size(), " buffers, ", out.size(), " given"));
  }
  KVT_ASSIGN_OR_RETURN(Layout l, LayoutFor(config_, role_, header_.shape));
  const int64_t n = l.slabs * l.tokens * l.d;
  const BufferPtrs bufs = PointersOf(buffers_, out);
  if (config_.codec == Codec::kRaw && config_.dtype == dtype) {
    // Stored as it is held. fp16 input holds no value beyond fp16 range;
    // non-finite elements are refused as the fp32 path refuses them.
    const auto* x = static_cast<const uint16_t*>(data);
    const uint16_t exp_all = dtype == DType::kFp16 ? 0x7c00 : 0x7f80;
    for (int64_t i = 0; i < n; ++i) {
      if ((x[i] & exp_all) == exp_all) {
        return absl::InvalidArgumentError(
            absl::StrCat("element ", i, " is not finite: inputs must be finite"));
      }
    }
    std::memcpy(bufs.raw, data, static_cast<size_t>(n) * 2);
    return absl::OkStatus();
  }
  if ((config_.codec == Codec::kKivi || config_.codec == Codec::kKcvt) && l.res == 0 &&
      UseSimd(level)) {
    // Quantized straight from the 16-bit input, with the input check in the
    // same pass; anything it cannot do (or input it refuses) goes the widened
    // way below, which re-encodes and names the bad element.
    const int64_t slab_elems = l.tokens * l.d, words = internal::CodeWords(l.q),
                  scount = internal::ScaleCount(l.q);
    uint32_t max_abs_bits = 0;
    bool done = true;
    for (int64_t s = 0; s < l.slabs && done; ++s) {
      uint8_t* codes = bufs.codes + s * words * 4;
      done = internal::QuantizeSlab16Simd(l.q, static_cast<const uint16_t*>(data) + s * slab_elems,
                                          dtype == DType::kBf16, codes, bufs.scales + s * scount,
                                          bufs.zeros + s * scount, &max_abs_bits);
      if (done) ZeroCodePadding(l.q, codes);
    }
    if (done && WithinHalfRange(max_abs_bits)) return absl::OkStatus();
  }
  scratch->resize(static_cast<size_t>(n));
  const auto* x = static_cast<const uint16_t*>(data);
  if (UseSimd(level) && internal::WidenSimd(x, dtype == DType::kBf16, n, scratch->data())) {
    // Widened.
  } else if (dtype == DType::kFp16) {
    for (int64_t i = 0; i < n; ++i) (*scratch)[i] = HalfToFloat(x[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) (*scratch)[i] = Bf16ToFloat(x[i]);
  }
  return EncodeInto(scratch->data(), out, level);
}

absl::StatusOr<EncodedBlock> EncodedBlock::Encode(const CodecConfig& c, TensorRole role,
                                                  absl::Span<const int64_t> shape,
                                                  const float* data, KernelLevel level) {
  KVT_ASSIGN_OR_RETURN(BlockEncoder enc, BlockEncoder::Make(c, role, shape));
  EncodedBlock b;
  b.header_ = enc.header();
  b.size_ = enc.buffer_bytes();
  b.data_ = std::make_unique<uint8_t[]>(static_cast<size_t>(std::max<int64_t>(b.size_, 1)));
  std::vector<uint8_t*> out;
  int64_t at = 0;
  for (const BufferSize& s : enc.buffers()) {
    out.push_back(b.data_.get() + at);
    b.buffers_.push_back(
        {s.kind, std::string_view(reinterpret_cast<const char*>(b.data_.get() + at),
                                  static_cast<size_t>(s.bytes))});
    at += s.bytes;
  }
  KVT_RETURN_IF_ERROR(enc.EncodeInto(data, out, level));
  KVT_ASSIGN_OR_RETURN(b.view_, ViewOf(b.header_, b.buffers_));
  return b;
}

EncodedView EncodedView::Raw(DType dtype, const void* data, int64_t slabs, int64_t tokens,
                             int head_dim, int64_t slab_stride, int64_t token_stride) {
  EncodedView v;
  v.codec = Codec::kRaw;
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
