// UseHistory: hand-out counts of a prefix carried across its block's stays, by hash.
//
// protected_lru and reuse_lru count every hand-out of a prefix, earlier stays in the cache
// included: a stay per block ID (the hash, the hand-outs last seen, the uses of earlier
// stays) survives a hit, and an evicted hash's total waits in a bounded history until the
// prefix comes back. This is that bookkeeping, as both Python classes keep it.
#ifndef PREFIXCACHE_ENGINE_NATIVE_POLICIES_USE_HISTORY_H_
#define PREFIXCACHE_ENGINE_NATIVE_POLICIES_USE_HISTORY_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "../policy.h"
#include "linked_map.h"

namespace prefixcache {

class UseHistory {
 public:
  struct Stay {
    bool live = false;
    int64_t block_hash = 0;
    int64_t num_accesses = 0;  // hand-outs last seen
    int64_t earlier = 0;       // uses of earlier stays of the hash
  };

  UseHistory(int32_t num_blocks, int64_t capacity)
      : capacity_(capacity),
        stays_(static_cast<size_t>(num_blocks)),
        history_(static_cast<size_t>(std::min<int64_t>(capacity, 1 << 16))) {}

  /// The stay ``leaf`` starts or continues for ``block_id``: the same one if it returns
  /// from a hit (same hash, hand-outs not dropped), else a new one that takes its hash's
  /// remembered uses out of the history.
  Stay& enter(int32_t block_id, const LeafInfo& leaf) {
    Stay& stay = stays_[block_id];
    int64_t earlier = stay.earlier;
    if (!stay.live || stay.block_hash != leaf.block_hash ||
        stay.num_accesses > leaf.num_accesses) {
      earlier = 0;
      history_.take(leaf.block_hash, &earlier);  // one probe: get, then erase
    }
    stay = Stay{true, leaf.block_hash, leaf.num_accesses, earlier};
    return stay;
  }

  /// The uses of earlier stays enter(block_id, leaf) would give the stay; changes nothing.
  int64_t earlier(int32_t block_id, const LeafInfo& leaf) const noexcept {
    const Stay& stay = stays_[block_id];
    if (stay.live && stay.block_hash == leaf.block_hash &&
        stay.num_accesses <= leaf.num_accesses) {
      return stay.earlier;
    }
    const int64_t* remembered = history_.get(leaf.block_hash);
    return remembered == nullptr ? 0 : *remembered;
  }

  Stay& operator[](int32_t block_id) noexcept { return stays_[block_id]; }

  /// ``block_id`` was evicted: its stay ends, its hash's uses are remembered (``refresh``:
  /// at the recent end, else in the entry's old place), the oldest dropped past capacity.
  void leave(int32_t block_id, bool refresh) {
    Stay& stay = stays_[block_id];
    stay.live = false;
    if (capacity_ <= 0) return;
    const int64_t uses = stay.earlier + stay.num_accesses;
    // Two independent index misses: the pop's, loaded while the put probes.
    if (static_cast<int64_t>(history_.size()) >= capacity_) history_.prefetch_oldest();
    if (refresh) {
      history_.put_newest(stay.block_hash, uses);  // erase, then put
    } else {
      history_.put(stay.block_hash, uses);
    }
    if (static_cast<int64_t>(history_.size()) > capacity_) history_.pop_oldest();
  }

  /// Move a remembered hash to the recent end (its prefix was registered again).
  void refresh(int64_t block_hash) noexcept { history_.move_to_newest(block_hash); }

  /// refresh() for ``count`` hashes in order, their index slots loaded ahead (a chain's
  /// registration: the lookups are independent misses, so they overlap).
  void refresh_all(const int64_t* hashes, size_t count) noexcept {
    constexpr size_t kAhead = 8;
    for (size_t i = 0; i < std::min(count, kAhead); ++i) history_.prefetch(hashes[i]);
    for (size_t i = 0; i < count; ++i) {
      if (i + kAhead < count) history_.prefetch(hashes[i + kAhead]);
      history_.move_to_newest(hashes[i]);
    }
  }

  void clear() {
    std::fill(stays_.begin(), stays_.end(), Stay{});
    history_.clear();
  }

  size_t memory_bytes() const noexcept {
    return stays_.capacity() * sizeof(Stay) + history_.memory_bytes();
  }

 private:
  const int64_t capacity_;
  std::vector<Stay> stays_;     // by block ID: tracked, or out for a hit
  LinkedMap<int64_t> history_;  // evicted hash -> uses, least recent first
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_POLICIES_USE_HISTORY_H_
