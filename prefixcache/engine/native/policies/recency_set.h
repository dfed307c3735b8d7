// RecencySet: block hashes in order of last use (least recent first), for auto's LRU shadow.
//
// What auto_safety.py keeps as a dict of stamps and a lazy heap, with one operation on the
// hot path: use(key), which makes the key the most recent and says whether it was present,
// and pop_oldest(). One open-addressing table (linear probing, tombstones, load <= 1/2)
// whose slots hold the key and the links of the recency list together, so a use is one
// probe run and no second lookup (LinkedMap's index-then-arrays costs two). A removal
// leaves a tombstone, since moving entries would break the links (unless the next slot is
// empty: then it and the tombstones before it are emptied); the table is rebuilt (in list
// order) when live entries and tombstones fill half of it. Keys are any int64.
// Every operation O(1) expected, amortised over rebuilds. Not thread-safe.
#ifndef PREFIXCACHE_ENGINE_NATIVE_POLICIES_RECENCY_SET_H_
#define PREFIXCACHE_ENGINE_NATIVE_POLICIES_RECENCY_SET_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace prefixcache {

class RecencySet {
 public:
  RecencySet() { reset(16); }

  size_t size() const noexcept { return live_; }

  /// Make ``key`` the most recent; whether it was present.
  bool use(int64_t key) {
    int32_t hint = kNone;
    return use(key, hint);
  }

  /// use(key), first trying slot ``hint`` (any value); sets ``hint`` to the slot that came
  /// after the key's in recency order, or kNone. A chain used key after key in the order
  /// it was used the last time finds each key at the hint: no hashing, no probe run.
  bool use(int64_t key, int32_t& hint) {
    if (hint >= 0 && static_cast<size_t>(hint) < table_.size()) {
      const Slot& entry = table_[hint];
      if (entry.prev >= kNone && entry.key == key) {  // live, and keys are unique
        const int32_t found = hint;
        hint = entry.next;
        to_back(found);
        return true;
      }
    }
    size_t slot = home(key);
    size_t tomb = kNoSlot;
    for (;; slot = (slot + 1) & mask_) {
      Slot& entry = table_[slot];
      if (entry.prev == kEmpty) break;
      if (entry.prev == kTomb) {
        if (tomb == kNoSlot) tomb = slot;
      } else if (entry.key == key) {
        hint = entry.next;
        to_back(static_cast<int32_t>(slot));
        return true;
      }
    }
    hint = kNone;  // an insertion may rebuild the table
    if (tomb != kNoSlot) {
      slot = tomb;
    } else {
      ++used_;
    }
    table_[slot].key = key;
    link_back(static_cast<int32_t>(slot));
    ++live_;
    if (2 * used_ > table_.size()) rebuild();
    return false;
  }

  /// Start loading the slot where a use of ``key`` begins (a hint; changes nothing): a
  /// run of uses prefetches a few keys ahead and overlaps the cache misses.
  void prefetch(int64_t key) const noexcept {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(&table_[home(key)]);
#else
    (void)key;
#endif
  }

  /// Remove the least recent key (the set must not be empty).
  void pop_oldest() noexcept { remove_slot(first_); }

  /// Remove ``key`` if present; whether it was.
  bool erase(int64_t key) noexcept {
    for (size_t slot = home(key);; slot = (slot + 1) & mask_) {
      const Slot& entry = table_[slot];
      if (entry.prev == kEmpty) return false;
      if (entry.prev != kTomb && entry.key == key) {
        remove_slot(static_cast<int32_t>(slot));
        return true;
      }
    }
  }

  void clear() { reset(16); }

  size_t memory_bytes() const noexcept { return table_.capacity() * sizeof(Slot); }

 static constexpr int32_t kNone = -1;  // no neighbour in the list; no hint

 private:
  // Unlink live ``slot`` from the recency list and free it.
  void remove_slot(int32_t slot) noexcept {
    const int32_t before = table_[slot].prev, after = table_[slot].next;
    (before == kNone ? first_ : table_[before].next) = after;
    (after == kNone ? last_ : table_[after].prev) = before;
    --live_;
    // A removed slot before an empty one ends no probe run: it and the tombstones just
    // before it become empty again, so tombstones (longer probes, rebuilds) stay few.
    if (table_[(slot + 1) & mask_].prev != kEmpty) {
      table_[slot].prev = kTomb;
      return;
    }
    size_t at = static_cast<size_t>(slot);
    do {
      table_[at].prev = kEmpty;
      --used_;
      at = (at - 1) & mask_;
    } while (table_[at].prev == kTomb);
  }

  static constexpr int32_t kTomb = -2;   // prev of a removed slot
  static constexpr int32_t kEmpty = -3;  // prev of a never-used slot
  static constexpr size_t kNoSlot = SIZE_MAX;

  struct Slot {
    int64_t key = 0;
    int32_t prev = kEmpty;  // live: the previous (less recent) slot or kNone
    int32_t next = kNone;
  };

  size_t home(int64_t key) const noexcept {
    return static_cast<size_t>((static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  void link_back(int32_t slot) noexcept {
    table_[slot].prev = last_;
    table_[slot].next = kNone;
    (last_ == kNone ? first_ : table_[last_].next) = slot;
    last_ = slot;
  }

  void to_back(int32_t slot) noexcept {
    if (slot == last_) return;
    const int32_t before = table_[slot].prev, after = table_[slot].next;
    (before == kNone ? first_ : table_[before].next) = after;
    table_[after].prev = before;  // after exists: slot is not the last
    link_back(slot);
  }

  void reset(size_t capacity) {
    table_.assign(capacity, Slot{});
    mask_ = capacity - 1;
    shift_ = 64;
    for (size_t c = capacity; c > 1; c >>= 1) --shift_;
    first_ = last_ = kNone;
    live_ = used_ = 0;
  }

  // Rehash the live keys into a table of at least 4 x their number, in recency order.
  void rebuild() {
    std::vector<int64_t> keys;
    keys.reserve(live_);
    for (int32_t slot = first_; slot != kNone; slot = table_[slot].next) {
      keys.push_back(table_[slot].key);
    }
    size_t capacity = 16;
    while (capacity < 4 * keys.size()) capacity <<= 1;
    reset(capacity);
    for (const int64_t key : keys) {
      size_t slot = home(key);
      while (table_[slot].prev != kEmpty) slot = (slot + 1) & mask_;
      table_[slot].key = key;
      link_back(static_cast<int32_t>(slot));
    }
    live_ = used_ = keys.size();
  }

  std::vector<Slot> table_;
  size_t mask_ = 0;
  unsigned shift_ = 64;
  int32_t first_ = kNone, last_ = kNone;  // least and most recent
  size_t live_ = 0;                       // keys present
  size_t used_ = 0;                       // slots live or tombstoned
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_POLICIES_RECENCY_SET_H_
