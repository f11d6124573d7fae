// The Ada-KV flattened variable-length cache of one layer (ALGORITHMS.md §1):
// every KV head's kept tokens in one K and one V tensor per layer, heads one
// after another, described by head_lens[H] and cu_len[H + 1] (the exclusive
// prefix sum of head_lens, the `cu_seqlens_k` of varlen attention kernels).
//
// Appends: Ada-KV's own implementation re-packs the whole layer for every
// decode token (O(total) bytes moved per step). Here each head's segment
// carries `slack_tokens` rows of spare capacity, so an append writes one row
// per head in place and the layer is re-packed only when a head runs out:
// O(H·d) per step amortized. Physical rows of head h are
// [head_offsets[h], head_offsets[h] + head_lens[h]); cu_len stays the packed
// (no-slack) prefix sum, and Packed() produces the packed tensors.
//
// With a lossy codec (FlatCacheOptions::codec), each head's tokens are held
// as a KvStream instead: codec-encoded blocks of n_b tokens plus a
// full-precision tail, and attention reads the encoded blocks directly
// through DecodeAttention (kernels/attention.h).
#ifndef KVTIER_KERNELS_FLAT_CACHE_H_
#define KVTIER_KERNELS_FLAT_CACHE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/attention.h"
#include "kernels/codec.h"
#include "kernels/kv_stream.h"

namespace kvtier {

struct FlatCacheOptions {
  // Spare rows per head after a gather or re-pack (0: re-pack on every append,
  // as Ada-KV does).
  int64_t slack_tokens = 64;
  // Raw fp32 by default. Anything else stores each head as a KvStream.
  CodecConfig codec = RawFp32();
  static CodecConfig RawFp32() {
    CodecConfig c;
    c.codec = Codec::kRaw;
    c.dtype = DType::kFp32;
    return c;
  }
  KernelLevel level = KernelLevel::kBest;
};

class FlatKvCache {
 public:
  // Gathers each head's kept tokens (ascending indices into [0, tokens)) from
  // dense K and V [kv_heads, tokens, d]. INVALID_ARGUMENT for a bad shape, an
  // index out of range or out of order, or an invalid codec.
  static absl::StatusOr<FlatKvCache> Gather(int kv_heads, int d, int64_t tokens, const float* k,
                                            const float* v,
                                            const std::vector<std::vector<int64_t>>& keep,
                                            const FlatCacheOptions& options = {});

  // Appends one decode token to every head: k and v are [kv_heads, d].
  absl::Status Append(const float* k, const float* v);

  // Decode attention of q [q_heads, d] over every head's own tokens (GQA:
  // q_heads a multiple of kv_heads). A head with no tokens outputs zeros.
  absl::Status Attend(int q_heads, const float* q, float* out) const;
  // Same, at a chosen kernel level (the codec's streams keep their own).
  absl::Status Attend(int q_heads, const float* q, float* out, KernelLevel level) const;

  int kv_heads() const { return heads_; }
  int head_dim() const { return d_; }
  bool encoded() const { return !streams_.empty(); }
  const std::vector<int64_t>& head_lens() const { return lens_; }
  const std::vector<int64_t>& cu_len() const { return cu_; }
  int64_t total_tokens() const { return cu_.back(); }
  // Raw storage only: the physical tensors [rows, d] and each head's first row.
  const float* keys() const { return k_.data(); }
  const float* values() const { return v_.data(); }
  const std::vector<int64_t>& head_offsets() const { return off_; }
  // Raw storage only: the packed Ada-KV tensors [total_tokens, d].
  void Packed(std::vector<float>* k, std::vector<float>* v) const;
  // Bytes held: raw rows in use at 4 bytes per value, or the streams' bytes.
  int64_t bytes() const;

 private:
  void Repack();

  int heads_ = 0, d_ = 0;
  FlatCacheOptions opt_;
  std::vector<float> k_, v_;
  std::vector<int64_t> lens_, cu_, off_, cap_;
  std::vector<KvStream> streams_;  // One per head when encoded.
};

}  // namespace kvtier

#endif  // KVTIER_KERNELS_FLAT_CACHE_H_
