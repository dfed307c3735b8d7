// FreeSet and LowestFreeList: the native engine's lowest-first free list
// (AllocatorConfig.free_list="lowest", page_size_blocks).
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

// LowestFreeList: the lowest-first free list with pages of page_size blocks, in the order
// of the Python engine's SortedFreeList (prefixcache/engine/free_list.py): a request of
// n blocks takes n / page_size whole free pages (lowest first, each ascending), then the
// lowest free blocks of partly used pages, then breaks the lowest whole pages. A short
// last page never counts as whole. With page_size 1 it is one FreeSet of blocks.
class LowestFreeList {
 public:
  LowestFreeList(size_t num_ids, int32_t page_size)
      : num_ids_(num_ids),
        page_size_(page_size),
        num_pages_(page_size > 1 ? (num_ids + static_cast<size_t>(page_size) - 1) /
                                       static_cast<size_t>(page_size)
                                 : 0),
        blocks_(num_ids),
        pages_(num_pages_),
        free_in_page_(num_pages_, 0) {}

  int32_t page_size() const noexcept { return page_size_; }

  /// Put ``id`` (taken) back. Complexity: O(log_64 n), O(page_size) when it completes a page.
  void insert(int32_t id) noexcept {
    if (page_size_ == 1) {
      blocks_.insert(id);
      return;
    }
    const size_t page = static_cast<size_t>(id) / static_cast<size_t>(page_size_);
    if (++free_in_page_[page] == page_size_ && is_full_size(page)) {
      const int32_t first = static_cast<int32_t>(page) * page_size_;
      for (int32_t other = first; other < first + page_size_; ++other) {
        if (other != id) blocks_.erase(other);  // the page's other blocks were partial
      }
      pages_.insert(static_cast<int32_t>(page));
    } else {
      blocks_.insert(id);
    }
  }

  /// Take ``count`` IDs (at most the free count) into ``out``, in hand-out order.
  void take(int64_t count, int32_t* out) noexcept {
    int64_t filled = 0;
    if (page_size_ == 1) {
      while (filled < count) out[filled++] = blocks_.pop_lowest();
      return;
    }
    const int64_t size = page_size_;
    int64_t whole = std::min<int64_t>(count / size, static_cast<int64_t>(pages_.size()));
    for (; whole > 0; --whole) {
      const int32_t page = pages_.pop_lowest();
      free_in_page_[static_cast<size_t>(page)] = 0;
      for (int32_t j = 0; j < page_size_; ++j) out[filled++] = page * page_size_ + j;
    }
    while (filled < count && blocks_.size()) {
      const int32_t id = blocks_.pop_lowest();
      --free_in_page_[static_cast<size_t>(id / page_size_)];
      out[filled++] = id;
    }
    while (filled < count) {  // break the lowest whole page
      const int32_t page = pages_.pop_lowest();
      const int32_t need = static_cast<int32_t>(std::min<int64_t>(count - filled, size));
      for (int32_t j = 0; j < need; ++j) out[filled++] = page * page_size_ + j;
      for (int32_t j = need; j < page_size_; ++j) blocks_.insert(page * page_size_ + j);
      free_in_page_[static_cast<size_t>(page)] = page_size_ - need;
    }
  }

  void clear() noexcept {
    blocks_.clear();
    pages_.clear();
    std::fill(free_in_page_.begin(), free_in_page_.end(), 0);
  }

  /// Every free ID, descending (the next to go out last), into ``out``.
  void descending(std::vector<int32_t>& out) const {
    blocks_.descending(out);
    if (page_size_ == 1 || pages_.size() == 0) return;
    std::vector<int32_t> pages;
    pages_.descending(pages);
    for (const int32_t page : pages) {
      for (int32_t j = 0; j < page_size_; ++j) out.push_back(page * page_size_ + j);
    }
    std::sort(out.begin(), out.end(), [](int32_t a, int32_t b) { return a > b; });
  }

  size_t memory_bytes() const noexcept {
    return blocks_.memory_bytes() + pages_.memory_bytes() + free_in_page_.size() * 4;
  }

 private:
  bool is_full_size(size_t page) const noexcept {
    return (page + 1) * static_cast<size_t>(page_size_) <= num_ids_;
  }

  size_t num_ids_;
  int32_t page_size_;
  size_t num_pages_;
  FreeSet blocks_;  // page_size 1: every free ID; else the free blocks of partly used pages
  FreeSet pages_;   // whole free pages (page_size > 1)
  std::vector<int32_t> free_in_page_;
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_FREE_SET_H_
