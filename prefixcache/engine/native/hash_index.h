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
    slots_.assign(capacity, Slot{});
    mask_ = capacity - 1;
    shift_ = 64;
    for (size_t c = capacity; c > 1; c >>= 1) --shift_;
  }

  /// The block holding ``key``, or -1. Complexity: O(1) expected.
  int32_t find(int64_t key) const noexcept {
    for (size_t slot = home(key);; slot = (slot + 1) & mask_) {
      const Slot& entry = slots_[slot];
      if (entry.key == key) return entry.value;
      if (entry.key == 0) return -1;
    }
  }

  /// Start loading ``key``'s home slot into the cache, for a find() soon after.
  void prefetch(int64_t key) const noexcept {
#if defined(__GNUC__)
    __builtin_prefetch(&slots_[home(key)]);
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
    __builtin_prefetch(&slots_[slot], 1);
#else
    (void)key;
#endif
  }

  /// Insert ``key`` (not present, not 0). Complexity: O(1) expected.
  void insert(int64_t key, int32_t value) noexcept {
    size_t slot = home(key);
    while (slots_[slot].key != 0) slot = (slot + 1) & mask_;
    slots_[slot] = Slot{key, value};
    ++size_;
  }

  /// Remove ``key`` (present). Complexity: O(1) expected.
  void erase(int64_t key) noexcept {
    size_t slot = home(key);
    while (slots_[slot].key != key) slot = (slot + 1) & mask_;
    // Backward shift: move later entries of the probe run into the hole when
    // their home slot does not lie cyclically in (hole, current].
    size_t hole = slot;
    for (size_t next = (hole + 1) & mask_; slots_[next].key != 0; next = (next + 1) & mask_) {
      const size_t want = home(slots_[next].key);
      const bool stays = hole <= next ? (hole < want && want <= next) : (hole < want || want <= next);
      if (!stays) {
        slots_[hole] = slots_[next];
        hole = next;
      }
    }
    slots_[hole] = Slot{};
    --size_;
  }

  void clear() noexcept {
    std::fill(slots_.begin(), slots_.end(), Slot{});
    size_ = 0;
  }

  size_t size() const noexcept { return size_; }
  size_t capacity() const noexcept { return slots_.size(); }

  /// Slot ``i``'s key (0: empty) and value, for checks. Complexity: O(1).
  int64_t key_at(size_t i) const noexcept { return slots_[i].key; }
  int32_t value_at(size_t i) const noexcept { return slots_[i].value; }

  size_t memory_bytes() const noexcept { return slots_.size() * sizeof(Slot); }

 private:
  size_t home(int64_t key) const noexcept {
    return static_cast<size_t>((static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  // A slot's key and value share a cache line (16 bytes, four slots a line): a probe of a
  // cold index costs one miss, not two (a session turn's registrations probe a few dozen
  // unrelated slots; DESIGN.md, "Sessions").
  struct Slot {
    int64_t key = 0;  // 0: empty
    int32_t value = -1;
  };
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  unsigned shift_ = 60;
  size_t size_ = 0;
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_HASH_INDEX_H_
