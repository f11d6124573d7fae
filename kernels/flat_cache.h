// The Ada-KV flattened variable-length cache of one layer (ALGORITHMS.md §1):
// K and V as one [sum_h len_h, d] tensor each, heads one after another, with
// head_lens[H] and cu_len[H + 1] (exclusive prefix sum).
#ifndef KVTIER_KERNELS_FLAT_CACHE_H_
#define KVTIER_KERNELS_FLAT_CACHE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/attention.h"

namespace kvtier {

class FlatKvCache {
 public:
  // Gathers each head's kept tokens (ascending indices into [0, tokens)) from
  // dense K and V [kv_heads, tokens, d]. INVALID_ARGUMENT for a bad shape or
  // an index out of range or out of order.
  static absl::StatusOr<FlatKvCache> Gather(int kv_heads, int d, int64_t tokens, const float* k,
                                            const float* v,
                                            const std::vector<std::vector<int64_t>>& keep);

  // Appends one decode token to every head in one pass over the buffers:
  // k and v are [kv_heads, d]. Head h's segment moves by h slots.
  void Append(const float* k, const float* v);

  // Decode attention of q [q_heads, d] over every head's own tokens.
  absl::Status Attend(int q_heads, const float* q, float* out,
                      KernelLevel level = KernelLevel::kBest) const;

  int kv_heads() const { return heads_; }
  int head_dim() const { return d_; }
  const std::vector<int64_t>& head_lens() const { return lens_; }
  const std::vector<int64_t>& cu_len() const { return cu_; }
  const float* keys() const { return k_.data(); }
  const float* values() const { return v_.data(); }
  int64_t total_tokens() const { return cu_.back(); }

 private:
  int heads_ = 0, d_ = 0;
  std::vector<float> k_, v_;
  std::vector<int64_t> lens_, cu_;
};

}  // namespace kvtier

#endif  // KVTIER_KERNELS_FLAT_CACHE_H_
