// FreeSet: the native engine's lowest-first free list (AllocatorConfig.free_list="lowest").
//
// A hierarchical bitset over block IDs: level 0 has one bit per block (set:
// free), each higher level one bit per 64-bit word of the level below (set:
// that word is not zero). The lowest free ID is found by descending from the
// single top word with count-trailing-zeros, and inserting or removing an ID
// updates at most one word per level: O(log_64 n) per operation, no
// allocation after construction. The order it hands IDs out in (the lowest
// first) is the Python engine's SortedFreeList with page_size 1
// (prefixcache/engine/free_list.py), which the differential test checks.

#ifndef PREFIXCACHE_ENGINE_NATIVE_FREE_SET_H_
#define PREFIXCACHE_ENGINE_NATIVE_FREE_SET_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace prefixcache {

class FreeSet {
 public:
  explicit FreeSet(size_t num_ids) {
    size_t words = num_ids / 64 + 1;
    for (;;) {
      levels_.emplace_back(words, 0);
      if (words == 1) break;
      words = (words + 63) / 64;
    }
  }

  size_t size() const noexcept { return size_; }
  bool contains(int32_t id) const noexcept {
    return (levels_[0][static_cast<size_t>(id) >> 6] >> (id & 63)) & 1u;
  }

  /// Mark ``id`` (not free) free. Complexity: O(levels).
  void insert(int32_t id) noexcept {
    size_t at = static_cast<size_t>(id);
    for (std::vector<uint64_t>& level : levels_) {
      const bool was_empty = level[at >> 6] == 0;
      level[at >> 6] |= uint64_t{1} << (at & 63);
      if (!was_empty) break;
      at >>= 6;
    }
    ++size_;
  }

  /// Mark ``id`` (free) taken. Complexity: O(levels).
  void erase(int32_t id) noexcept {
    size_t at = static_cast<size_t>(id);
    for (std::vector<uint64_t>& level : levels_) {
      level[at >> 6] &= ~(uint64_t{1} << (at & 63));
      if (level[at >> 6] != 0) break;
      at >>= 6;
    }
    --size_;
  }

  /// The lowest free ID (the set must not be empty). Complexity: O(levels).
  int32_t lowest() const noexcept {
    size_t at = 0;
    for (size_t l = levels_.size(); l-- > 0;) {
      at = (at << 6) | static_cast<size_t>(__builtin_ctzll(levels_[l][at]));
    }
    return static_cast<int32_t>(at);
  }

  /// Take and return the lowest free ID (the set must not be empty).
  int32_t pop_lowest() noexcept {
    const int32_t id = lowest();
    erase(id);
    return id;
  }

  void clear() noexcept {
    for (std::vector<uint64_t>& level : levels_) std::fill(level.begin(), level.end(), 0);
    size_ = 0;
  }

  /// Every free ID, descending (the next to go out last), into ``out``. O(n / 64 + size).
  void descending(std::vector<int32_t>& out) const {
    out.clear();
    const std::vector<uint64_t>& bits = levels_[0];
    for (size_t w = bits.size(); w-- > 0;) {
      uint64_t word = bits[w];
      while (word) {
        const int top = 63 - __builtin_clzll(word);
        out.push_back(static_cast<int32_t>(w * 64 + static_cast<size_t>(top)));
        word &= ~(uint64_t{1} << top);
      }
    }
  }

  size_t memory_bytes() const noexcept {
    size_t bytes = 0;
    for (const std::vector<uint64_t>& level : levels_) bytes += level.size() * 8;
    return bytes;
  }

 private:
  std::vector<std::vector<uint64_t>> levels_;  // levels_[0]: one bit per ID
  size_t size_ = 0;
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_FREE_SET_H_
