#include "kernels/flat_cache.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace kvtier {

absl::StatusOr<FlatKvCache> FlatKvCache::Gather(int kv_heads, int d, int64_t tokens, const float* k,
                                                const float* v,
                                                const std::vector<std::vector<int64_t>>& keep) {
  if (kv_heads < 1 || d < 1 || tokens < 0 || static_cast<int>(keep.size()) != kv_heads) {
    return absl::InvalidArgumentError("flat cache needs one index list per KV head");
  }
  FlatKvCache c;
  c.heads_ = kv_heads;
  c.d_ = d;
  c.cu_.push_back(0);
  for (int h = 0; h < kv_heads; ++h) {
    int64_t prev = -1;
    for (int64_t t : keep[h]) {
      if (t <= prev || t >= tokens) {
        return absl::InvalidArgumentError(absl::StrCat(
            "head ", h, ": kept index ", t, " is out of order or outside [0, ", tokens, ")"));
      }
      prev = t;
    }
    c.lens_.push_back(static_cast<int64_t>(keep[h].size()));
    c.cu_.push_back(c.cu_.back() + c.lens_.back());
  }
  c.k_.resize(static_cast<size_t>(c.cu_.back() * d));
  c.v_.resize(c.k_.size());
  for (int h = 0; h < kv_heads; ++h) {
    for (size_t i = 0; i < keep[h].size(); ++i) {
      const int64_t src = (h * tokens + keep[h][i]) * d;
      const int64_t dst = (c.cu_[h] + static_cast<int64_t>(i)) * d;
      std::memcpy(c.k_.data() + dst, k + src, d * sizeof(float));
      std::memcpy(c.v_.data() + dst, v + src, d * sizeof(float));
    }
  }
  return c;
}

void FlatKvCache::Append(const float* k, const float* v) {
  const int64_t old_total = cu_.back();
  k_.resize(static_cast<size_t>((old_total + heads_) * d_));
  v_.resize(k_.size());
  // Last head first: head h moves from cu[h] to cu[h] + h, so moving in
  // descending order never overwrites a segment not yet moved.
  for (int h = heads_ - 1; h >= 0; --h) {
    const int64_t from = cu_[h] * d_, to = (cu_[h] + h) * d_, n = lens_[h] * d_;
    if (h > 0) {
      std::memmove(k_.data() + to, k_.data() + from, n * sizeof(float));
      std::memmove(v_.data() + to, v_.data() + from, n * sizeof(float));
    }
    std::memcpy(k_.data() + to + n, k + h * d_, d_ * sizeof(float));
    std::memcpy(v_.data() + to + n, v + h * d_, d_ * sizeof(float));
  }
  for (int h = 0; h < heads_; ++h) {
    cu_[h] += h;
    ++lens_[h];
  }
  cu_[heads_] = old_total + heads_;
}

absl::Status FlatKvCache::Attend(int q_heads, const float* q, float* out, KernelLevel level) const {
  if (q_heads < heads_ || q_heads % heads_ != 0) {
    return absl::InvalidArgumentError("q_heads must be a multiple of the cache's KV heads");
  }
  const int rep = q_heads / heads_;
  for (int h = 0; h < heads_; ++h) {
    if (lens_[h] == 0) {
      std::fill(out + h * rep * d_, out + (h + 1) * rep * d_, 0.0f);
      continue;
    }
    const KvBlock b{EncodedView::Raw(v1::DTYPE_FP32, k_.data() + cu_[h] * d_, 1, lens_[h], d_,
                                     lens_[h] * d_, d_),
                    EncodedView::Raw(v1::DTYPE_FP32, v_.data() + cu_[h] * d_, 1, lens_[h], d_,
                                     lens_[h] * d_, d_)};
    KVT_RETURN_IF_ERROR(
        DecodeAttention({rep, 1, d_}, q + h * rep * d_, {&b, 1}, out + h * rep * d_, level));
  }
  return absl::OkStatus();
}

}  // namespace kvtier
