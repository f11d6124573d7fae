#include "cachestore/planner.h"

#include <algorithm>
#include <numeric>
#include <tuple>

namespace kvtier::cachestore {
namespace {

std::vector<size_t> Iota(size_t n) {
  std::vector<size_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

// The prefix of `order` whose bytes first reach `bytes_to_free` (all of it
// if they never do), and the bytes it frees.
template <typename Candidate>
std::pair<std::vector<size_t>, uint64_t> TakeUntil(const std::vector<size_t>& order,
                                                   const std::vector<Candidate>& c,
                                                   uint64_t bytes_to_free) {
  std::vector<size_t> out;
  uint64_t freed = 0;
  for (size_t i : order) {
    if (freed >= bytes_to_free) break;
    out.push_back(i);
    freed += c[i].bytes;
  }
  return {std::move(out), freed};
}

}  // namespace

std::vector<size_t> PlanSpill(const std::vector<SpillCandidate>& c, uint64_t bytes_to_free,
                              SpillPolicy policy) {
  std::vector<size_t> order = Iota(c.size());
  if (policy == SpillPolicy::kLru) {
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return std::tie(c[a].last_access_seq, c[a].insert_seq) <
             std::tie(c[b].last_access_seq, c[b].insert_seq);
    });
  } else {
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return c[a].insert_seq < c[b].insert_seq; });
    auto by_count = [&](size_t a, size_t b) {
      return std::tie(c[a].recall_count, c[a].insert_seq) <
             std::tie(c[b].recall_count, c[b].insert_seq);
    };
    auto mid = order.begin() + static_cast<std::ptrdiff_t>((order.size() + 1) / 2);
    std::sort(order.begin(), mid, by_count);
    std::sort(mid, order.end(), by_count);
  }
  return TakeUntil(order, c, bytes_to_free).first;
}

std::optional<std::vector<size_t>> PlanDrop(const std::vector<DropCandidate>& c,
                                            uint64_t bytes_to_free) {
  std::vector<size_t> order = Iota(c.size());
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::tie(c[a].recall_count, c[a].insert_seq) <
           std::tie(c[b].recall_count, c[b].insert_seq);
  });
  auto [out, freed] = TakeUntil(order, c, bytes_to_free);
  if (freed < bytes_to_free) return std::nullopt;
  return out;
}

}  // namespace kvtier::cachestore
