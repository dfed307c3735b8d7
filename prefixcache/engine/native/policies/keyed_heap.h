// KeyedHeap: tracked block IDs ordered by (Key, block ID), lowest first.
//
// An indexed binary heap over flat arrays for any totally ordered Key (a clock value, a
// (clock, sequence) pair, a (priority, clock) pair...), the native stand-in for the
// Python policies' SortedList of keys when only the lowest key is ever taken: O(log n)
// insert, removal from the middle, re-keying and pop, no allocation after construction.
// Keys with the block ID are unique, so the order is one well-defined sequence whatever
// the heap's layout. Position -1 means "not tracked". Not thread-safe.
#ifndef PREFIXCACHE_ENGINE_NATIVE_POLICIES_KEYED_HEAP_H_
#define PREFIXCACHE_ENGINE_NATIVE_POLICIES_KEYED_HEAP_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace prefixcache {

template <typename Key>
class KeyedHeap {
 public:
  explicit KeyedHeap(size_t num_blocks)
      : heap_(num_blocks), key_(num_blocks), position_(num_blocks, -1) {}

  size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  bool contains(int32_t block_id) const noexcept { return position_[block_id] >= 0; }
  const Key& key_of(int32_t block_id) const noexcept { return key_[block_id]; }

  /// Track ``block_id`` (untracked) under ``key``.
  void insert(int32_t block_id, const Key& key) noexcept {
    key_[block_id] = key;
    const size_t at = size_++;
    heap_[at] = block_id;
    position_[block_id] = static_cast<int32_t>(at);
    sift_up(at);
  }

  /// Stop tracking ``block_id`` (tracked).
  void remove(int32_t block_id) noexcept {
    const size_t at = static_cast<size_t>(position_[block_id]);
    position_[block_id] = -1;
    const size_t last = --size_;
    if (at == last) return;
    heap_[at] = heap_[last];
    position_[heap_[at]] = static_cast<int32_t>(at);
    if (!sift_up(at)) sift_down(at);
  }

  /// Give tracked ``block_id`` a new key.
  void rekey(int32_t block_id, const Key& key) noexcept {
    key_[block_id] = key;
    const size_t at = static_cast<size_t>(position_[block_id]);
    if (!sift_up(at)) sift_down(at);
  }

  /// The lowest (the heap must not be empty).
  int32_t top() const noexcept { return heap_[0]; }

  /// Remove and return the lowest (the heap must not be empty).
  int32_t pop() noexcept {
    const int32_t block_id = heap_[0];
    remove(block_id);
    return block_id;
  }

  /// Whether (key, block_id) would sort before every tracked entry.
  bool before_all(const Key& key, int32_t block_id) const noexcept {
    return empty() || less(key, block_id, key_[heap_[0]], heap_[0]);
  }

  void clear() noexcept {
    for (size_t i = 0; i < size_; ++i) position_[heap_[i]] = -1;
    size_ = 0;
  }

  /// Tracked block at heap slot ``i`` (i < size), for scans in no particular order.
  int32_t at(size_t i) const noexcept { return heap_[i]; }

  size_t memory_bytes() const noexcept {
    return heap_.size() * (2 * sizeof(int32_t) + sizeof(Key));
  }

 private:
  static bool less(const Key& a, int32_t a_id, const Key& b, int32_t b_id) noexcept {
    return a < b || (!(b < a) && a_id < b_id);
  }
  bool less(int32_t a, int32_t b) const noexcept { return less(key_[a], a, key_[b], b); }

  bool sift_up(size_t at) noexcept {
    const int32_t block_id = heap_[at];
    const size_t start = at;
    while (at > 0) {
      const size_t parent = (at - 1) / 2;
      if (!less(block_id, heap_[parent])) break;
      heap_[at] = heap_[parent];
      position_[heap_[at]] = static_cast<int32_t>(at);
      at = parent;
    }
    heap_[at] = block_id;
    position_[block_id] = static_cast<int32_t>(at);
    return at != start;
  }

  void sift_down(size_t at) noexcept {
    const int32_t block_id = heap_[at];
    for (;;) {
      size_t child = 2 * at + 1;
      if (child >= size_) break;
      if (child + 1 < size_ && less(heap_[child + 1], heap_[child])) ++child;
      if (!less(heap_[child], block_id)) break;
      heap_[at] = heap_[child];
      position_[heap_[at]] = static_cast<int32_t>(at);
      at = child;
    }
    heap_[at] = block_id;
    position_[block_id] = static_cast<int32_t>(at);
  }

  std::vector<int32_t> heap_;      // tracked block IDs, heap-ordered; first size_ valid
  std::vector<Key> key_;           // each block's key (meaningful while tracked)
  std::vector<int32_t> position_;  // each block's slot in heap_, or -1
  size_t size_ = 0;
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_POLICIES_KEYED_HEAP_H_
