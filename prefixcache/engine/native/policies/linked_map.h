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
// index is hash_slots.h's (8-byte slots, a miss reads the index alone), doubled when half
// full.
#ifndef PREFIXCACHE_ENGINE_NATIVE_POLICIES_LINKED_MAP_H_
#define PREFIXCACHE_ENGINE_NATIVE_POLICIES_LINKED_MAP_H_

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "hash_slots.h"

namespace prefixcache {

template <typename V>
class LinkedMap {
 public:
  /// Room for ``expected`` entries, allocated and touched now: a bounded map fills up to
  /// its bound without reallocating or faulting pages in on the way.
  explicit LinkedMap(size_t expected = 16)
      : slots_(index_capacity(expected)), entries_(expected) {}

  size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  bool contains(int64_t key) const noexcept { return find(key).entry >= 0; }

  /// Start loading the index slot that a lookup of ``key`` reads first.
  void prefetch(int64_t key) const noexcept { slots_.prefetch(key); }

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
    unlink(entry, slots_.slot_of(key, entry));
    return key;
  }

  void clear() noexcept {
    slots_.clear();
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
    return slots_.memory_bytes() + entries_.capacity() * sizeof(Entry);
  }

 private:
  static constexpr int32_t kNone = HashSlots::kNone;
  using Probe = HashSlots::Probe;

  struct Entry {
    int64_t key;
    int32_t prev, next;  // insertion order; next: the free list's link while free
    V value;
  };
  static size_t index_capacity(size_t expected) noexcept {
    size_t capacity = 16;
    while (capacity < 2 * expected) capacity <<= 1;
    return capacity;
  }

  Probe find(int64_t key) const noexcept {
    return slots_.find(key, [this](int32_t at) { return entries_[static_cast<size_t>(at)].key; });
  }

  // Add the absent ``key`` as the newest entry; ``slot``: the empty slot find() gave.
  void add(int64_t key, V value, size_t slot) {
    if (2 * (size_ + 1) > slots_.size()) {
      slots_.grow();
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
    slots_.set(slot, key, entry);
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

  // Remove ``entry``, found at index ``slot``.
  void unlink(int32_t entry, size_t slot) noexcept {
    slots_.erase(slot);
    --size_;
    detach(entry);
    entries_[entry].next = free_;
    free_ = entry;
  }

  HashSlots slots_;
  std::vector<Entry> entries_;  // entries_[used_:] unused since construction or clear()
  size_t size_ = 0;  // entries in the map
  size_t used_ = 0;  // entries_ ever used since construction or clear()
  int32_t first_ = kNone, last_ = kNone, free_ = kNone;
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_POLICIES_LINKED_MAP_H_
