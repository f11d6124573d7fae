#include "rpc/dense_tensor.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/half.h"

namespace kvtier {

absl::StatusOr<int64_t> DenseTokens(const v1::DenseTensor& t, int heads, int d, const char* what) {
  if (t.shape_size() != 3 || t.shape(0) < 1 || t.shape(1) != heads || t.shape(2) != d) {
    std::string got;
    for (int64_t s : t.shape()) absl::StrAppend(&got, got.empty() ? "" : ",", s);
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has shape [", got, "], expected [tokens, ", heads, ",", d, "]"));
  }
  if (t.dtype() != v1::DTYPE_FP32 && t.dtype() != v1::DTYPE_FP16 && t.dtype() != v1::DTYPE_BF16) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": dtype must be fp32, fp16 or bf16"));
  }
  const size_t es = t.dtype() == v1::DTYPE_FP32 ? 4 : 2;
  // Checked: a shape such as [2^60 + 1, 2, 4] must not wrap to a small size.
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(t.shape(0)),
                             static_cast<uint64_t>(heads) * static_cast<uint64_t>(d) * es,
                             &bytes) ||
      t.data().size() != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " holds ", t.data().size(), " bytes, not what its shape [", t.shape(0),
                     ",", heads, ",", d, "] of ", es, "-byte elements needs"));
  }
  return t.shape(0);
}

void ReadDense(const v1::DenseTensor& t, float* out) {
  const char* p = t.data().data();
  if (t.dtype() == v1::DTYPE_FP32) {
    std::memcpy(out, p, t.data().size());
    return;
  }
  const size_t n = t.data().size() / 2;
  const bool fp16 = t.dtype() == v1::DTYPE_FP16;
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    out[i] = fp16 ? HalfToFloat(h) : Bf16ToFloat(h);
  }
}

absl::Status ReadDenseExactly(const v1::DenseTensor& t, float* out, size_t n, const char* what) {
  const int heads = t.shape_size() == 3 ? static_cast<int>(t.shape(1)) : 0;
  const int d = t.shape_size() == 3 ? static_cast<int>(t.shape(2)) : 0;
  absl::StatusOr<int64_t> tokens = DenseTokens(t, heads, d, what);
  if (!tokens.ok() || static_cast<size_t>(*tokens) * heads * d != n) {
    return absl::InternalError(absl::StrCat(what, ": bad output"));
  }
  ReadDense(t, out);
  return absl::OkStatus();
}

absl::Status AppendDense(const v1::DenseTensor& t, int heads, int d, const char* what,
                         std::vector<float>* out) {
  KVT_ASSIGN_OR_RETURN(const int64_t tokens, DenseTokens(t, heads, d, what));
  const size_t at = out->size();
  out->resize(at + static_cast<size_t>(tokens) * heads * d);
  ReadDense(t, out->data() + at);
  return absl::OkStatus();
}

void WriteDense(const float* x, int64_t t0, int64_t tokens, int heads, int d, v1::DType dtype,
                v1::DenseTensor* t) {
  t->set_dtype(dtype);
  t->add_shape(tokens);
  t->add_shape(heads);
  t->add_shape(d);
  const int64_t n = tokens * heads * d;
  const float* src = x + t0 * heads * d;
  if (dtype == v1::DTYPE_FP16 || dtype == v1::DTYPE_BF16) {
    std::string* data = t->mutable_data();
    data->resize(static_cast<size_t>(n) * 2);
    char* p = data->data();
    const bool fp16 = dtype == v1::DTYPE_FP16;
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t h = fp16 ? FloatToHalf(src[i]) : FloatToBf16(src[i]);
      std::memcpy(p + 2 * i, &h, 2);
    }
    return;
  }
  t->set_dtype(v1::DTYPE_FP32);
  t->set_data(reinterpret_cast<const char*>(src), static_cast<size_t>(n) * 4);
}

}  // namespace kvtier
