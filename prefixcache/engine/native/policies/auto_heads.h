// AutoHeads: auto's map from a block hash to the most recent duel side it is on.
//
// What auto_duels.py keeps as a dict of hash -> duel IDs, reduced to the head of a linked
// list (the sides themselves link to the rest). Only lookups, updates in place, inserts
// and removals: no order, so one open-addressing table (linear probing, backward-shift
// removal, load <= 1/2) whose slots hold the key and the value together, a lookup one
// probe run (LinkedMap, ordered, keeps keys, values and links in separate arrays behind
// its index). Keys are block hashes, never 0 (the empty marker). Not thread-safe.
#ifndef PREFIXCACHE_ENGINE_NATIVE_POLICIES_AUTO_HEADS_H_
#define PREFIXCACHE_ENGINE_NATIVE_POLICIES_AUTO_HEADS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace prefixcache {

class AutoHeads {
 public:
  AutoHeads() { reset(16); }

  size_t size() const noexcept { return size_; }
  bool contains(int64_t key) const noexcept { return find(key) != kNoSlot; }

  /// The value of ``key``, or nullptr.
  int32_t* get(int64_t key) noexcept {
    const size_t slot = find(key);
    return slot == kNoSlot ? nullptr : &table_[slot].value;
  }

  /// Add ``key`` (absent) with ``value``.
  void put(int64_t key, int32_t value) {
    if (2 * (size_ + 1) > table_.size()) grow();
    place(key, value);
    ++size_;
  }

  /// The value of ``key``, added with ``value`` if absent (``added`` says which): one
  /// probe run where get-then-put takes two.
  int32_t& get_or_put(int64_t key, int32_t value, bool& added) {
    if (2 * (size_ + 1) > table_.size()) grow();  // no order is kept: growing early is free
    size_t slot = home(key);
    for (; table_[slot].key != 0; slot = (slot + 1) & mask_) {
      if (table_[slot].key == key) {
        added = false;
        return table_[slot].value;
      }
    }
    table_[slot].key = key;
    table_[slot].value = value;
    ++size_;
    added = true;
    return table_[slot].value;
  }

  /// Remove ``key`` (present).
  void erase(int64_t key) noexcept {
    size_t hole = find(key);
    for (size_t next = (hole + 1) & mask_; table_[next].key != 0; next = (next + 1) & mask_) {
      const size_t want = home(table_[next].key);
      const bool stays = hole <= next ? (hole < want && want <= next) : (hole < want || want <= next);
      if (!stays) {
        table_[hole] = table_[next];
        hole = next;
      }
    }
    table_[hole].key = 0;
    --size_;
  }

  void clear() { reset(16); }

  size_t memory_bytes() const noexcept { return table_.capacity() * sizeof(Slot); }

 private:
  static constexpr size_t kNoSlot = SIZE_MAX;

  struct Slot {
    int64_t key = 0;  // 0: empty
    int32_t value = -1;
  };

  size_t home(int64_t key) const noexcept {
    return static_cast<size_t>((static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  size_t find(int64_t key) const noexcept {
    for (size_t slot = home(key);; slot = (slot + 1) & mask_) {
      const int64_t k = table_[slot].key;
      if (k == key) return slot;
      if (k == 0) return kNoSlot;
    }
  }

  void place(int64_t key, int32_t value) noexcept {
    size_t slot = home(key);
    while (table_[slot].key != 0) slot = (slot + 1) & mask_;
    table_[slot].key = key;
    table_[slot].value = value;
  }

  void reset(size_t capacity) {
    table_.assign(capacity, Slot{});
    mask_ = capacity - 1;
    shift_ = 64;
    for (size_t c = capacity; c > 1; c >>= 1) --shift_;
    size_ = 0;
  }

  void grow() {
    std::vector<Slot> old;
    old.swap(table_);
    const size_t count = size_;
    reset(2 * old.size());
    size_ = count;
    for (const Slot& slot : old) {
      if (slot.key != 0) place(slot.key, slot.value);
    }
  }

  std::vector<Slot> table_;
  size_t mask_ = 0;
  unsigned shift_ = 64;
  size_t size_ = 0;
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_POLICIES_AUTO_HEADS_H_
