// HashSlots: the index of the maps keyed by block hash (linked_map.h, hazard_hashes.h):
// open addressing of 8-byte slots, each an entry's position in its map's entry array and a
// 32-bit tag, the high half of the key's multiplicative hash. Linear probing, load <= 1/2
// (the map calls grow()), backward-shift deletion.
//
// A probe reads an entry's key (through the map's ``key_of``) only when the tag matches,
// so a miss reads the index alone; the home slot is the tag's high bits, so deletion and
// growth move slots without reading any entry. Keys are block hashes, never 0. Not
// thread-safe.
#ifndef PREFIXCACHE_ENGINE_NATIVE_POLICIES_HASH_SLOTS_H_
#define PREFIXCACHE_ENGINE_NATIVE_POLICIES_HASH_SLOTS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace prefixcache {

class HashSlots {
 public:
  static constexpr int32_t kNone = -1;

  struct Probe {
    int32_t entry;  // the key's entry, or kNone
    size_t slot;    // its slot, or the empty slot where it would go
  };

  /// ``capacity`` slots, a power of two.
  explicit HashSlots(size_t capacity) { reset(capacity); }

  size_t size() const noexcept { return slots_.size(); }

  /// Start loading the slot that a lookup of ``key`` reads first.
  void prefetch(int64_t key) const noexcept {
#if defined(__GNUC__)
    __builtin_prefetch(&slots_[home(tag_of(key))]);
#else
    (void)key;
#endif
  }

  /// The entry of ``key``; ``key_of(entry)`` gives an entry's key.
  template <typename KeyOf>
  Probe find(int64_t key, const KeyOf& key_of) const noexcept {
    const uint32_t tag = tag_of(key);
    for (size_t slot = home(tag);; slot = (slot + 1) & mask_) {
      const Slot s = slots_[slot];
      if (s.entry == kNone) return Probe{kNone, slot};
      if (s.tag == tag && key_of(s.entry) == key) return Probe{s.entry, slot};
    }
  }

  /// The slot holding ``entry``, whose key is ``key`` (it must be indexed).
  size_t slot_of(int64_t key, int32_t entry) const noexcept {
    size_t slot = home(tag_of(key));
    while (slots_[slot].entry != entry) slot = (slot + 1) & mask_;
    return slot;
  }

  /// Index ``entry`` under ``key`` at ``slot``, the empty slot find() gave.
  void set(size_t slot, int64_t key, int32_t entry) noexcept {
    slots_[slot] = Slot{tag_of(key), entry};
  }

  /// Empty ``slot``: backward-shift the probe run after it into the hole where a slot's
  /// home does not lie cyclically in (hole, current].
  void erase(size_t slot) noexcept {
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
  }

  /// Double the slots (find() again for a slot to set afterwards).
  void grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    reset(2 * old.size());
    for (const Slot& s : old) {
      if (s.entry == kNone) continue;
      size_t slot = home(s.tag);
      while (slots_[slot].entry != kNone) slot = (slot + 1) & mask_;
      slots_[slot] = s;
    }
  }

  void clear() noexcept {
    for (Slot& slot : slots_) slot = Slot{0, kNone};
  }

  size_t memory_bytes() const noexcept { return slots_.capacity() * sizeof(Slot); }

 private:
  struct Slot {
    uint32_t tag;   // high half of the key's multiplicative hash; its high bits: home
    int32_t entry;  // position in the map's entries, or kNone: empty
  };

  static uint32_t tag_of(int64_t key) noexcept {
    return static_cast<uint32_t>((static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) >> 32);
  }
  size_t home(uint32_t tag) const noexcept { return static_cast<size_t>(tag >> tag_shift_); }

  void reset(size_t capacity) {
    slots_.assign(capacity, Slot{0, kNone});
    mask_ = capacity - 1;
    unsigned bits = 0;
    while ((size_t{1} << bits) < capacity) ++bits;
    tag_shift_ = 32 - bits;  // capacity <= 2**32
  }

  std::vector<Slot> slots_;
  size_t mask_ = 0;
  unsigned tag_shift_ = 28;
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_POLICIES_HASH_SLOTS_H_
