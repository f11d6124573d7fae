// Speculative token selection (InfiniGen, ALGORITHMS.md §5) for models with
// rotary position embeddings.
//
// Offline, a calibration run captures each layer's post-RoPE queries and
// keys. Per layer and KV head, the skew A is the right singular vectors of
// the head's queries (every query head of the group stacked), ordered by
// sigma_q * sigma_k. A is orthogonal, so (q A)(k A)^T = q k^T: skewed
// queries and keys give the same attention. In the skewed space a few
// columns carry most of the query's magnitude; the `partial` columns are
// the top ratio * head_dim of them by sum |q A| over the calibration tokens.
//
// Online, an approximate query for layer l (computed from the attention
// input of layer l - 1, before layer l runs) is skewed, cut to the partial
// columns and scored against the partial columns of layer l's skewed keys.
// Per query head the tokens within `alpha` (in softmax-logit units) of the
// head's best score count; n is the mean count over heads, capped at a
// budget, and each head takes its top n. Only those tokens' K/V need to be
// near the compute for layer l.
//
// Why the skew is applied to post-RoPE vectors and not folded into W_q and
// W_k as InfiniGen does for OPT: RoPE rotates each pair of dimensions by a
// position-dependent angle, and (R q A)(R k A)^T = q k^T holds only for an
// A that commutes with every such rotation (one 2x2 rotation per pair),
// which cannot concentrate a head's energy into a few columns. Applied after
// RoPE, any orthogonal A is exact.
#ifndef KVTIER_KERNELS_SPECULATION_H_
#define KVTIER_KERNELS_SPECULATION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvtier::spec {

// One KV head's skew: A [d, d] row-major (column j is skewed direction j,
// columns in decreasing sigma_q * sigma_k), and the partial columns
// (ascending indices into the skewed space).
struct SkewHead {
  std::vector<float> a;
  std::vector<int32_t> partial;
};

struct SkewModel {
  std::string model;  // What it was calibrated on (a path or a name).
  int layers = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  double partial_ratio = 0.2;
  int64_t calibration_tokens = 0;
  // [layers][kv_heads].
  std::vector<std::vector<SkewHead>> heads;
  int partial_columns() const;
};

// Columns kept for a ratio: round(ratio * d), at least 1, at most d.
int PartialColumns(double ratio, int head_dim);

// A skew that skews nothing (A = I for every head, the first `partial`
// columns kept), named "identity": the partial query and keys are the
// query's and keys' first columns. For tests and benches that need a skew
// without calibrating one.
SkewModel IdentitySkew(int layers, int q_heads, int kv_heads, int head_dim, int partial);

// Eigen-decomposition of a symmetric n x n matrix (row-major, float64) by
// cyclic Jacobi rotations: eigenvalues in decreasing order, eigenvectors as
// the columns of `vectors` (row-major n x n), orthonormal.
void SymmetricEigen(const std::vector<double>& m, int n, std::vector<double>* values,
                    std::vector<double>* vectors);

// Calibrates one layer from its post-RoPE queries q [T, q_heads, d] and
// keys k [T, kv_heads, d]. INVALID_ARGUMENT on a bad shape or ratio.
absl::StatusOr<std::vector<SkewHead>> CalibrateLayer(const float* q, const float* k, int64_t tokens,
                                                     int q_heads, int kv_heads, int d,
                                                     double ratio);

// out[d] = v[d] A.
void Skew(const SkewHead& h, int d, const float* v, float* out);
// out[r] = (v A)[partial]: r = h.partial.size().
void SkewPartial(const SkewHead& h, int d, const float* v, float* out);
// SkewPartial of each of n rows [n, d] into out [n, r], with its bits (4
// rows at a time on AVX2).
void SkewPartialRows(const SkewHead& h, int d, const float* rows, int64_t n, float* out);

// The scores Speculate ranks by, for n_q queries qp [n_q, r] (skewed and cut
// to the partial columns) against the same keys [tokens, r]:
// scores[i][t] = scale * qp[i] . keys[t], summed in column order with a
// rounding after every product and every sum (no fused multiply-add), so
// that every path (AVX2 or not) and cuda::SpeculateSelect give the same bits.
void PartialScores(const float* qp, int n_q, const float* keys, int64_t tokens, int r, float scale,
                   float* const* scores);

struct SpeculationParams {
  float alpha = 4.0f;  // Softmax-logit units below the head's best score.
  int budget = 0;      // Cap on n; 0: none.
};

struct Speculated {
  int n = 0;                                 // Tokens per query head.
  std::vector<int> counts;                   // Per query head, within alpha of its best.
  std::vector<std::vector<int32_t>> tokens;  // Per query head, ascending, n each.
};

// Speculation for one decode query of one layer: qhat [q_heads, d]
// post-RoPE (the approximate query), partial_keys[kv_head] [T, r] (the
// layer's keys, skewed and cut to the partial columns: SkewPartial of each
// key). Scores are q . k / sqrt(d) over the partial columns.
Speculated Speculate(const std::vector<SkewHead>& layer, const float* qhat,
                     const std::vector<const float*>& partial_keys, int64_t tokens, int q_heads,
                     int kv_heads, int d, const SpeculationParams& p);
// The same when KV heads hold different token counts (eviction keeps a
// different number per head): head_tokens[kv_head] tokens in
// partial_keys[kv_head]; a head takes min(n, its count) tokens.
Speculated Speculate(const std::vector<SkewHead>& layer, const float* qhat,
                     const std::vector<const float*>& partial_keys,
                     const std::vector<int64_t>& head_tokens, int q_heads, int kv_heads, int d,
                     const SpeculationParams& p);

// How well a speculated set matches the true attention of query q
// [q_heads, d] over keys[kv_head] [T, d] (post-RoPE), mean over query heads:
// hit = the true top-n attention mass that the set covers, over the true
// top-n mass (n = the set's size); mass = the true attention mass the set
// holds.
struct HitRate {
  double hit = 0, mass = 0;
};
HitRate Score(const Speculated& s, const float* q, const std::vector<const float*>& keys,
              int64_t tokens, int q_heads, int kv_heads, int d);
HitRate Score(const Speculated& s, const float* q, const std::vector<const float*>& keys,
              const std::vector<int64_t>& head_tokens, int q_heads, int kv_heads, int d);

// The skew file: magic "KVTSKEW\0", a format version, the shapes, the
// partial ratio, the model name, every head's A and partial columns, and a
// CRC-32C of everything before it. Load: NOT_FOUND when unreadable,
// INVALID_ARGUMENT for another format, version or shape, DATA_LOSS when
// the checksum does not match or the file is cut short.
std::string SerializeSkew(const SkewModel& m);
absl::StatusOr<SkewModel> ParseSkew(absl::string_view bytes);
absl::Status SaveSkew(const std::string& path, const SkewModel& m);
absl::StatusOr<SkewModel> LoadSkew(const std::string& path);
// The file's bytes, checked as LoadSkew checks them (what a worker upload
// sends).
absl::StatusOr<std::string> ReadSkewFile(const std::string& path);

}  // namespace kvtier::spec

#endif  // KVTIER_KERNELS_SPECULATION_H_
