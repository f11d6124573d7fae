#include "kernels/kv_stream.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/half.h"

namespace kvtier {
namespace {

float RoundTo(DType dtype, float x) {
  switch (dtype) {
    case DType::kFp16:
      return HalfToFloat(FloatToHalf(x));
    case DType::kBf16:
      return Bf16ToFloat(FloatToBf16(x));
    default:
      return x;
  }
}

}  // namespace

absl::StatusOr<KvStream> KvStream::Create(const CodecConfig& codec, int kv_heads, int head_dim,
                                          KernelLevel level) {
  KVT_RETURN_IF_ERROR(ValidateCodecConfig(codec));
  if (kv_heads < 1 || head_dim < 1) {
    return absl::InvalidArgumentError("a KV stream needs kv_heads >= 1 and head_dim >= 1");
  }
  KvStream s;
  s.codec_ = codec;
  s.level_ = level;
  s.heads_ = kv_heads;
  s.dim_ = head_dim;
  s.block_ = codec.block_tokens > 0 ? codec.block_tokens : 64;
  s.codec_.block_tokens = s.block_;
  return s;
}

absl::Status KvStream::Append(const float* k, const float* v, int64_t n) {
  if (n < 0) return absl::InvalidArgumentError("negative token count");
  const int64_t row = static_cast<int64_t>(heads_) * dim_;
  for (int64_t i = 0; i < n * row; ++i) {
    tail_k_.push_back(RoundTo(codec_.dtype, k[i]));
    tail_v_.push_back(RoundTo(codec_.dtype, v[i]));
  }
  tail_tokens_ += n;
  while (tail_tokens_ >= codec_.residual_tokens + block_) KVT_RETURN_IF_ERROR(EncodeOldest(block_));
  return absl::OkStatus();
}

absl::Status KvStream::Flush() {
  while (tail_tokens_ > codec_.residual_tokens) {
    KVT_RETURN_IF_ERROR(
        EncodeOldest(std::min<int64_t>(block_, tail_tokens_ - codec_.residual_tokens)));
  }
  return absl::OkStatus();
}

absl::Status KvStream::EncodeOldest(int64_t n) {
  // Token-major tail -> head-major [heads, n, dim] block.
  std::vector<float> kb(static_cast<size_t>(heads_ * n * dim_)), vb(kb.size());
  for (int64_t t = 0; t < n; ++t) {
    for (int h = 0; h < heads_; ++h) {
      const int64_t src = (t * heads_ + h) * dim_;
      const int64_t dst = (h * n + t) * dim_;
      std::copy_n(tail_k_.begin() + src, dim_, kb.begin() + dst);
      std::copy_n(tail_v_.begin() + src, dim_, vb.begin() + dst);
    }
  }
  CodecConfig c = codec_;
  c.residual_tokens = 0;
  const int64_t shape[3] = {heads_, n, dim_};
  KVT_ASSIGN_OR_RETURN(EncodedBlock kt,
                       EncodedBlock::Encode(c, TensorRole::kKey, shape, kb.data(), level_));
  KVT_ASSIGN_OR_RETURN(EncodedBlock vt,
                       EncodedBlock::Encode(c, TensorRole::kValue, shape, vb.data(), level_));
  encoded_bytes_ += static_cast<int64_t>(kt.bytes().size() + vt.bytes().size());
  encoded_tokens_ += n;
  blocks_.push_back(Encoded{std::move(kt), std::move(vt)});
  const int64_t drop = n * heads_ * dim_;
  tail_k_.erase(tail_k_.begin(), tail_k_.begin() + drop);
  tail_v_.erase(tail_v_.begin(), tail_v_.begin() + drop);
  tail_tokens_ -= n;
  return absl::OkStatus();
}

std::vector<KvBlock> KvStream::Blocks() const {
  std::vector<KvBlock> out;
  out.reserve(blocks_.size() + 1);
  for (const Encoded& e : blocks_) out.push_back({e.k.view(), e.v.view()});
  if (tail_tokens_ > 0) {
    const int64_t row = static_cast<int64_t>(heads_) * dim_;
    KvBlock b;
    b.k = EncodedView::Raw(DType::kFp32, tail_k_.data(), heads_, tail_tokens_, dim_, dim_, row);
    b.v = EncodedView::Raw(DType::kFp32, tail_v_.data(), heads_, tail_tokens_, dim_, dim_, row);
    out.push_back(b);
  }
  return out;
}

int64_t KvStream::bytes() const {
  return encoded_bytes_ + 2 * tail_tokens_ * heads_ * dim_ * DTypeSize(codec_.dtype);
}

std::vector<const EncodedBlock*> KvStream::key_blocks() const {
  std::vector<const EncodedBlock*> out;
  for (const Encoded& e : blocks_) out.push_back(&e.k);
  return out;
}

std::vector<const EncodedBlock*> KvStream::value_blocks() const {
  std::vector<const EncodedBlock*> out;
  for (const Encoded& e : blocks_) out.push_back(&e.v);
  return out;
}

}  // namespace kvtier
