#include "worker/round_layout.h"

#include <algorithm>

namespace kvtier::worker {

std::vector<SegmentSpan> RoundLayout(const ModelShape& shape, int lw) {
  std::vector<SegmentSpan> out;
  auto slides = [&](int l) { return l != lw && shape.layer_window(l) > 0; };
  for (int l = 0; l < shape.layers; ++l) {
    const bool upper = l > lw;
    if (out.empty() || out.back().upper != upper || out.back().windowed != slides(l)) {
      SegmentSpan s;
      s.index = static_cast<uint32_t>(out.size());
      s.begin = l;
      s.upper = upper;
      s.windowed = slides(l);
      out.push_back(s);
    }
    SegmentSpan& s = out.back();
    s.end = l + 1;
    if (s.windowed) s.window = std::max(s.window, shape.layer_window(l));
  }
  return out;
}

}  // namespace kvtier::worker
