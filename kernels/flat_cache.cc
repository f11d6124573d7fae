#include "kernels/flat_cache.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace kvtier {

absl::StatusOr<FlatKvCache> FlatKvCache::Gather(int kv_heads, int d, int64_t tokens, const float* k,
                                                const float* v,
                                                const std::vector<std::vector<int64_t>>& keep,
                                                const FlatCacheOptions& options) {
  if (kv_heads < 1 || d < 1 || tokens < 0 || static_cast<int>(keep.size()) != kv_heads) {
    return absl::InvalidArgumentError("flat cache needs one index list per KV head");
  }
  if (options.slack_tokens < 0) return absl::InvalidArgumentError("slack_tokens must be >= 0");
  FlatKvCache c;
  c.heads_ = kv_heads;
  c.d_ = d;
  c.opt_ = options;
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
  const bool raw = options.codec.codec == Codec::kRaw && options.codec.dtype == DType::kFp32;
  if (!raw) {
    // One stream per head, fed the head's kept tokens in order.
    std::vector<float> hk, hv;
    for (int h = 0; h < kv_heads; ++h) {
      KVT_ASSIGN_OR_RETURN(KvStream s, KvStream::Create(options.codec, 1, d, options.level));
      hk.resize(keep[h].size() * d);
      hv.resize(hk.size());
      for (size_t i = 0; i < keep[h].size(); ++i) {
        std::memcpy(hk.data() + i * d, k + (h * tokens + keep[h][i]) * d, d * sizeof(float));
        std::memcpy(hv.data() + i * d, v + (h * tokens + keep[h][i]) * d, d * sizeof(float));
      }
      KVT_RETURN_IF_ERROR(s.Append(hk.data(), hv.data(), static_cast<int64_t>(keep[h].size())));
      c.streams_.push_back(std::move(s));
    }
    return c;
  }
  int64_t rows = 0;
  for (int h = 0; h < kv_heads; ++h) {
    c.off_.push_back(rows);
    c.cap_.push_back(c.lens_[h] + options.slack_tokens);
    rows += c.cap_.back();
  }
  c.k_.resize(static_cast<size_t>(rows * d));
  c.v_.resize(c.k_.size());
  for (int h = 0; h < kv_heads; ++h) {
    for (size_t i = 0; i < keep[h].size(); ++i) {
      const int64_t src = (h * tokens + keep[h][i]) * d;
      const int64_t dst = (c.off_[h] + static_cast<int64_t>(i)) * d;
      std::memcpy(c.k_.data() + dst, k + src, d * sizeof(float));
      std::memcpy(c.v_.data() + dst, v + src, d * sizeof(float));
    }
  }
  return c;
}

void FlatKvCache::Repack() {
  int64_t rows = 0;
  std::vector<int64_t> off(heads_), cap(heads_);
  for (int h = 0; h < heads_; ++h) {
    off[h] = rows;
    cap[h] = lens_[h] + std::max<int64_t>(opt_.slack_tokens, 1);
    rows += cap[h];
  }
  std::vector<float> k(static_cast<size_t>(rows * d_)), v(k.size());
  for (int h = 0; h < heads_; ++h) {
    std::memcpy(k.data() + off[h] * d_, k_.data() + off_[h] * d_, lens_[h] * d_ * sizeof(float));
    std::memcpy(v.data() + off[h] * d_, v_.data() + off_[h] * d_, lens_[h] * d_ * sizeof(float));
  }
  k_ = std::move(k);
  v_ = std::move(v);
  off_ = std::move(off);
  cap_ = std::move(cap);
}

absl::Status FlatKvCache::Append(const float* k, const float* v) {
  if (encoded()) {
    for (int h = 0; h < heads_; ++h)
      KVT_RETURN_IF_ERROR(streams_[h].Append(k + h * d_, v + h * d_, 1));
  } else {
    for (int h = 0; h < heads_; ++h) {
      if (lens_[h] == cap_[h]) {
        Repack();
        break;
      }
    }
    for (int h = 0; h < heads_; ++h) {
      const int64_t row = (off_[h] + lens_[h]) * d_;
      std::memcpy(k_.data() + row, k + h * d_, d_ * sizeof(float));
      std::memcpy(v_.data() + row, v + h * d_, d_ * sizeof(float));
    }
  }
  for (int h = 0; h < heads_; ++h) {
    ++lens_[h];
    cu_[h + 1] += h + 1;
  }
  return absl::OkStatus();
}

absl::Status FlatKvCache::Attend(int q_heads, const float* q, float* out) const {
  return Attend(q_heads, q, out, opt_.level);
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
    if (encoded()) {
      const std::vector<KvBlock> blocks = streams_[h].Blocks();
      KVT_RETURN_IF_ERROR(
          DecodeAttention({rep, 1, d_}, q + h * rep * d_, blocks, out + h * rep * d_, level));
      continue;
    }
    const KvBlock b{EncodedView::Raw(DType::kFp32, k_.data() + off_[h] * d_, 1, lens_[h], d_,
                                     lens_[h] * d_, d_),
                    EncodedView::Raw(DType::kFp32, v_.data() + off_[h] * d_, 1, lens_[h], d_,
                                     lens_[h] * d_, d_)};
    KVT_RETURN_IF_ERROR(
        DecodeAttention({rep, 1, d_}, q + h * rep * d_, {&b, 1}, out + h * rep * d_, level));
  }
  return absl::OkStatus();
}

void FlatKvCache::Packed(std::vector<float>* k, std::vector<float>* v) const {
  k->resize(static_cast<size_t>(total_tokens() * d_));
  v->resize(k->size());
  if (encoded()) return;
  for (int h = 0; h < heads_; ++h) {
    std::memcpy(k->data() + cu_[h] * d_, k_.data() + off_[h] * d_, lens_[h] * d_ * sizeof(float));
    std::memcpy(v->data() + cu_[h] * d_, v_.data() + off_[h] * d_, lens_[h] * d_ * sizeof(float));
  }
}

int64_t FlatKvCache::bytes() const {
  if (!encoded()) return 2 * total_tokens() * d_ * static_cast<int64_t>(sizeof(float));
  int64_t b = 0;
  for (const KvStream& s : streams_) b += s.bytes();
  return b;
}

}  // namespace kvtier
