// LeafHeap: the cached leaves in eviction order, for the native lru and fifo.
//
// The Python policies order their leaves by (key, block ID) with the lowest
// first: lru's key is the leaf's last access (touches move it), fifo's the
// last access it had when it entered the cache (touches do not). Keys and IDs
// together are unique, so the next victim is one well-defined leaf whatever
// the heap's layout, which is what lets the differential test compare the IDs
// the two engines hand out. An indexed binary heap over flat arrays gives
// O(log n) insert, removal from the middle and re-keying with no allocation
// after construction; position -1 means "not tracked".

#ifndef PREFIXCACHE_ENGINE_NATIVE_LEAF_HEAP_H_
#define PREFIXCACHE_ENGINE_NATIVE_LEAF_HEAP_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace prefixcache {

class LeafHeap {
 public:
  explicit LeafHeap(size_t num_blocks)
      : heap_(num_blocks), key_(num_blocks, 0), position_(num_blocks, -1) {}

  size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  bool contains(int32_t block_id) const noexcept { return position_[block_id] >= 0; }
  int64_t key_of(int32_t block_id) const noexcept { return key_[block_id]; }

  /// Track ``block_id`` (untracked) under ``key``. Complexity: O(log n).
  void insert(int32_t block_id, int64_t key) noexcept {
    key_[block_id] = key;
    const size_t at = size_++;
    heap_[at] = block_id;
    position_[block_id] = static_cast<int32_t>(at);
    sift_up(at);
  }

  /// Stop tracking ``block_id`` (tracked). Complexity: O(log n).
  void remove(int32_t block_id) noexcept {
    const size_t at = static_cast<size_t>(position_[block_id]);
    position_[block_id] = -1;
    const size_t last = --size_;
    if (at == last) return;
    const int32_t moved = heap_[last];
    heap_[at] = moved;
    position_[moved] = static_cast<int32_t>(at);
    if (!sift_up(at)) sift_down(at);
  }

  /// Give tracked ``block_id`` a new key. Complexity: O(log n).
  void rekey(int32_t block_id, int64_t key) noexcept {
    key_[block_id] = key;
    const size_t at = static_cast<size_t>(position_[block_id]);
    if (!sift_up(at)) sift_down(at);
  }

  /// The next victim (the heap must not be empty). Complexity: O(1).
  int32_t top() const noexcept { return heap_[0]; }

  /// Remove and return the next victim. Complexity: O(log n).
  int32_t pop() noexcept {
    const int32_t block_id = heap_[0];
    remove(block_id);
    return block_id;
  }

  void clear() noexcept {
    for (size_t i = 0; i < size_; ++i) position_[heap_[i]] = -1;
    size_ = 0;
  }

  /// Tracked block at heap slot ``i`` (i < size), for checks.
  int32_t at(size_t i) const noexcept { return heap_[i]; }

  size_t memory_bytes() const noexcept {
    return heap_.size() * (sizeof(int32_t) * 2 + sizeof(int64_t));
  }

 private:
  bool less(int32_t a, int32_t b) const noexcept {
    return key_[a] < key_[b] || (key_[a] == key_[b] && a < b);
  }

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
  std::vector<int64_t> key_;       // each block's key (meaningful while tracked)
  std::vector<int32_t> position_;  // each block's slot in heap_, or -1
  size_t size_ = 0;
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_LEAF_HEAP_H_
