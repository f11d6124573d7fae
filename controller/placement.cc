#include "controller/placement.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kvtier::controller {
namespace {

uint64_t Fnv1a(uint64_t h, std::string_view s) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

// splitmix64's finalizer: spreads FNV's weak low bits over the word.
uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

}  // namespace

uint64_t RendezvousHash(std::string_view key, std::string_view node_id) {
  uint64_t h = Fnv1a(0xcbf29ce484222325ull, key);
  h = Fnv1a(h ^ 0xff, node_id);  // A separator no name byte can fake.
  return Mix(h);
}

std::vector<size_t> Rank(std::string_view key, const std::vector<Candidate>& nodes) {
  std::vector<double> score(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    // u in (0, 1): the top 53 bits, offset by half a step so never 0 or 1.
    const double u =
        (static_cast<double>(RendezvousHash(key, nodes[i].id) >> 11) + 0.5) * 0x1.0p-53;
    score[i] = nodes[i].weight > 0 ? -nodes[i].weight / std::log(u) : -1.0;
  }
  std::vector<size_t> order(nodes.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (score[a] != score[b]) return score[a] > score[b];
    return nodes[a].id < nodes[b].id;
  });
  return order;
}

}  // namespace kvtier::controller
