// How a past round's layers are cut into stored segments. Round Attention
// stores a round as two segments split at the watershed layer L_w, so that a
// recall fetches one contiguous tensor set: the lower segment [0, L_w] and
// the upper one (L_w, L). A model with sliding-window layers cuts each side
// further wherever a layer's kind changes, the kinds being "slides" (window
// > 0, not L_w) and "stays" (global, or L_w, whose keys recall scores), so
// that a round that has left every window of a sliding segment's layers can
// lose that segment from the store without rewriting the rest.
//
// A model with no sliding layer gets exactly the two segments; every
// segment's index is its rank by first layer.
#ifndef KVTIER_WORKER_ROUND_LAYOUT_H_
#define KVTIER_WORKER_ROUND_LAYOUT_H_

#include <cstdint>
#include <vector>

#include "worker/engine.h"

namespace kvtier::worker {

struct SegmentSpan {
  uint32_t index = 0;  // SegmentRef.segment.
  int begin = 0;       // Layers [begin, end).
  int end = 0;
  bool upper = false;  // Above L_w: fetched by recall.
  // Every layer slides: once a round has left all their windows (`window`,
  // the largest of them), no later query attends it there.
  bool windowed = false;
  int window = 0;
  int layers() const { return end - begin; }
};

// The most segments a round may have (SegmentRef.segment < 64).
inline constexpr size_t kMaxRoundSegments = 64;

// The segments of a round of `shape` with watershed layer `lw` (0 <= lw <
// layers), ascending by first layer, covering every layer once. Pure.
std::vector<SegmentSpan> RoundLayout(const ModelShape& shape, int lw);

// Whether a round ending at token position `round_end` (exclusive) has left
// a window of `window` tokens for every query at position `next` or later.
inline bool LeftWindow(int64_t round_end, int64_t next, int window) {
  return window > 0 && round_end <= next - window + 1;
}

}  // namespace kvtier::worker

#endif  // KVTIER_WORKER_ROUND_LAYOUT_H_
