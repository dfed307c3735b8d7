// LinkedMap: an insertion-ordered map keyed by block hash, for ghost lists and histories.
//
// The native twin of policies/linked_map.py (no undo: native policies never abort): get,
// put (an existing key keeps its place, as with OrderedDict), erase, the oldest entry and
// its removal, iteration oldest first. Entries live in flat arrays linked in insertion
// order, found through an open-addressing HashIndex that doubles when half full. Keys are
// block hashes, never 0 (HashIndex's empty marker). Every method O(1) expected but
// iteration and growth. Not thread-safe.
#ifndef PREFIXCACHE_ENGINE_NATIVE_POLICIES_LINKED_MAP_H_
#define PREFIXCACHE_ENGINE_NATIVE_POLICIES_LINKED_MAP_H_

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "../hash_index.h"

namespace prefixcache {

template <typename V>
class LinkedMap {
 public:
  explicit LinkedMap(size_t expected = 16) : index_(expected) {}

  size_t size() const noexcept { return index_.size(); }
  bool empty() const noexcept { return index_.size() == 0; }
  bool contains(int64_t key) const noexcept { return index_.find(key) >= 0; }

  /// Start loading what get(key) reads first (HashIndex::prefetch).
  void prefetch(int64_t key) const noexcept { index_.prefetch(key); }

  /// The value of ``key``, or nullptr.
  V* get(int64_t key) noexcept {
    const int32_t slot = index_.find(key);
    return slot < 0 ? nullptr : &values_[static_cast<size_t>(slot)];
  }
  const V* get(int64_t key) const noexcept {
    const int32_t slot = index_.find(key);
    return slot < 0 ? nullptr : &values_[static_cast<size_t>(slot)];
  }

  /// Set ``key`` to ``value``: in place if present, else as the newest entry.
  void put(int64_t key, V value) {
    const int32_t found = index_.find(key);
    if (found >= 0) {
      values_[static_cast<size_t>(found)] = std::move(value);
      return;
    }
    if (2 * (index_.size() + 1) > index_.capacity()) grow();
    int32_t slot;
    if (free_.empty()) {
      slot = static_cast<int32_t>(keys_.size());
      keys_.push_back(key);
      values_.push_back(std::move(value));
      prev_.push_back(kNone);
      next_.push_back(kNone);
    } else {
      slot = free_.back();
      free_.pop_back();
      keys_[slot] = key;
      values_[slot] = std::move(value);
    }
    prev_[slot] = last_;
    next_[slot] = kNone;
    (last_ == kNone ? first_ : next_[last_]) = slot;
    last_ = slot;
    index_.insert(key, slot);
  }

  /// Remove ``key``; whether it was present.
  bool erase(int64_t key) noexcept {
    const int32_t slot = index_.find(key);
    if (slot < 0) return false;
    unlink(slot);
    return true;
  }

  /// The oldest key (the map must not be empty).
  int64_t oldest() const noexcept { return keys_[first_]; }
  V& oldest_value() noexcept { return values_[first_]; }

  /// Remove the oldest entry (the map must not be empty); its key.
  int64_t pop_oldest() noexcept {
    const int64_t key = keys_[first_];
    unlink(first_);
    return key;
  }

  void clear() noexcept {
    index_.clear();
    keys_.clear();
    values_.clear();
    prev_.clear();
    next_.clear();
    free_.clear();
    first_ = last_ = kNone;
  }

  /// Call ``visit(key, value)`` for each entry, oldest first.
  template <typename F>
  void for_each(F&& visit) const {
    for (int32_t slot = first_; slot != kNone; slot = next_[slot]) visit(keys_[slot], values_[slot]);
  }

  size_t memory_bytes() const noexcept {
    return index_.memory_bytes() + keys_.capacity() * (sizeof(int64_t) + sizeof(V)) +
           (prev_.capacity() + next_.capacity() + free_.capacity()) * sizeof(int32_t);
  }

 private:
  static constexpr int32_t kNone = -1;

  void unlink(int32_t slot) noexcept {
    index_.erase(keys_[slot]);
    const int32_t before = prev_[slot], after = next_[slot];
    (before == kNone ? first_ : next_[before]) = after;
    (after == kNone ? last_ : prev_[after]) = before;
    free_.push_back(slot);
  }

  void grow() {
    HashIndex bigger(index_.capacity());  // room for capacity entries at load 1/2
    for (int32_t slot = first_; slot != kNone; slot = next_[slot]) bigger.insert(keys_[slot], slot);
    index_ = std::move(bigger);
  }

  HashIndex index_;
  std::vector<int64_t> keys_;
  std::vector<V> values_;
  std::vector<int32_t> prev_, next_, free_;
  int32_t first_ = kNone, last_ = kNone;
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_POLICIES_LINKED_MAP_H_
