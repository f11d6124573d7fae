// Token eviction (ALGORITHMS.md §1): which of a layer's tokens each KV head
// keeps. Scoring (SnapKV observation window with pooling and GQA reduction,
// H2O accumulated attention, StreamingLLM sinks + recent), per-head budget
// allocation (uniform, Ada-KV) and per-layer budgets (uniform, PyramidKV,
// named profile), and the selection of kept token indices.
#ifndef KVTIER_KERNELS_EVICTION_H_
#define KVTIER_KERNELS_EVICTION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvtier::evict {

enum class Pooling { kMax, kAvg, kNone };
enum class GqaReduce { kMean, kMax };

struct ScoreOptions {
  int window = 32;  // w: observation window (the last w queries), always kept.
  int kernel = 7;   // 1-D pooling kernel along tokens (odd), stride 1, same padding.
  Pooling pooling = Pooling::kMax;
  GqaReduce gqa = GqaReduce::kMean;
};

// One layer's queries and keys for a round: q [q_heads, T, d], k [kv_heads, T, d].
struct LayerQK {
  int q_heads = 0;
  int kv_heads = 0;
  int d = 0;
  int64_t tokens = 0;
  const float* q = nullptr;
  const float* k = nullptr;
  // Floats from one head's first row to the next head's, in q and in k.
  // Default: 0, meaning tokens * d (heads packed). The worker's open round
  // leaves room between heads to grow.
  int64_t head_stride = 0;
  // The rows of q held, when not all are: [q_first, tokens), row r of q head
  // h at q + h * q_head_stride + (r - q_first) * d. SnapKV-family scoring
  // reads only the last w rows (q_first <= tokens - w, or 0 when tokens <=
  // w); H2O reads every row (q_first = 0). Defaults: 0 and head_stride.
  int64_t q_first = 0;
  int64_t q_head_stride = 0;
  // Oracle window, for analysis only: when set, SnapKV-family scores come
  // from these queries [q_heads, future_queries, d], each seeing all T keys,
  // instead of the last w rows of q. Real eviction cannot know them; the
  // gap between the two says how well the observation window predicts the
  // queries that follow.
  const float* future_q = nullptr;
  int64_t future_queries = 0;
};

// SnapKV observation scores: for each KV head, each key j < T - w scored by
// the mean over the last w queries (of every query head in its GQA group,
// reduced by mean or max) of softmax(Q[-w:] K^T / sqrt(d)), causal inside the
// last w x w block, then pooled. Returns [kv_heads, T - w] (empty rows when
// T <= w). INVALID_ARGUMENT for bad shapes or options.
absl::StatusOr<std::vector<float>> ObservationScores(const ScoreOptions& o, const LayerQK& x);

// H2O: each key's softmax attention summed over every (causal) query that
// sees it, GQA-reduced like above. Returns [kv_heads, T].
absl::StatusOr<std::vector<float>> H2oScores(const LayerQK& x, GqaReduce gqa);

// Ada-KV split of one layer's budget across its heads: the global top
// heads * b_prime of all heads' scores ([heads, n]), c_i picks per head, then
// B_i = round((1 - alpha) c_i + alpha b_prime), capped at n. Sums to
// heads * b_prime up to rounding, which is repaired so the total is exact
// (never exceeding heads * n).
absl::StatusOr<std::vector<int64_t>> AdaKvBudgets(const std::vector<float>& scores, int heads,
                                                  int64_t n, int64_t b_prime, double alpha);

// PyramidKV per-layer budgets (window excluded: B' per layer), for per-head
// budget B (window included), window w, beta, L layers and T tokens.
absl::StatusOr<std::vector<int64_t>> PyramidBudgets(int64_t budget, int window, double beta,
                                                    int layers, int64_t tokens);

// Validates a per-head budget B against a window w (B >= 1, w < B).
absl::Status ValidateBudget(int64_t budget, int window);

// The kept token indices of one head: its top `keep` scored keys among the
// first n (ties to the earlier token), ascending, then the window tokens
// [n, n + w). keep >= n keeps everything.
std::vector<int64_t> SelectTopK(const float* scores, int64_t n, int64_t keep, int window);

// StreamingLLM: the first `sinks` tokens and the most recent `recent`.
std::vector<int64_t> StreamingSelect(int64_t tokens, int sinks, int64_t recent);

// How much one decode query's attention output changes when each KV head
// attends only over its kept tokens (softmax renormalized), per query head,
// without W^O: l1 = sum over heads and channels of |y - y^| (the Ada-KV
// metric) and rel = ||y - y^||_F / ||y||_F. q [q_heads, d]; k, v
// [kv_heads, tokens, d]; keep[h] ascending indices.
struct EvictionError {
  double l1 = 0;
  double rel = 0;
};
absl::StatusOr<EvictionError> EvictionLoss(int q_heads, int kv_heads, int d, int64_t tokens,
                                           const float* q, const float* k, const float* v,
                                           const std::vector<std::vector<int64_t>>& keep);

// A named eviction policy (ALGORITHMS.md §1-2), selectable as text:
//   "none", "streaming:B", "h2o:B", "snapkv:B", "pyramidkv:B", "ada-snapkv:B",
//   "ada-pyramid:B", "profile:FILE" (per-layer budgets from a layer-profile
//   file, SnapKV selection), with options ":w=", ":k=", ":pool=max|avg|none",
//   ":gqa=mean|max", ":alpha=", ":beta=". B is the per-head budget in tokens,
//   the observation window included; without ":w=" the window is
//   DefaultWindow(B). "ada-pyramidkv" is accepted for "ada-pyramid",
//   "streamingllm" for "streaming".
enum class Method {
  kNone,
  kStreaming,
  kH2o,
  kSnapKv,
  kPyramidKv,
  kAdaSnapKv,
  kAdaPyramid,
  kProfile
};

struct Policy {
  Method method = Method::kSnapKv;
  int64_t budget = 128;
  ScoreOptions score;
  double alpha = 0.2;                  // Ada-KV safeguard.
  double beta = 20;                    // PyramidKV.
  int sinks = 4;                       // StreamingLLM.
  std::vector<int64_t> layer_budgets;  // kProfile: per-layer per-head budgets.
  std::string profile_name;
};

absl::StatusOr<Policy> ParsePolicy(const std::string& text);
std::string PolicyName(const Policy& p);

// Which tokens each KV head of `layer` (of `layers`) keeps after a round's
// prefill. x holds the round's queries for every position (H2O uses all,
// SnapKV-family the last w); none and streaming select by position and read
// neither x.q nor x.k, which may then be null. Returns ascending indices per
// KV head.
absl::StatusOr<std::vector<std::vector<int64_t>>> SelectTokens(const Policy& p, int layer,
                                                               int layers, const LayerQK& x);

// The observation window a policy gets when its text names none:
// min(32, B / 4), at least 1 (32 is SnapKV's published window; a quarter of
// smaller budgets keeps every budget above 1 valid). For a layer profile B
// is its smallest layer budget.
int DefaultWindow(int64_t budget);

// How many of a round's last queries SelectTokens reads under `p`: 0 (none,
// streaming), -1 for every one (H2O), else the observation window w. A
// holder of a round's queries needs to keep only these.
int64_t QueriesRead(const Policy& p);

// Layer-profile files (EvolKV output): text lines
//   kvtier-layer-profile 1
//   name NAME
//   budgets B_0 B_1 ... B_{L-1}
// Per-head budgets per layer, window included. '#' starts a comment.
absl::StatusOr<Policy> LoadLayerProfile(const std::string& path);
absl::Status SaveLayerProfile(const std::string& path, const std::string& name,
                              const std::vector<int64_t>& budgets);

}  // namespace kvtier::evict

#endif  // KVTIER_KERNELS_EVICTION_H_
