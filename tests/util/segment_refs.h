// Segment references for tests that read whole rounds back.
#ifndef KVTIER_TESTS_UTIL_SEGMENT_REFS_H_
#define KVTIER_TESTS_UTIL_SEGMENT_REFS_H_

#include <cstdint>
#include <vector>

#include "kvtier/v1/store.pb.h"

namespace kvtier::testing {

// Segments 0 and 1 (lower and upper) of rounds [0, rounds), in order.
inline std::vector<v1::SegmentRef> BothSegments(uint32_t rounds) {
  std::vector<v1::SegmentRef> refs;
  for (uint32_t r = 0; r < rounds; ++r) {
    for (uint32_t g = 0; g < 2; ++g) {
      v1::SegmentRef ref;
      ref.set_round(r);
      ref.set_segment(g);
      refs.push_back(ref);
    }
  }
  return refs;
}

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_UTIL_SEGMENT_REFS_H_
