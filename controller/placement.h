// Weighted rendezvous (highest-random-weight) hashing: where a key goes
// among a set of nodes, deterministically, so that a controller that
// restarts computes the same answer, and a node that joins or leaves moves
// only about 1/N of the keys (the ones it wins or held).
//
// Each node's score for a key is -weight / ln(u), with u a hash of (key,
// node id) mapped into (0, 1); nodes are ranked by score. With equal
// weights every node is equally likely first; a node of weight 2w wins
// twice as often as one of weight w.
#ifndef KVTIER_CONTROLLER_PLACEMENT_H_
#define KVTIER_CONTROLLER_PLACEMENT_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvtier::controller {

struct Candidate {
  std::string_view id;
  double weight = 1.0;  // > 0; non-positive weights rank last.
};

// A 64-bit hash of (key, node id), stable across processes and versions.
uint64_t RendezvousHash(std::string_view key, std::string_view node_id);

// Indices of `nodes`, best first. Ties (equal scores) break by id.
std::vector<size_t> Rank(std::string_view key, const std::vector<Candidate>& nodes);

}  // namespace kvtier::controller

#endif  // KVTIER_CONTROLLER_PLACEMENT_H_
