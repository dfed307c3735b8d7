// HazardHashes: hazard's two maps keyed by block hash in one table: the history (evicted
// hash -> its last stay) and the returned hashes (registered again after eviction -> the
// uses of its earlier stays), each insertion-ordered, as policies/hazard.py's two
// LinkedMaps.
//
// Why one table: a returning hash moves from the history to the returned map when it is
// registered again, then out of it when its block is inserted, and back into the history
// when that block is evicted (on W3, mostly right after: the exposed parent). With two
// maps each move is an erase in one index and an add in the other, a cache miss each.
// Here an entry belongs to the history, the returned map, both or (for a moment) neither,
// by two flags and two pairs of links, so each move is one probe or none:
// - on_register's move from history to returned is one probe and a flag flip;
// - take() (an insert) leaves the entry in the index, in neither map (absent for every
//   lookup: a "limbo" entry; an absent key gets one), and returns its position, which the
//   caller keeps with the stay; put_history() (the eviction) with that position needs no
//   probe. At most one limbo entry is kept: the next take() erases the previous one if it
//   is still in neither map, so the index holds the two maps' entries and at most one more.
// Each map's size and order are exactly those of its LinkedMap: every operation keeps or
// sets the place policies/linked_map.py's would. Keys are block hashes, never 0.
//
// Layout as linked_map.h's (see there): entries recycled through a free list, the index
// hash_slots.h's, doubled when half full. Not thread-safe.
#ifndef PREFIXCACHE_ENGINE_NATIVE_POLICIES_HAZARD_HASHES_H_
#define PREFIXCACHE_ENGINE_NATIVE_POLICIES_HAZARD_HASHES_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "hash_slots.h"

namespace prefixcache {

/// A history record: the uses, last access and class of a hash's last stay.
struct HazardGhost {
  int64_t num_uses;
  int64_t last_access;
  int klass;
};

class HazardHashes {
 public:
  static constexpr int32_t kNone = HashSlots::kNone;
  static constexpr size_t kMaxReserved = size_t{1} << 18;

  /// What take() found: nothing, a returned hash's uses or a history record.
  enum class Found { kNone, kReturned, kHistory };

  /// ``bound``: the most entries the table will hold (both maps' capacities and one), whose
  /// room is reserved now (address space only: pages are touched as entries are used), so
  /// growing never copies entries; up to kMaxReserved, beyond which it grows by doubling.
  explicit HazardHashes(size_t bound) : slots_(32) {
    entries_.reserve(bound < kMaxReserved ? bound : kMaxReserved);
  }

  size_t history_size() const noexcept { return lists_[kHistory].size; }
  size_t returned_size() const noexcept { return lists_[kReturned].size; }

  /// Start loading the index slot that a lookup of ``key`` reads first.
  void prefetch(int64_t key) const noexcept { slots_.prefetch(key); }

  /// hazard.py's insert: take ``key`` out of the returned map (its uses to ``*uses``), else
  /// out of the history (its record to ``*ghost``). The entry stays indexed, in neither map,
  /// and when ``keep`` an absent key is indexed so, too; its position (or kNone) is the
  /// result, for put_history() (the eviction that mostly follows).
  int32_t take(int64_t key, bool keep, int64_t* uses, HazardGhost* ghost, Found* found) {
    const Probe probe = find(key);
    int32_t at = probe.entry;
    *found = Found::kNone;
    if (at == kNone) {
      if (!keep) return kNone;
      at = add(key, probe.slot);
    } else {
      Entry& e = entries_[at];
      if (e.in & kInReturned) {
        *uses = e.uses;
        detach(at, kReturned);
        *found = Found::kReturned;
      } else if (e.in & kInHistory) {
        *ghost = e.ghost;
        detach(at, kHistory);
        *found = Found::kHistory;
      }
      if (e.in != 0 || at == limbo_) return at;
    }
    if (limbo_ != kNone) drop_if_unused(limbo_);
    limbo_ = at;
    return at;
  }

  /// on_register's step: if ``key`` is in the history, take its record to ``*ghost``, put
  /// ``ghost->num_uses`` for it in the returned map (in place if there, else as the newest)
  /// and drop the returned map's oldest while it holds more than ``capacity``; whether it was.
  bool history_to_returned(int64_t key, HazardGhost* ghost, size_t capacity) {
    const int32_t at = find(key).entry;
    if (at == kNone || !(entries_[at].in & kInHistory)) return false;
    Entry& e = entries_[at];
    *ghost = e.ghost;
    detach(at, kHistory);
    e.uses = ghost->num_uses;
    if (!(e.in & kInReturned)) link_last(at, kReturned);
    if (lists_[kReturned].size > capacity) pop_oldest(kReturned);
    return true;
  }

  /// forget's step: ``key`` -> ``ghost`` in the history (in place if there, else as the
  /// newest), then drop the history's oldest while it holds more than ``capacity``.
  /// ``hint``: the position take() gave for ``key``, or kNone; checked, never trusted.
  void put_history(int64_t key, const HazardGhost& ghost, int32_t hint, size_t capacity) {
    int32_t at = hint;
    if (at == kNone || static_cast<size_t>(at) >= entries_.size() || entries_[at].key != key) {
      const Probe probe = find(key);
      at = probe.entry == kNone ? add(key, probe.slot) : probe.entry;
    }
    Entry& e = entries_[at];
    e.ghost = ghost;
    if (!(e.in & kInHistory)) link_last(at, kHistory);
    if (at == limbo_) limbo_ = kNone;
    if (lists_[kHistory].size > capacity) pop_oldest(kHistory);
  }

  void clear() noexcept {
    slots_.clear();
    entries_.clear();  // keeps the room
    indexed_ = 0;
    free_ = limbo_ = kNone;
    for (List& list : lists_) list = List{};
  }

  size_t memory_bytes() const noexcept {
    return slots_.memory_bytes() + entries_.capacity() * sizeof(Entry);
  }

 private:
  enum { kHistory = 0, kReturned = 1 };
  static constexpr uint8_t kInHistory = 1, kInReturned = 2;

  using Probe = HashSlots::Probe;

  struct Entry {
    int64_t key;  // 0: not indexed (free)
    HazardGhost ghost;  // while in the history
    int64_t uses;       // while in the returned map
    int32_t prev[2], next[2];  // order in each map; next[kHistory]: the free list's link
    uint8_t in;                // kInHistory | kInReturned
  };
  struct List {
    int32_t first = kNone, last = kNone;
    size_t size = 0;
  };

  Probe find(int64_t key) const noexcept {
    return slots_.find(key, [this](int32_t at) { return entries_[static_cast<size_t>(at)].key; });
  }

  // Index the absent ``key`` in neither map; ``slot``: the empty slot find() gave.
  int32_t add(int64_t key, size_t slot) {
    if (2 * (indexed_ + 1) > slots_.size()) {
      slots_.grow();
      slot = find(key).slot;
    }
    int32_t at;
    if (free_ != kNone) {
      at = free_;
      free_ = entries_[at].next[kHistory];
    } else {
      at = static_cast<int32_t>(entries_.size());
      entries_.emplace_back();  // within the reserved room while it lasts
    }
    Entry& e = entries_[at];
    e.key = key;
    e.in = 0;
    slots_.set(slot, key, at);
    ++indexed_;
    return at;
  }

  void link_last(int32_t at, int which) noexcept {
    Entry& e = entries_[at];
    List& list = lists_[which];
    e.prev[which] = list.last;
    e.next[which] = kNone;
    (list.last == kNone ? list.first : entries_[list.last].next[which]) = at;
    list.last = at;
    e.in |= static_cast<uint8_t>(1 << which);
    ++list.size;
  }

  void detach(int32_t at, int which) noexcept {
    Entry& e = entries_[at];
    List& list = lists_[which];
    (e.prev[which] == kNone ? list.first : entries_[e.prev[which]].next[which]) = e.next[which];
    (e.next[which] == kNone ? list.last : entries_[e.next[which]].prev[which]) = e.prev[which];
    e.in &= static_cast<uint8_t>(~(1 << which));
    --list.size;
  }

  void pop_oldest(int which) noexcept {
    const int32_t at = lists_[which].first;
    detach(at, which);
    drop_if_unused(at);
  }

  // Erase the entry at ``at`` from the index if it is in neither map.
  void drop_if_unused(int32_t at) noexcept {
    if (entries_[at].in != 0 || entries_[at].key == 0) return;
    if (at == limbo_) limbo_ = kNone;
    slots_.erase(slots_.slot_of(entries_[at].key, at));
    --indexed_;
    entries_[at].key = 0;
    entries_[at].next[kHistory] = free_;
    free_ = at;
  }

  HashSlots slots_;
  std::vector<Entry> entries_;  // every entry used since construction or clear()
  size_t indexed_ = 0;          // entries in the index: both maps' and the limbo entry
  int32_t free_ = kNone;
  int32_t limbo_ = kNone;  // the entry the last take() left in neither map, or kNone
  List lists_[2];          // [kHistory], [kReturned]: oldest first
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_POLICIES_HAZARD_HASHES_H_
