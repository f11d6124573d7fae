#include "worker/rows.h"

#include <cstring>

#include "kernels/half.h"

namespace kvtier::worker {

float RowValue(const Rows& r, int64_t i) {
  switch (r.dtype) {
    case DType::kFp16:
    case DType::kBf16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const uint8_t*>(r.data) + i * 2, 2);
      return r.dtype == DType::kFp16 ? HalfToFloat(h) : Bf16ToFloat(h);
    }
    default: {
      float x;
      std::memcpy(&x, static_cast<const uint8_t*>(r.data) + i * 4, 4);
      return x;
    }
  }
}

const float* Fp32Rows(const Rows& r, int64_t count, std::vector<float>* buf) {
  if (r.empty()) return nullptr;
  if (r.dtype == DType::kFp32) return static_cast<const float*>(r.data);
  buf->resize(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) (*buf)[i] = RowValue(r, i);
  return buf->data();
}

}  // namespace kvtier::worker
