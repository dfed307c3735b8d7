// HashIndex: block hash -> block ID, open addressing over flat arrays.
//
// The native counterpart of the Python registry's dict. Keys are signed 64-bit
// block hashes; 0 is never a block hash (the NO_HASH sentinel), so it marks an
// empty slot. Linear probing with backward-shift deletion keeps no tombstones,
// so a lookup's probe length depends only on the load (at most 1/2: the table
// has at least twice as many slots as there are blocks) and never degrades
// after many insertions and deletions. Keys are mixed with a multiplicative
// hash first: xxh3 chains are already uniform, but tests and callers also
// register small consecutive integers.

#ifndef PREFIXCACHE_ENGINE_NATIVE_HASH_INDEX_H_
#define PREFIXCACHE_ENGINE_NATIVE_HASH_INDEX_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace prefixcache {

class HashIndex {
 public:
  /// Room for ``max_entries`` keys at a load of at most 1/2.
  explicit HashIndex(size_t max_entries) {
    size_t capacity = 16;
    while (capacity < 2 * max_entries) capacity <<= 1;
    keys_.assign(capacity, 0);
    values_.assign(capacity, -1);
    mask_ = capacity - 1;
    shift_ = 64;
    for (size_t c = capacity; c > 1; c >>= 1) --shift_;
  }

  /// The block holding ``key``, or -1. Complexity: O(1) expected.
  int32_t find(int64_t key) const noexcept {
    for (size_t slot = home(key);; slot = (slot + 1) & mask_) {
      const int64_t k = keys_[slot];
      if (k == key) return values_[slot];
      if (k == 0) return -1;
    }
  }

  /// Start loading ``key``'s home slot into the cache, for a find() soon after.
  void prefetch(int64_t key) const noexcept {
#if defined(__GNUC__)
    __builtin_prefetch(&keys_[home(key)]);
#else
    (void)key;
#endif
  }

  /// Start loading ``key``'s home slot, keys and values, for writing: the insert of a
  /// new key soon after then finds its lines in the cache. A chain's new blocks hash to
  /// unrelated slots, each a cache miss when the index is cold (another session's turn,
  /// or the caller's own work, evicted it); issued all together the misses overlap.
  void prefetch_insert(int64_t key) const noexcept {
#if defined(__GNUC__)
    const size_t slot = home(key);
    __builtin_prefetch(&keys_[slot], 1);
    __builtin_prefetch(&values_[slot], 1);
#else
    (void)key;
#endif
  }

  /// Insert ``key`` (not present, not 0). Complexity: O(1) expected.
  void insert(int64_t key, int32_t value) noexcept {
    size_t slot = home(key);
    while (keys_[slot] != 0) slot = (slot + 1) & mask_;
    keys_[slot] = key;
    values_[slot] = value;
    ++size_;
  }

  /// Remove ``key`` (present). Complexity: O(1) expected.
  void erase(int64_t key) noexcept {
    size_t slot = home(key);
    while (keys_[slot] != key) slot = (slot + 1) & mask_;
    // Backward shift: move later entries of the probe run into the hole when
    // their home slot does not lie cyclically in (hole, current].
    size_t hole = slot;
    for (size_t next = (hole + 1) & mask_; keys_[next] != 0; next = (next + 1) & mask_) {
      const size_t want = home(keys_[next]);
      const bool stays = hole <= next ? (hole < want && want <= next) : (hole < want || want <= next);
      if (!stays) {
        keys_[hole] = keys_[next];
        values_[hole] = values_[next];
        hole = next;
      }
    }
    keys_[hole] = 0;
    values_[hole] = -1;
    --size_;
  }

  void clear() noexcept {
    std::fill(keys_.begin(), keys_.end(), 0);
    std::fill(values_.begin(), values_.end(), -1);
    size_ = 0;
  }

  size_t size() const noexcept { return size_; }
  size_t capacity() const noexcept { return keys_.size(); }

  /// Slot ``i``'s key (0: empty) and value, for checks. Complexity: O(1).
  int64_t key_at(size_t i) const noexcept { return keys_[i]; }
  int32_t value_at(size_t i) const noexcept { return values_[i]; }

  size_t memory_bytes() const noexcept { return keys_.size() * (sizeof(int64_t) + sizeof(int32_t)); }

 private:
  size_t home(int64_t key) const noexcept {
    return static_cast<size_t>((static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  std::vector<int64_t> keys_;
  std::vector<int32_t> values_;
  size_t mask_ = 0;
  unsigned shift_ = 60;
  size_t size_ = 0;
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_HASH_INDEX_H_
