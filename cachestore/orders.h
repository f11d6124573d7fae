// The store's spill and drop orders, kept up to date as entries change, so
// that choosing what to spill or drop costs O(k log n) for the k entries
// chosen instead of a walk and a sort over all n stored ones.
//
// SpillOrder<T> yields RAM-resident segments in exactly the order PlanSpill
// gives for the same candidates, DropOrder<T> droppable rounds in exactly the
// order PlanDrop gives (planner.h is the specification; orders_test.cc checks
// both on random workloads). Neither locks nor owns: the caller (Store)
// erases an entry under the key it was inserted with before changing any
// field the key holds, and inserts it again afterwards.
#ifndef KVTIER_CACHESTORE_ORDERS_H_
#define KVTIER_CACHESTORE_ORDERS_H_

#include <cstddef>
#include <cstdint>
#include <tuple>

#include "absl/container/btree_map.h"
#include "absl/container/btree_set.h"
#include "cachestore/planner.h"

namespace kvtier::cachestore {

struct SpillKey {
  uint64_t insert_seq = 0;       // Unique per entry.
  uint64_t last_access_seq = 0;  // Read by kLru only.
  uint64_t recall_count = 0;     // Read by kCounter only.
};

template <typename T>
class SpillOrder {
 public:
  explicit SpillOrder(SpillPolicy policy) : policy_(policy) {}

  void Insert(T* item, const SpillKey& k) {
    if (policy_ == SpillPolicy::kLru) {
      lru_.insert({k.last_access_seq, k.insert_seq, item});
      return;
    }
    // The older half takes it when it is older than the older half's
    // youngest; Rebalance restores the sizes.
    const bool older = !old_.by_seq.empty() && k.insert_seq < old_.by_seq.rbegin()->first.first;
    (older || old_.by_seq.empty() ? old_ : young_).Insert(item, k.insert_seq, k.recall_count);
    Rebalance();
  }

  void Erase(T* item, const SpillKey& k) {
    if (policy_ == SpillPolicy::kLru) {
      lru_.erase({k.last_access_seq, k.insert_seq, item});
      return;
    }
    const bool older = !old_.by_seq.empty() && k.insert_seq <= old_.by_seq.rbegin()->first.first;
    (older ? old_ : young_).Erase(item, k.insert_seq, k.recall_count);
    Rebalance();
  }

  // Erase(item, from) then Insert(item, to), for a key whose insert_seq
  // stays (a recall or an access): the halves keep their members then, so
  // only the entry's own place moves (three tree operations at most instead
  // of twelve with the rebalancing).
  void Rekey(T* item, const SpillKey& from, const SpillKey& to) {
    if (from.insert_seq != to.insert_seq) {
      Erase(item, from);
      Insert(item, to);
      return;
    }
    if (policy_ == SpillPolicy::kLru) {
      if (from.last_access_seq == to.last_access_seq) return;
      lru_.erase({from.last_access_seq, from.insert_seq, item});
      lru_.insert({to.last_access_seq, to.insert_seq, item});
      return;
    }
    if (from.recall_count == to.recall_count) return;
    const bool older = !old_.by_seq.empty() && from.insert_seq <= old_.by_seq.rbegin()->first.first;
    Half& h = older ? old_ : young_;
    h.by_seq.find({from.insert_seq, item})->second = to.recall_count;
    h.by_count.erase({from.recall_count, from.insert_seq, item});
    h.by_count.insert({to.recall_count, to.insert_seq, item});
  }

  size_t size() const {
    return policy_ == SpillPolicy::kLru ? lru_.size() : old_.by_seq.size() + young_.by_seq.size();
  }

  // Calls fn(item, key) in spill order until it returns false. The key
  // holds the fields this policy orders by, enough to Erase the item.
  template <typename Fn>
  void Walk(Fn fn) const {
    if (policy_ == SpillPolicy::kLru) {
      for (const auto& [access, insert, item] : lru_) {
        if (!fn(item, SpillKey{insert, access, 0})) return;
      }
      return;
    }
    for (const Half* h : {&old_, &young_}) {
      for (const auto& [count, insert, item] : h->by_count) {
        if (!fn(item, SpillKey{insert, 0, count})) return;
      }
    }
  }

 private:
  // One half of the counter policy's entries, by insertion (with each
  // entry's recall count, for moves between halves) and by (recall count,
  // insertion).
  struct Half {
    absl::btree_map<std::pair<uint64_t, T*>, uint64_t> by_seq;
    absl::btree_set<std::tuple<uint64_t, uint64_t, T*>> by_count;
    void Insert(T* item, uint64_t seq, uint64_t count) {
      by_seq.insert({{seq, item}, count});
      by_count.insert({count, seq, item});
    }
    void Erase(T* item, uint64_t seq, uint64_t count) {
      by_seq.erase({seq, item});
      by_count.erase({count, seq, item});
    }
  };

  // Keeps the older half at ceil(n / 2) entries, as PlanSpill splits them.
  void Rebalance() {
    const size_t n = old_.by_seq.size() + young_.by_seq.size();
    while (old_.by_seq.size() > (n + 1) / 2) Move(old_, young_, *std::prev(old_.by_seq.end()));
    while (old_.by_seq.size() < (n + 1) / 2) Move(young_, old_, *young_.by_seq.begin());
  }
  static void Move(Half& from, Half& to, std::pair<std::pair<uint64_t, T*>, uint64_t> entry) {
    const auto [key, count] = entry;
    from.Erase(key.second, key.first, count);
    to.Insert(key.second, key.first, count);
  }

  const SpillPolicy policy_;
  absl::btree_set<std::tuple<uint64_t, uint64_t, T*>> lru_;  // (access, insert, item)
  Half old_;
  Half young_;
};

// Rounds that may be dropped for disk room, never-recalled first, then by
// fewest recalls, oldest first within a count; and the bytes they hold.
template <typename T>
class DropOrder {
 public:
  void Insert(T* item, uint64_t recall_count, uint64_t insert_seq, uint64_t bytes) {
    if (set_.insert({recall_count, insert_seq, item}).second) bytes_ += bytes;
  }
  void Erase(T* item, uint64_t recall_count, uint64_t insert_seq, uint64_t bytes) {
    if (set_.erase({recall_count, insert_seq, item}) != 0) bytes_ -= bytes;
  }
  uint64_t bytes() const { return bytes_; }
  size_t size() const { return set_.size(); }

  // Calls fn(item) in drop order until it returns false.
  template <typename Fn>
  void Walk(Fn fn) const {
    for (const auto& [count, seq, item] : set_) {
      if (!fn(item)) return;
    }
  }

 private:
  absl::btree_set<std::tuple<uint64_t, uint64_t, T*>> set_;
  uint64_t bytes_ = 0;
};

}  // namespace kvtier::cachestore

#endif  // KVTIER_CACHESTORE_ORDERS_H_
