// StableMap<V, N>: the store index's map from a round or segment number to
// its entry, ordered by key, whose values never move once inserted (the
// spill and drop orders hold pointers to them). std::map gives both, at 32
// bytes of tree links per entry plus its 48-byte header; this keeps a sorted
// array of pointers, inline for up to N entries (a round's two segments), and
// allocates each entry alone. At a million segments that is the difference
// between 258 and under 200 bytes of index per segment.
//
// The interface is std::map's, as far as the store uses it. Insertion and
// erase are O(n) moves of pointers (rounds arrive in order, so insertion is
// an append in practice); lookup is a binary search. Unlike std::map's, an
// insert or erase invalidates iterators (not references) to other entries.
#ifndef KVTIER_CACHESTORE_STABLE_MAP_H_
#define KVTIER_CACHESTORE_STABLE_MAP_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"

namespace kvtier::cachestore {

template <typename V, size_t N>
class StableMap {
 public:
  using key_type = uint32_t;
  using mapped_type = V;
  using value_type = std::pair<const uint32_t, V>;

 private:
  using Slots =
      std::conditional_t<N == 0, std::vector<std::unique_ptr<value_type>>,
                         absl::InlinedVector<std::unique_ptr<value_type>, (N > 0 ? N : 1)>>;

  template <typename Base, typename T>
  class Iter {
   public:
    using iterator_category = std::bidirectional_iterator_tag;
    using value_type = T;
    using difference_type = std::ptrdiff_t;
    using pointer = T*;
    using reference = T&;
    Iter() = default;
    explicit Iter(Base it) : it_(it) {}
    // iterator -> const_iterator.
    template <typename B2, typename T2,
              typename = std::enable_if_t<std::is_convertible_v<B2, Base>>>
    Iter(const Iter<B2, T2>& o) : it_(o.base()) {}  // NOLINT: implicit, as std::map's.
    T& operator*() const { return **it_; }
    T* operator->() const { return it_->get(); }
    Iter& operator++() {
      ++it_;
      return *this;
    }
    Iter operator++(int) { return Iter(it_++); }
    Iter& operator--() {
      --it_;
      return *this;
    }
    Iter operator--(int) { return Iter(it_--); }
    friend bool operator==(const Iter& a, const Iter& b) { return a.it_ == b.it_; }
    Base base() const { return it_; }

   private:
    Base it_{};
  };

 public:
  using iterator = Iter<typename Slots::iterator, value_type>;
  using const_iterator = Iter<typename Slots::const_iterator, const value_type>;
  using reverse_iterator = std::reverse_iterator<iterator>;
  using const_reverse_iterator = std::reverse_iterator<const_iterator>;

  iterator begin() { return iterator(slots_.begin()); }
  iterator end() { return iterator(slots_.end()); }
  const_iterator begin() const { return const_iterator(slots_.begin()); }
  const_iterator end() const { return const_iterator(slots_.end()); }
  reverse_iterator rbegin() { return reverse_iterator(end()); }
  reverse_iterator rend() { return reverse_iterator(begin()); }
  const_reverse_iterator rbegin() const { return const_reverse_iterator(end()); }
  const_reverse_iterator rend() const { return const_reverse_iterator(begin()); }

  size_t size() const { return slots_.size(); }
  bool empty() const { return slots_.empty(); }

  iterator find(uint32_t k) {
    auto it = LowerBound(k);
    return it != slots_.end() && (*it)->first == k ? iterator(it) : end();
  }
  const_iterator find(uint32_t k) const {
    auto it = std::lower_bound(slots_.begin(), slots_.end(), k,
                               [](const auto& p, uint32_t key) { return p->first < key; });
    return it != slots_.end() && (*it)->first == k ? const_iterator(it) : end();
  }
  size_t count(uint32_t k) const { return find(k) == end() ? 0 : 1; }

  // The entry for k, value-initialized when absent.
  V& operator[](uint32_t k) {
    auto it = LowerBound(k);
    if (it != slots_.end() && (*it)->first == k) return (*it)->second;
    it = slots_.insert(
        it, std::make_unique<value_type>(std::piecewise_construct, std::forward_as_tuple(k),
                                         std::forward_as_tuple()));
    return (*it)->second;
  }

  // The entry after the erased one.
  iterator erase(iterator pos) { return iterator(slots_.erase(pos.base())); }
  size_t erase(uint32_t k) {
    auto it = find(k);
    if (it == end()) return 0;
    erase(it);
    return 1;
  }
  void clear() { slots_.clear(); }

 private:
  typename Slots::iterator LowerBound(uint32_t k) {
    return std::lower_bound(slots_.begin(), slots_.end(), k,
                            [](const auto& p, uint32_t key) { return p->first < key; });
  }

  Slots slots_;
};

}  // namespace kvtier::cachestore

#endif  // KVTIER_CACHESTORE_STABLE_MAP_H_
