// InfiniGen on a llama2.c model (kernels/speculation.h): calibrating the
// skew (`kvtier calibrate infinigen`) and measuring speculation
// (`kvtier eval speculation`): per-layer hit rate, the tokens kept, the
// fidelity of attention over only the speculated tokens, and the K/V bytes
// touched, each against the dense full cache in the same run.
#ifndef KVTIER_EVAL_SPECULATION_EVAL_H_
#define KVTIER_EVAL_SPECULATION_EVAL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/speculation.h"
#include "model/forward.h"

namespace kvtier::eval {

struct CalibrationReport {
  int64_t tokens = 0;
  // Per layer: the relative Frobenius error of the causal attention outputs
  // of the first calibration sequence with skewed q and k against unskewed
  // (float tolerance: the skew is exact in real arithmetic).
  std::vector<double> invariance_err;
  // Per layer: the share of sum q^2 that the partial columns hold, skewed,
  // and for the same number of unskewed columns (the best ones).
  std::vector<double> energy_skewed, energy_raw;
};

// Runs every sequence through the model (full cache), captures each
// layer's post-RoPE q and k, and calibrates every layer at `ratio`.
absl::StatusOr<spec::SkewModel> CalibrateSkew(const model::Model& m,
                                              const std::vector<std::vector<int>>& sequences,
                                              double ratio, const std::string& name,
                                              CalibrationReport* report);

// One round of an evaluated conversation: `prefill` as one step, then each
// `decode` token as a step (teacher-forced).
struct SpecRound {
  std::vector<int> prefill, decode;
};

struct SpecLayerStats {
  double hit = 0, mass = 0, n = 0;  // Means over decode steps.
  int64_t steps = 0;
};

struct SpecResult {
  spec::SpeculationParams params;
  double partial_ratio = 0;
  // Per layer (layer 0 runs dense: InfiniGen skips the first layer).
  std::vector<SpecLayerStats> layers;
  int64_t positions = 0;    // Decode steps scored.
  double top1 = 0, kl = 0;  // Against the full cache, at every decode step.
  // Attention outputs of the speculated layers against dense ones.
  double attn_rel_err = 0;
  // K/V bytes read per decode step, fp32: dense (every token's K and V at
  // every layer) and speculative (dense layer 0; then each layer's partial
  // keys, and K and V of the union of its query heads' tokens per KV head).
  double bytes_dense = 0, bytes_speculative = 0;
};

// Teacher-forced over the conversations, decode steps at layers >= 1
// attend only over the speculated tokens (plus the token itself), prefill
// steps dense. INVALID_ARGUMENT when the skew does not match the model.
//
// With `oracle_query`, layer l speculates with its own true query instead of
// the approximation from layer l - 1's input: what the partial columns and
// alpha cost alone, apart from the approximation.
absl::StatusOr<SpecResult> EvaluateSpeculation(const model::Model& m, const spec::SkewModel& skew,
                                               const std::vector<std::vector<SpecRound>>& convs,
                                               const spec::SpeculationParams& p,
                                               bool oracle_query = false);

}  // namespace kvtier::eval

#endif  // KVTIER_EVAL_SPECULATION_EVAL_H_
