// The host pool's eviction plan against a longhand: every candidate of a
// pass listed, sorted by (fetches, round, row, layer, head), taken in order.
#include "worker/host_pool.h"

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <tuple>

#include "gtest/gtest.h"

namespace kvtier::worker::pool {
namespace {

struct Pool {
  Cells cells;
  std::vector<std::vector<std::vector<std::vector<uint32_t>>>> fetches;
};

Pool RandomPool(std::mt19937* rng) {
  std::uniform_int_distribution<int> rounds(1, 4), layers(1, 4), heads(1, 3), len(0, 20),
      fetch(0, 3), bytes(10, 50);
  const int nr = rounds(*rng), nl = layers(*rng), nh = heads(*rng);
  Pool p;
  p.cells.assign(nr, std::vector<std::vector<Cell>>(nl, std::vector<Cell>(nh)));
  p.fetches.assign(nr, std::vector<std::vector<std::vector<uint32_t>>>(
                           nl, std::vector<std::vector<uint32_t>>(nh)));
  for (int r = 0; r < nr; ++r) {
    for (int l = 0; l < nl; ++l) {
      for (int h = 0; h < nh; ++h) {
        Cell& c = p.cells[r][l][h];
        c.len = len(*rng);
        // Integral row sizes: the sums are exact, as the longhand's are.
        c.row_bytes = bytes(*rng);
        auto& f = p.fetches[r][l][h];
        for (int64_t t = 0; t < c.len; ++t) f.push_back(static_cast<uint32_t>(fetch(*rng)));
        // Some cells were never gathered from: no counters at all.
        c.fetches = (r + l + h) % 3 == 0 ? nullptr : f.data();
      }
    }
  }
  return p;
}

// The longhand plan: the set of (round, layer, head, row) dropped.
std::set<std::tuple<size_t, size_t, size_t, int64_t>> Longhand(const Cells& cells, double excess) {
  std::set<std::tuple<size_t, size_t, size_t, int64_t>> gone;
  const size_t nr = cells.size(), nl = cells[0].size(), nh = cells[0][0].size();
  while (excess > 0) {
    // (fetches, round, row, layer, head)
    std::vector<std::tuple<uint32_t, size_t, int64_t, size_t, size_t>> cand;
    for (size_t l = 0; l < nl; ++l) {
      for (size_t h = 0; h < nh; ++h) {
        std::vector<std::pair<size_t, int64_t>> left;
        for (size_t r = 0; r < nr; ++r) {
          for (int64_t t = 0; t < cells[r][l][h].len; ++t) {
            if (gone.count({r, l, h, t}) == 0) left.emplace_back(r, t);
          }
        }
        // The older half, less each round's newest remaining row.
        std::map<size_t, int64_t> newest;
        for (auto [r, t] : left) newest[r] = t;
        left.resize(left.size() / 2);
        for (auto [r, t] : left) {
          if (newest[r] == t) continue;
          const Cell& c = cells[r][l][h];
          cand.emplace_back(c.fetches != nullptr ? c.fetches[t] : 0, r, t, l, h);
        }
      }
    }
    if (cand.empty()) break;
    std::sort(cand.begin(), cand.end());
    for (const auto& [f, r, t, l, h] : cand) {
      if (excess <= 0) break;
      gone.insert({r, l, h, t});
      excess -= cells[r][l][h].row_bytes;
    }
  }
  return gone;
}

std::set<std::tuple<size_t, size_t, size_t, int64_t>> Dropped(const Drops& d) {
  std::set<std::tuple<size_t, size_t, size_t, int64_t>> out;
  for (size_t r = 0; r < d.size(); ++r) {
    for (size_t l = 0; l < d[r].size(); ++l) {
      for (size_t h = 0; h < d[r][l].size(); ++h) {
        for (size_t t = 0; t < d[r][l][h].size(); ++t) {
          if (d[r][l][h][t] != 0) out.insert({r, l, h, static_cast<int64_t>(t)});
        }
      }
    }
  }
  return out;
}

TEST(HostPoolTest, PlanEqualsTheLonghandOnRandomPools) {
  std::mt19937 rng(5);
  int nonempty = 0, multipass = 0;
  for (int trial = 0; trial < 500; ++trial) {
    Pool p = RandomPool(&rng);
    double total = 0, older = 0;
    for (const auto& round : p.cells) {
      for (const auto& layer : round) {
        for (const Cell& c : layer) total += c.row_bytes * c.len;
      }
    }
    older = total / 4;
    // From nothing to more than the pool holds.
    const double excess = std::uniform_real_distribution<double>(0, total * 1.2)(rng);
    Drops drops;
    const uint64_t n = PlanEviction(p.cells, excess, &drops);
    const auto want = Longhand(p.cells, excess);
    ASSERT_EQ(Dropped(drops), want) << "trial " << trial;
    EXPECT_EQ(n, want.size());
    nonempty += !want.empty();
    multipass += excess > older * 2;
  }
  EXPECT_GT(nonempty, 300);
  EXPECT_GT(multipass, 100);
}

TEST(HostPoolTest, FewestFetchesFirstAmongTheOlderHalf) {
  // One layer, one head, two rounds of 4 rows: rows 0-3 are the older half.
  std::vector<uint32_t> f0 = {5, 0, 2, 1}, f1 = {0, 0, 0, 0};
  Cells cells(2, std::vector<std::vector<Cell>>(1, std::vector<Cell>(1)));
  cells[0][0][0] = {4, f0.data(), 10};
  cells[1][0][0] = {4, f1.data(), 10};
  Drops drops;
  // 25 bytes: rows 1 (0 fetches), 2 (2), 0 (5); row 3 is its round's newest
  // and stays, and so do the newer round's unfetched rows.
  EXPECT_EQ(PlanEviction(cells, 25, &drops), 3u);
  EXPECT_EQ(drops[0][0][0], (std::vector<char>{1, 1, 1, 0}));
  EXPECT_TRUE(drops[1][0][0].empty());
  // Far more than the pool: older halves until the older half holds only
  // rows that are their round's newest. Passes: 8 rows, the older half
  // r0[0-3] less r0[3]; then of r0[3] r1[0-3], r0[3] and r1[0] less r0[3];
  // then r1[1]; then the older half is r0[3] alone.
  drops.clear();
  EXPECT_EQ(PlanEviction(cells, 1e9, &drops), 5u);
  EXPECT_EQ(drops[0][0][0], (std::vector<char>{1, 1, 1, 0}));
  EXPECT_EQ(drops[1][0][0], (std::vector<char>{1, 1, 0, 0}));
}

TEST(HostPoolTest, NothingToDrop) {
  Cells cells(1, std::vector<std::vector<Cell>>(2, std::vector<Cell>(2)));
  Drops drops;
  EXPECT_EQ(PlanEviction(cells, 100, &drops), 0u);  // Empty cells.
  cells[0][1][1] = {1, nullptr, 10};
  EXPECT_EQ(PlanEviction(cells, 100, &drops), 0u);  // One row is never dropped.
  cells[0][1][1] = {2, nullptr, 10};
  EXPECT_EQ(PlanEviction(cells, 0, &drops), 0u);  // No excess.
}

}  // namespace
}  // namespace kvtier::worker::pool
