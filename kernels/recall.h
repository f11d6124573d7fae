// Round recall (ALGORITHMS.md §4, Round Attention): how much the new
// question's queries attend to each past round at the watershed layer
// (qAttention), and which rounds to bring back for the layers above it.
#ifndef KVTIER_KERNELS_RECALL_H_
#define KVTIER_KERNELS_RECALL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvtier {

enum class RecallMode { kAll, kTopK, kAdaptive, kThreshold, kMass };

struct RecallStrategy {
  RecallMode mode = RecallMode::kAdaptive;
  // kTopK: k (rounds); kAdaptive: lambda in mean + lambda * std; kThreshold:
  // theta on the normalized score; kMass: P, top-k with k the smallest count
  // whose rounds hold at least P of the normalized scores.
  double param = 1.0;
};

// "all", "topk:K" (K >= 1), "adaptive:LAMBDA", "threshold:THETA" (in [0, 1]),
// "mass:P" (in (0, 1]). INVALID_ARGUMENT otherwise.
absl::StatusOr<RecallStrategy> ParseRecall(const std::string& text);
std::string RecallName(const RecallStrategy& s);

// One past round's watershed-layer keys for qAttention: per KV head h,
// lens[h] keys of head_dim floats at keys[h] (what eviction kept).
struct RoundKeys {
  std::vector<const float*> keys;
  std::vector<int64_t> lens;
};

// qAttention over past rounds (float64): for each question query i (token
// i of the current round, [q_heads, d] rows at q + i * q_stride) and query
// head, softmax over every key it sees (all past rounds' keys, then the
// current round's keys 0..i, `cur_k` token-major [tokens, kv_heads, d]), and
// the mass that lands in each past round, summed over heads and queries and
// normalized to sum 1 over the past rounds. Empty when there are none.
std::vector<double> QAttention(int q_heads, int kv_heads, int d, const float* q, int64_t q_stride,
                               int64_t question_tokens, const std::vector<RoundKeys>& rounds,
                               const float* cur_k);

// The selected past rounds (ascending indices into `scores`), per strategy;
// the most recent past round is added when keep_recent is set. The current
// round is always attended and not part of `scores`.
std::vector<uint32_t> SelectRounds(const std::vector<double>& scores, const RecallStrategy& s,
                                   bool keep_recent);

// The smallest k whose top-k rounds hold at least `mass` of the scores.
int RoundsForMass(const std::vector<double>& scores, double mass);

}  // namespace kvtier

#endif  // KVTIER_KERNELS_RECALL_H_
