// HazardClassHeaps: hazard's leaves in one min-heap per class, keyed (last access, -depth,
// block ID) as policies/hazard.py's heap keys, lowest first.
//
// A leaf is in one class at a time, so one position array by block ID serves all heaps.
// Keys live in the heap entries themselves (sifts compare neighbours, not keys found
// through the block ID), and the last access of each class's top sits in one small array
// with a bit mask of the non-empty classes: hazard's eviction scans the tops of all
// classes, and this keeps that scan in a few cache lines. Not thread-safe.
#ifndef PREFIXCACHE_ENGINE_NATIVE_POLICIES_HAZARD_HEAPS_H_
#define PREFIXCACHE_ENGINE_NATIVE_POLICIES_HAZARD_HEAPS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace prefixcache {

template <int kNumClasses>
class HazardClassHeaps {
  static_assert(kNumClasses <= 32, "the non-empty classes are one 32-bit mask");

 public:
  struct Entry {
    int64_t last_access;
    int64_t neg_depth;
    int32_t block_id;
    bool operator<(const Entry& other) const noexcept {
      if (last_access != other.last_access) return last_access < other.last_access;
      if (neg_depth != other.neg_depth) return neg_depth < other.neg_depth;
      return block_id < other.block_id;
    }
  };

  explicit HazardClassHeaps(size_t num_blocks) : position_(num_blocks, -1), class_(num_blocks, 0) {}

  size_t size() const noexcept { return size_; }
  bool contains(int32_t block_id) const noexcept { return position_[block_id] >= 0; }
  /// Bit c set: class c holds a leaf.
  uint32_t non_empty() const noexcept { return non_empty_; }
  /// The lowest entry of ``klass`` (which must not be empty), and its last access.
  const Entry& top(int klass) const noexcept { return heaps_[klass][0]; }
  int64_t top_access(int klass) const noexcept { return top_access_[klass]; }

  void insert(int32_t block_id, int klass, int64_t last_access, int64_t depth) {
    std::vector<Entry>& heap = heaps_[klass];
    class_[block_id] = static_cast<int8_t>(klass);
    heap.push_back(Entry{last_access, -depth, block_id});
    sift_up(heap, heap.size() - 1);
    ++size_;
    retop(klass);
  }

  void remove(int32_t block_id) noexcept {
    const int klass = class_[block_id];
    std::vector<Entry>& heap = heaps_[klass];
    const size_t at = static_cast<size_t>(position_[block_id]);
    position_[block_id] = -1;
    --size_;
    const Entry last = heap.back();
    heap.pop_back();
    if (at < heap.size()) {
      heap[at] = last;
      if (!sift_up(heap, at)) sift_down(heap, at);
    }
    retop(klass);
  }

  void clear() noexcept {
    for (std::vector<Entry>& heap : heaps_) {
      for (const Entry& entry : heap) position_[entry.block_id] = -1;
      heap.clear();
    }
    non_empty_ = 0;
    size_ = 0;
  }

  size_t memory_bytes() const noexcept {
    size_t bytes = position_.capacity() * sizeof(int32_t) + class_.capacity() * sizeof(int8_t);
    for (const std::vector<Entry>& heap : heaps_) bytes += heap.capacity() * sizeof(Entry);
    return bytes;
  }

 private:
  void retop(int klass) noexcept {
    const std::vector<Entry>& heap = heaps_[klass];
    if (heap.empty()) {
      non_empty_ &= ~(uint32_t{1} << klass);
    } else {
      non_empty_ |= uint32_t{1} << klass;
      top_access_[klass] = heap[0].last_access;
    }
  }

  bool sift_up(std::vector<Entry>& heap, size_t at) noexcept {
    const Entry entry = heap[at];
    const size_t start = at;
    while (at > 0) {
      const size_t parent = (at - 1) / 2;
      if (!(entry < heap[parent])) break;
      heap[at] = heap[parent];
      position_[heap[at].block_id] = static_cast<int32_t>(at);
      at = parent;
    }
    heap[at] = entry;
    position_[entry.block_id] = static_cast<int32_t>(at);
    return at != start;
  }

  void sift_down(std::vector<Entry>& heap, size_t at) noexcept {
    const Entry entry = heap[at];
    for (;;) {
      size_t child = 2 * at + 1;
      if (child >= heap.size()) break;
      if (child + 1 < heap.size() && heap[child + 1] < heap[child]) ++child;
      if (!(heap[child] < entry)) break;
      heap[at] = heap[child];
      position_[heap[at].block_id] = static_cast<int32_t>(at);
      at = child;
    }
    heap[at] = entry;
    position_[entry.block_id] = static_cast<int32_t>(at);
  }

  std::vector<int32_t> position_;  // by block ID: index in its class's heap; -1: not tracked
  std::vector<int8_t> class_;      // by block ID: its class while tracked
  std::vector<Entry> heaps_[kNumClasses];
  int64_t top_access_[kNumClasses] = {};  // last access of each non-empty class's top
  uint32_t non_empty_ = 0;
  size_t size_ = 0;
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_POLICIES_HAZARD_HEAPS_H_
