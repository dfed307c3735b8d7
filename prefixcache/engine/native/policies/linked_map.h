// LinkedMap: an insertion-ordered map keyed by block hash, for ghost lists and histories.
//
// The native twin of policies/linked_map.py (no undo: native policies never abort): get,
// put (an existing key keeps its place, as with OrderedDict), erase, take (get and erase),
// move_to_newest, the oldest entry and its removal, iteration oldest first. Keys are block
// hashes, never 0. Every method O(1) expected but iteration and growth. Not thread-safe.
//
// Layout (chosen for cache misses, which are what these maps cost: a ghost list or history
// of 50,000-100,000 hashes lies far outside L2, and a lookup is mostly one miss): each
// entry (key, links, value) is one struct, so finding, unlinking or relinking one touches
// one line; freed entries are reused last freed first through an intrusive free list: a
// bounded map frees its oldest as it adds its newest, so its entries cycle like a ring. The
// index is open addressing (linear probing, backward-shift deletion, load <= 1/2, doubled
// when half full) of 8-byte slots: the entry's position and a 32-bit tag, the high half of
// the key's multiplicative hash. A probe reads an entry's key only when the tag matches, so
// a miss reads the index alone; the home slot is the tag's high bits, so deletion and
// growth move slots without reading any entry.
#ifndef PREFIXCACHE_ENGINE_NATIVE_POLICIES_LINKED_MAP_H_
#define PREFIXCACHE_ENGINE_NATIVE_POLICIES_LINKED_MAP_H_

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace prefixcache {

template <typename V>
class LinkedMap {
 public:
  /// Room for ``expected`` entries, allocated and touched now: a bounded map fills up to
  /// its bound without reallocating or faulting pages in on the way.
  explicit LinkedMap(size_t expected = 16) : entries_(expected) {
    size_t capacity = 16;
    while (capacity < 2 * expected) capacity <<= 1;
    reset_index(capacity);
  }

  size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  bool contains(int64_t key) const noexcept { return find(key).entry >= 0; }

  /// Start loading the index slot that a lookup of ``key`` reads first.
  void prefetch(int64_t key) const noexcept {
#if defined(__GNUC__)
    __builtin_prefetch(&slots_[home(tag_of(key))]);
#else
    (void)key;
#endif
  }

  /// The value of ``key``, or nullptr.
  V* get(int64_t key) noexcept {
    const int32_t entry = find(key).entry;
    return entry < 0 ? nullptr : &entries_[static_cast<size_t>(entry)].value;
  }
  const V* get(int64_t key) const noexcept {
    const int32_t entry = find(key).entry;
    return entry < 0 ? nullptr : &entries_[static_cast<size_t>(entry)].value;
  }

  /// Set ``key`` to ``value``: in place if present, else as the newest entry.
  void put(int64_t key, V value) {
    const Probe probe = find(key);
    if (probe.entry >= 0) {
      entries_[static_cast<size_t>(probe.entry)].value = std::move(value);
      return;
    }
    add(key, std::move(value), probe.slot);
  }

  /// Set ``key`` to ``value`` as the newest entry, present or not (erase, then put).
  void put_newest(int64_t key, V value) {
    const Probe probe = find(key);
    if (probe.entry >= 0) {
      relink_last(probe.entry);
      entries_[static_cast<size_t>(probe.entry)].value = std::move(value);
      return;
    }
    add(key, std::move(value), probe.slot);
  }

  /// Make ``key`` the newest entry if present (erase, then put its value back); its value,
  /// or nullptr.
  V* move_to_newest(int64_t key) noexcept {
    const int32_t entry = find(key).entry;
    if (entry < 0) return nullptr;
    relink_last(entry);
    return &entries_[static_cast<size_t>(entry)].value;
  }

  /// Remove ``key``; whether it was present.
  bool erase(int64_t key) noexcept {
    const Probe probe = find(key);
    if (probe.entry < 0) return false;
    unlink(probe.entry, probe.slot);
    return true;
  }

  /// Remove ``key`` and move its value to ``*out``; whether it was present.
  bool take(int64_t key, V* out) noexcept {
    const Probe probe = find(key);
    if (probe.entry < 0) return false;
    *out = std::move(entries_[static_cast<size_t>(probe.entry)].value);
    unlink(probe.entry, probe.slot);
    return true;
  }

  /// The oldest key (the map must not be empty).
  int64_t oldest() const noexcept { return entries_[first_].key; }
  V& oldest_value() noexcept { return entries_[first_].value; }

  /// Start loading what pop_oldest() reads in the index (the map must not be empty).
  void prefetch_oldest() const noexcept { prefetch(entries_[first_].key); }

  /// Remove the oldest entry (the map must not be empty); its key.
  int64_t pop_oldest() noexcept {
    const int32_t entry = first_;
    const int64_t key = entries_[entry].key;
    size_t slot = home(tag_of(key));
    while (slots_[slot].entry != entry) slot = (slot + 1) & mask_;
    unlink(entry, slot);
    return key;
  }

  void clear() noexcept {
    for (Slot& slot : slots_) slot = Slot{0, kNone};
    size_ = used_ = 0;
    first_ = last_ = free_ = kNone;
  }

  /// Call ``visit(key, value)`` for each entry, oldest first.
  template <typename F>
  void for_each(F&& visit) const {
    for (int32_t at = first_; at != kNone; at = entries_[at].next) {
      visit(entries_[at].key, entries_[at].value);
    }
  }

  size_t memory_bytes() const noexcept {
    return slots_.capacity() * sizeof(Slot) + entries_.capacity() * sizeof(Entry);
  }

 private:
  static constexpr int32_t kNone = -1;

  struct Slot {
    uint32_t tag;   // high half of the key's multiplicative hash; its high bits: home
    int32_t entry;  // position in entries_, or kNone: empty
  };
  struct Entry {
    int64_t key;
    int32_t prev, next;  // insertion order; next: the free list's link while free
    V value;
  };
  struct Probe {
    int32_t entry;  // the key's entry, or kNone
    size_t slot;    // its slot, or the empty slot where it would go
  };

  static uint32_t tag_of(int64_t key) noexcept {
    return static_cast<uint32_t>((static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) >> 32);
  }
  size_t home(uint32_t tag) const noexcept { return static_cast<size_t>(tag >> tag_shift_); }

  Probe find(int64_t key) const noexcept {
    const uint32_t tag = tag_of(key);
    for (size_t slot = home(tag);; slot = (slot + 1) & mask_) {
      const Slot s = slots_[slot];
      if (s.entry == kNone) return Probe{kNone, slot};
      if (s.tag == tag && entries_[static_cast<size_t>(s.entry)].key == key) {
        return Probe{s.entry, slot};
      }
    }
  }

  // Add the absent ``key`` as the newest entry; ``slot``: the empty slot find() gave.
  void add(int64_t key, V value, size_t slot) {
    if (2 * (size_ + 1) > slots_.size()) {
      grow();
      slot = find(key).slot;
    }
    int32_t entry;
    if (free_ != kNone) {
      entry = free_;
      free_ = entries_[entry].next;
    } else {
      entry = static_cast<int32_t>(used_++);
      if (used_ > entries_.size()) entries_.resize(2 * used_);
    }
    Entry& e = entries_[entry];
    e.key = key;
    e.value = std::move(value);
    link_last(entry);
    slots_[slot] = Slot{tag_of(key), entry};
    ++size_;
  }

  void link_last(int32_t entry) noexcept {
    Entry& e = entries_[entry];
    e.prev = last_;
    e.next = kNone;
    (last_ == kNone ? first_ : entries_[last_].next) = entry;
    last_ = entry;
  }

  void detach(int32_t entry) noexcept {
    const Entry& e = entries_[entry];
    (e.prev == kNone ? first_ : entries_[e.prev].next) = e.next;
    (e.next == kNone ? last_ : entries_[e.next].prev) = e.prev;
  }

  void relink_last(int32_t entry) noexcept {
    if (entry == last_) return;
    detach(entry);
    link_last(entry);
  }

  // Remove ``entry``, found at index ``slot``: backward-shift the probe run after it into
  // the hole where a slot's home does not lie cyclically in (hole, current].
  void unlink(int32_t entry, size_t slot) noexcept {
    size_t hole = slot;
    for (size_t next = (hole + 1) & mask_; slots_[next].entry != kNone; next = (next + 1) & mask_) {
      const size_t want = home(slots_[next].tag);
      const bool stays = hole <= next ? (hole < want && want <= next) : (hole < want || want <= next);
      if (!stays) {
        slots_[hole] = slots_[next];
        hole = next;
      }
    }
    slots_[hole].entry = kNone;
    --size_;
    detach(entry);
    entries_[entry].next = free_;
    free_ = entry;
  }

  void reset_index(size_t capacity) {
    slots_.assign(capacity, Slot{0, kNone});
    mask_ = capacity - 1;
    unsigned bits = 0;
    while ((size_t{1} << bits) < capacity) ++bits;
    tag_shift_ = 32 - bits;  // capacity <= 2**32
  }

  void grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    reset_index(2 * old.size());
    for (const Slot& s : old) {
      if (s.entry == kNone) continue;
      size_t slot = home(s.tag);
      while (slots_[slot].entry != kNone) slot = (slot + 1) & mask_;
      slots_[slot] = s;
    }
  }

  std::vector<Slot> slots_;
  std::vector<Entry> entries_;  // entries_[used_:] unused since construction or clear()
  size_t mask_ = 0;
  unsigned tag_shift_ = 28;
  size_t size_ = 0;  // entries in the map
  size_t used_ = 0;  // entries_ ever used since construction or clear()
  int32_t first_ = kNone, last_ = kNone, free_ = kNone;
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_POLICIES_LINKED_MAP_H_
