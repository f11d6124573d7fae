// The host pool of a speculating session (InfiniGen's memory cap,
// docs/speculation.md): which tokens leave a pool that is above its cap.
// Private to worker/ (session.cc's TrimPool).
#ifndef KVTIER_WORKER_HOST_POOL_H_
#define KVTIER_WORKER_HOST_POOL_H_

#include <cstdint>
#include <vector>

namespace kvtier::worker::pool {

// One KV head of one layer of one resident past round, as the planner sees
// it: `len` rows (0: not in the pool), each row's fetch count (null: all
// zero) and what one row costs (its share of the encoded K and V).
struct Cell {
  int64_t len = 0;
  const uint32_t* fetches = nullptr;
  double row_bytes = 0;
};

// cells[r][l][h]: past round r (oldest first), layer l, KV head h; every
// round has the same layer and head counts.
using Cells = std::vector<std::vector<std::vector<Cell>>>;
// drop[r][l][h][t] != 0: row t of that cell leaves the pool. A cell with no
// dropped row may be left empty.
using Drops = std::vector<std::vector<std::vector<std::vector<char>>>>;

// Picks rows to drop until their bytes reach `excess` (or nothing is left
// to drop). A pass considers each layer and head's older half: the first
// floor(n / 2) of its n remaining rows in (round, row) order, less each
// cell's newest remaining row (a cell keeps at least one row: an encoded
// tensor holds at least one token). Among
// all layers' and heads' older halves it drops the fewest fetches first,
// ties broken by (round, row, layer, head), the oldest first. A pass that
// drops every candidate and still falls short is followed by another over
// what remains. Marks `drops` (sized to match `cells`; rows already marked
// count as gone) and returns the rows dropped.
uint64_t PlanEviction(const Cells& cells, double excess, Drops* drops);

}  // namespace kvtier::worker::pool

#endif  // KVTIER_WORKER_HOST_POOL_H_
