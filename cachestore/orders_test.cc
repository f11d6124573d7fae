// SpillOrder and DropOrder against their specification, PlanSpill and
// PlanDrop (planner.h), on random workloads: after every change the orders
// must list exactly the candidates the planner would, in the planner's order.
#include "cachestore/orders.h"

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <vector>

#include "cachestore/planner.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::cachestore {
namespace {

struct Item {
  int id = 0;
  SpillKey key;
  uint64_t bytes = 0;
};

// The planner's full order over `items` (every candidate, as bytes_to_free
// is their total).
std::vector<int> PlannedSpill(const std::map<int, Item>& items, SpillPolicy policy) {
  std::vector<SpillCandidate> cands;
  std::vector<int> ids;
  uint64_t total = 0;
  for (const auto& [id, it] : items) {
    cands.push_back({it.bytes, it.key.insert_seq, it.key.last_access_seq, it.key.recall_count});
    ids.push_back(id);
    total += it.bytes;
  }
  std::vector<int> out;
  for (size_t i : PlanSpill(cands, total, policy)) out.push_back(ids[i]);
  return out;
}

std::vector<int> Walked(const SpillOrder<Item>& order) {
  std::vector<int> out;
  order.Walk([&](Item* it, const SpillKey&) {
    out.push_back(it->id);
    return true;
  });
  return out;
}

class SpillOrderTest : public ::testing::TestWithParam<SpillPolicy> {};

TEST_P(SpillOrderTest, EqualsThePlannerOnRandomWorkloads) {
  const SpillPolicy policy = GetParam();
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    std::mt19937_64 rng(seed);
    SpillOrder<Item> order(policy);
    std::map<int, Item> live;
    std::vector<std::unique_ptr<Item>> spilled;  // Out of the order, may come back.
    std::map<int, std::unique_ptr<Item>> storage;
    uint64_t seq = 1;
    int next_id = 0;
    for (int step = 0; step < 400; ++step) {
      const int op = static_cast<int>(rng() % 10);
      if (op == 0 && !spilled.empty()) {
        // A promotion: a spilled segment comes back with its old insertion.
        const size_t i = rng() % spilled.size();
        std::unique_ptr<Item> it = std::move(spilled[i]);
        spilled.erase(spilled.begin() + static_cast<long>(i));
        order.Insert(it.get(), it->key);
        live[it->id] = *it;
        storage[it->id] = std::move(it);
      } else if (op < 4 || live.empty()) {
        auto it = std::make_unique<Item>();
        it->id = next_id++;
        it->key.insert_seq = seq++;
        it->key.last_access_seq = it->key.insert_seq;
        it->key.recall_count = rng() % 4;
        it->bytes = 1 + rng() % 100;
        order.Insert(it.get(), it->key);
        live[it->id] = *it;
        storage[it->id] = std::move(it);
      } else if (op == 9) {
        // A spill, as the store does it: the first few in order, erased
        // under the keys the walk hands out.
        std::vector<std::pair<Item*, SpillKey>> front;
        order.Walk([&](Item* it, const SpillKey& k) {
          front.push_back({it, k});
          return front.size() < 1 + rng() % 3;
        });
        for (auto& [it, k] : front) {
          order.Erase(it, k);
          const int id = it->id;
          live.erase(id);
          spilled.push_back(std::move(storage[id]));
          storage.erase(id);
        }
      } else {
        auto pick = live.begin();
        std::advance(pick, static_cast<long>(rng() % live.size()));
        const int id = pick->first;
        Item* it = storage[id].get();
        if (op < 6) {  // Spilled (it may come back) or dropped.
          order.Erase(it, it->key);
          live.erase(pick);
          if (op == 4) spilled.push_back(std::move(storage[id]));
          storage.erase(id);
        } else {  // Read: accessed now, its round recalled (or not).
          const SpillKey from = it->key;
          it->key.last_access_seq = seq++;
          it->key.recall_count += rng() % 2;
          if (op < 8) {  // As the store reads: re-keyed in place.
            order.Rekey(it, from, it->key);
          } else {
            order.Erase(it, from);
            order.Insert(it, it->key);
          }
          pick->second = *it;
        }
      }
      ASSERT_EQ(order.size(), live.size());
      ASSERT_EQ(Walked(order), PlannedSpill(live, policy))
          << "seed " << seed << " step " << step << " items " << live.size();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, SpillOrderTest,
                         ::testing::Values(SpillPolicy::kCounter, SpillPolicy::kLru),
                         [](const auto& info) {
                           return info.param == SpillPolicy::kLru ? "Lru" : "Counter";
                         });

TEST(SpillOrder, WalkStopsWhenAsked) {
  SpillOrder<Item> order(SpillPolicy::kCounter);
  Item a{1, {1, 1, 0}, 10}, b{2, {2, 2, 0}, 10}, c{3, {3, 3, 0}, 10};
  for (Item* it : {&a, &b, &c}) order.Insert(it, it->key);
  std::vector<int> seen;
  order.Walk([&](Item* it, const SpillKey&) {
    seen.push_back(it->id);
    return seen.size() < 2;
  });
  EXPECT_THAT(seen, ::testing::ElementsAre(1, 2));
}

TEST(DropOrder, EqualsThePlannerOnRandomWorkloads) {
  std::mt19937_64 rng(7);
  DropOrder<Item> order;
  std::map<int, Item> live;
  std::map<int, std::unique_ptr<Item>> storage;
  uint64_t seq = 1;
  for (int step = 0; step < 2000; ++step) {
    const int op = static_cast<int>(rng() % 3);
    if (op == 0 || live.empty()) {
      auto it = std::make_unique<Item>();
      it->id = static_cast<int>(seq);
      it->key.insert_seq = seq++;
      it->key.recall_count = rng() % 3;
      it->bytes = 1 + rng() % 1000;
      order.Insert(it.get(), it->key.recall_count, it->key.insert_seq, it->bytes);
      live[it->id] = *it;
      storage[it->id] = std::move(it);
    } else {
      auto pick = live.begin();
      std::advance(pick, static_cast<long>(rng() % live.size()));
      Item* it = storage[pick->first].get();
      order.Erase(it, it->key.recall_count, it->key.insert_seq, it->bytes);
      if (op == 1) {
        const int id = it->id;
        live.erase(pick);
        storage.erase(id);
      } else {
        ++it->key.recall_count;
        order.Insert(it, it->key.recall_count, it->key.insert_seq, it->bytes);
        pick->second = *it;
      }
    }
    std::vector<DropCandidate> cands;
    std::vector<int> ids;
    uint64_t total = 0;
    for (const auto& [id, it] : live) {
      cands.push_back({it.bytes, it.key.insert_seq, it.key.recall_count});
      ids.push_back(id);
      total += it.bytes;
    }
    ASSERT_EQ(order.bytes(), total);
    std::vector<int> planned;
    const std::optional<std::vector<size_t>> plan = PlanDrop(cands, total);
    ASSERT_TRUE(plan.has_value());
    for (size_t i : *plan) planned.push_back(ids[i]);
    std::vector<int> walked;
    order.Walk([&](Item* it) {
      walked.push_back(it->id);
      return true;
    });
    ASSERT_EQ(walked, planned) << "step " << step;
  }
}

}  // namespace
}  // namespace kvtier::cachestore
