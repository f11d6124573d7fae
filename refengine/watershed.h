// Round-attention analysis (ALGORITHMS.md §4): for each question of a
// multi-round conversation and each layer, the distribution of the
// question's attention over the past rounds (qAttention, exactly as the
// worker computes it at L_w), and from those the watershed layer L_w.
#ifndef KVTIER_REFENGINE_WATERSHED_H_
#define KVTIER_REFENGINE_WATERSHED_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "model/forward.h"
#include "refengine/conversation.h"
#include "refengine/replay.h"
#include "traces/synthetic_chat.h"

namespace kvtier::refengine {

// Every question's round distribution at every layer.
struct RoundDistributions {
  int layers = 0;
  // One probe per round with at least `min_past` past rounds:
  // dist[probe][layer][past round], each summing to 1. At a sliding layer
  // too it spans every past round: what the worker's scoring at that layer
  // would see (L_w's keys stay resident whatever its window).
  std::vector<std::vector<std::vector<double>>> dist;
  std::vector<int> probe_round;
  // Per layer, its sliding window in tokens, 0 for a global layer; empty:
  // every layer global.
  std::vector<int> window;
  // Per probe, its question's first position and the end position
  // (exclusive) of each past round: which rounds a sliding layer can still
  // attend.
  std::vector<int64_t> probe_pos;
  std::vector<std::vector<int64_t>> round_end;
};

// From the synthetic chat (its queries and keys at every layer).
RoundDistributions SyntheticChatDistributions(const traces::SyntheticChat& chat, int min_past = 2);

// From a llama2.c model holding a conversation (local mode, greedy answers).
absl::StatusOr<RoundDistributions> ModelDistributions(const model::Model& m,
                                                      const ConversationOptions& o,
                                                      int min_past = 2);

// From a llama2.c model replaying conversations (refengine/replay.h),
// teacher-forced on their assistant tokens; the probes of every
// conversation together.
absl::StatusOr<RoundDistributions> ReplayDistributions(
    const model::Model& m, const std::vector<ReplayConversation>& conversations, int min_past = 2);

struct WatershedReport {
  // Per layer l < L - 1: mean over probes and later layers l' of
  // KL(P_l' || P_l) in nats: how far the distribution at l is from the ones
  // the layers above it see. At a sliding layer l' only the rounds still
  // inside its window are at stake: both distributions are restricted to
  // them (and renormalized); a probe with none there does not count.
  std::vector<double> mean_kl;
  // Per layer: mean and max over probes of how many past rounds hold
  // `mass` of the distribution, and the mean past-round count.
  std::vector<double> rounds_for_mass_mean;
  std::vector<int> rounds_for_mass_max;
  // Per layer: mean over probes of the past rounds it can attend (all of
  // them at a global layer, those inside its window at a sliding one).
  std::vector<double> at_stake_mean;
  double past_rounds_mean = 0;
  double mass = 0.95;
  // The first layer from which mean_kl stays at or below `kl_threshold`
  // (nats) at every later layer: the distribution a recall sees there is
  // the one the layers above it use. -1 when none gets that low.
  int watershed = 0;
  double kl_threshold = 0.01;
};

WatershedReport AnalyzeWatershed(const RoundDistributions& d, double mass = 0.95,
                                 double kl_threshold = 0.01);

}  // namespace kvtier::refengine

#endif  // KVTIER_REFENGINE_WATERSHED_H_
