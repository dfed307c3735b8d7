// RecencySet: block hashes in order of last use (least recent first), for auto's LRU shadow.
//
// What auto_safety.py keeps as a dict of stamps and a lazy heap, with one operation on the
// hot path: use_run(keys), which makes each key the most recent in turn and counts those
// that were present (a chain used again moves as one stretch), and pop_oldest(). One open-addressing table (linear probing, tombstones, load <= 1/2)
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

  /// use(keys[i]) for i from count - 1 down to 0 (deepest first), and after each key that
  /// was absent (and added), pop_oldest() once if size() > ``limit``; how many were present.
  /// Keys found one after another in list order (a chain used again in the order it was
  /// used the last time) are a stretch that moves to the back in one splice, found without
  /// hashing or probing: the next key is compared with the stretch's list successor. The
  /// result, order included, is that of the uses one at a time. Slots are prefetched
  /// kLookAhead keys ahead, so the probes of a run overlap their cache misses.
  size_t use_run(const int64_t* keys, size_t count, size_t limit) {
    size_t present = 0;
    int32_t run_first = kNone, run_last = kNone;  // the stretch found, still in place
    for (size_t i = count; i-- > 0;) {
      if (i >= kLookAhead) prefetch(keys[i - kLookAhead]);
      const int64_t key = keys[i];
      if (run_last != kNone) {
        const int32_t after = table_[run_last].next;  // live: a list member
        if (after != kNone && table_[after].key == key) {  // keys are unique
          run_last = after;
          ++present;
          continue;
        }
        splice_back(run_first, run_last);
        run_last = kNone;
      }
      size_t slot = home(key);
      size_t tomb = kNoSlot;
      bool found = false;
      for (;; slot = (slot + 1) & mask_) {
        const Slot& entry = table_[slot];
        if (entry.prev == kEmpty) break;
        if (entry.prev == kTomb) {
          if (tomb == kNoSlot) tomb = slot;
        } else if (entry.key == key) {
          found = true;
          break;
        }
      }
      if (found) {
        run_first = run_last = static_cast<int32_t>(slot);
        ++present;
        continue;
      }
      if (tomb != kNoSlot) {
        slot = tomb;
      } else {
        ++used_;
      }
      table_[slot].key = key;
      link_back(static_cast<int32_t>(slot));
      ++live_;
      if (2 * used_ > table_.size()) rebuild();
      if (live_ > limit) pop_oldest();
    }
    if (run_last != kNone) splice_back(run_first, run_last);
    return present;
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

  static constexpr int32_t kNone = -1;  // no neighbour in the list
  static constexpr size_t kLookAhead = 6;  // use_run prefetches this many keys ahead

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

  // Move the list stretch first..last (first not after last) to the back, order kept.
  void splice_back(int32_t first, int32_t last) noexcept {
    if (last == last_) return;
    const int32_t before = table_[first].prev, after = table_[last].next;  // after exists
    (before == kNone ? first_ : table_[before].next) = after;
    table_[after].prev = before;
    table_[first].prev = last_;
    table_[last_].next = first;  // last_ is not in the stretch, so it exists
    table_[last].next = kNone;
    last_ = last;
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
