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
#include <utility>
#include <vector>

namespace prefixcache {

template <typename Key>
class KeyedHeap {
 public:
  explicit KeyedHeap(size_t num_blocks) : heap_(num_blocks), position_(num_blocks, -1) {}

  size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  bool contains(int32_t block_id) const noexcept { return position_[block_id] >= 0; }
  /// The key of tracked ``block_id``.
  const Key& key_of(int32_t block_id) const noexcept {
    return heap_[static_cast<size_t>(position_[block_id])].key;
  }

  /// Track ``block_id`` (untracked) under ``key``.
  void insert(int32_t block_id, const Key& key) noexcept {
    sift_up(size_++, Entry{key, block_id});
  }

  /// Stop tracking ``block_id`` (tracked).
  void remove(int32_t block_id) noexcept {
    const size_t at = static_cast<size_t>(position_[block_id]);
    position_[block_id] = -1;
    const size_t last = --size_;
    if (at == last) return;
    place(at, heap_[last]);
  }

  /// Give tracked ``block_id`` a new key.
  void rekey(int32_t block_id, const Key& key) noexcept {
    place(static_cast<size_t>(position_[block_id]), Entry{key, block_id});
  }

  /// The lowest (the heap must not be empty).
  int32_t top() const noexcept { return heap_[0].id; }

  /// Remove and return the lowest (the heap must not be empty).
  int32_t pop() noexcept {
    const int32_t block_id = heap_[0].id;
    position_[block_id] = -1;
    const size_t last = --size_;
    if (last > 0) sift_down(0, heap_[last]);
    return block_id;
  }

  /// Whether (key, block_id) would sort before every tracked entry.
  bool before_all(const Key& key, int32_t block_id) const noexcept {
    return empty() || less(Entry{key, block_id}, heap_[0]);
  }

  void clear() noexcept {
    for (size_t i = 0; i < size_; ++i) position_[heap_[i].id] = -1;
    size_ = 0;
  }

  /// Tracked block at heap slot ``i`` (i < size), for scans in no particular order.
  int32_t at(size_t i) const noexcept { return heap_[i].id; }

  size_t memory_bytes() const noexcept {
    return heap_.size() * (sizeof(Entry) + sizeof(int32_t));
  }

 private:
  // Keys live beside the IDs in the heap array, so a sift compares neighbouring entries
  // instead of reading each block's key from a second array (one cache miss a level).
  struct Entry {
    Key key;
    int32_t id;
  };

  static bool less(const Entry& a, const Entry& b) noexcept {
    return a.key < b.key || (!(b.key < a.key) && a.id < b.id);
  }

  // Put ``entry`` at slot ``at`` (a hole) and restore the heap order around it.
  void place(size_t at, const Entry& entry) noexcept {
    if (at > 0 && less(entry, heap_[(at - 1) / 2])) {
      sift_up(at, entry);
    } else {
      sift_down(at, entry);
    }
  }

  void sift_up(size_t at, Entry entry) noexcept {
    while (at > 0) {
      const size_t parent = (at - 1) / 2;
      if (!less(entry, heap_[parent])) break;
      heap_[at] = heap_[parent];
      position_[heap_[at].id] = static_cast<int32_t>(at);
      at = parent;
    }
    position_[entry.id] = static_cast<int32_t>(at);
    heap_[at] = std::move(entry);
  }

  void sift_down(size_t at, Entry entry) noexcept {
    for (;;) {
      size_t child = 2 * at + 1;
      if (child >= size_) break;
      if (child + 1 < size_ && less(heap_[child + 1], heap_[child])) ++child;
      if (!less(heap_[child], entry)) break;
      heap_[at] = heap_[child];
      position_[heap_[at].id] = static_cast<int32_t>(at);
      at = child;
    }
    position_[entry.id] = static_cast<int32_t>(at);
    heap_[at] = std::move(entry);
  }

  std::vector<Entry> heap_;        // tracked entries, heap-ordered; first size_ valid
  std::vector<int32_t> position_;  // each block's slot in heap_, or -1
  size_t size_ = 0;
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_POLICIES_KEYED_HEAP_H_
