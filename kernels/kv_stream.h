// Streaming compression of one layer's K/V (ALGORITHMS.md §3, "Streaming"):
// new tokens wait in a full-precision tail; whenever the tail holds
// R + n_b tokens its oldest n_b are encoded alone as one block and appended.
// Old blocks are never re-encoded. R = CodecConfig::residual_tokens,
// n_b = CodecConfig::block_tokens (64 when 0).
#ifndef KVTIER_KERNELS_KV_STREAM_H_
#define KVTIER_KERNELS_KV_STREAM_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/attention.h"
#include "kernels/codec.h"

namespace kvtier {

class KvStream {
 public:
  static absl::StatusOr<KvStream> Create(const CodecConfig& codec, int kv_heads, int head_dim,
                                         KernelLevel level = KernelLevel::kBest);

  // Appends n tokens; k and v are token-major [n, kv_heads, head_dim]. Tail
  // values are rounded to the codec's dtype, as a stored residual would be.
  absl::Status Append(const float* k, const float* v, int64_t n);

  // Encodes the whole tail except its newest R tokens now (in blocks of at
  // most n_b tokens).
  absl::Status Flush();

  // Encoded blocks, oldest first, then the tail: the input of DecodeAttention.
  std::vector<KvBlock> Blocks() const;

  int64_t tokens() const { return encoded_tokens_ + tail_tokens_; }
  int64_t tail_tokens() const { return tail_tokens_; }
  // Bytes of the encoded blocks' buffers plus the tail at dtype size (an
  // EncodedTensor on the wire adds about 30 bytes of metadata a block).
  int64_t bytes() const;
  const CodecConfig& codec() const { return codec_; }
  // The encoded K and V blocks, oldest first.
  std::vector<const EncodedBlock*> key_blocks() const;
  std::vector<const EncodedBlock*> value_blocks() const;

 private:
  KvStream() = default;
  absl::Status EncodeOldest(int64_t n);

  CodecConfig codec_;
  KernelLevel level_ = KernelLevel::kBest;
  int heads_ = 0, dim_ = 0, block_ = 64;
  struct Encoded {
    EncodedBlock k, v;
  };
  std::vector<Encoded> blocks_;
  int64_t encoded_tokens_ = 0;
  int64_t encoded_bytes_ = 0;
  std::vector<float> tail_k_, tail_v_;  // [tail_tokens, heads, dim]
  int64_t tail_tokens_ = 0;
};

}  // namespace kvtier

#endif  // KVTIER_KERNELS_KV_STREAM_H_
