// Chain pins (engine.h): a session turn references its hit chain's tail, not every block.
//
// The same state and decisions as prefixcache/engine/pins.py and the Python planner
// (eviction.py): a pin references the tail and notes on it the stamp and the access that
// full references would have written on each ancestor; plan_eviction and the last resort
// hand them to the parent when the block leaves the registry; the capacity checks leave
// out the cached ancestors of pinned tails (the bound pin_bound_ first, the walk when it
// refuses) and the last resort never takes one.

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "engine.h"

namespace prefixcache {

void Engine::pin_chain(int32_t tail, int64_t chain_length, int64_t num_queried) {
  take_hit(&tail, 1, 0, true);  // checks before it writes; nothing below throws
  if (pins_[tail]++ == 0) {
    pinned_at_[tail] = static_cast<int32_t>(pinned_list_.size());
    pinned_list_.push_back(tail);
  }
  pin_bound_ += chain_length - 1;
  ++pin_pending_[tail];
  pin_stamp_[tail] = last_access_[tail];
  counters_.num_queried += num_queried;
  counters_.num_hits += chain_length - 1;
}

void Engine::release_pinned(const int32_t* ids, size_t count, int64_t chain_length) {
  const int32_t tail = ids[0];
  if (pins_[tail] == 0) {
    throw EngineError{ErrorKind::kBlockState,
                      "block " + std::to_string(tail) + " is not a pinned chain's tail"};
  }
  release(ids, count, false);  // checks the counts before it writes
  if (--pins_[tail] == 0) {  // swap-remove from the pinned tails
    const int32_t last = pinned_list_.back();
    pinned_list_[static_cast<size_t>(pinned_at_[tail])] = last;
    pinned_at_[last] = pinned_at_[tail];
    pinned_list_.pop_back();
    pinned_at_[tail] = -1;
  }
  pin_bound_ -= chain_length - 1;
  counters_.num_released += chain_length - 1;
}

int64_t Engine::num_reserved(const int32_t* ids, size_t count) {
  const uint32_t seen = next_generation();
  int64_t reserved = 0;
  if (pin_bound_) {
    for (const int32_t tail : pinned_list_) {
      for (int32_t block_id = parent_[tail]; block_id != kRoot && stamp_[block_id] != seen;
           block_id = parent_[block_id]) {
        stamp_[block_id] = seen;
        reserved += is_unreferenced(block_id);
      }
    }
  }
  for (size_t i = 0; i < count; ++i) {
    if (stamp_[ids[i]] == seen) continue;
    stamp_[ids[i]] = seen;
    reserved += is_unreferenced(ids[i]);
  }
  return reserved;
}

int64_t Engine::reclaimable(const int32_t* ids, size_t count) {
  return num_free_ + num_cached_ - num_reserved(ids, count);
}

int64_t Engine::num_evictable(int64_t num_blocks) {
  if (num_blocks <= num_cached_ - pin_bound_) return num_blocks;  // O(1): the bound suffices
  return std::min(num_blocks, num_cached_ - num_reserved(nullptr, 0));
}

std::vector<std::pair<int32_t, int32_t>> Engine::pinned_tails() const {
  std::vector<std::pair<int32_t, int32_t>> tails;
  tails.reserve(pinned_list_.size());
  for (const int32_t block_id : pinned_list_) tails.emplace_back(block_id, pins_[block_id]);
  std::sort(tails.begin(), tails.end());  // by ID, as the scan of pins_ gave them
  return tails;
}

void Engine::rebuild_pinned_list() {
  pinned_list_.clear();
  std::fill(pinned_at_.begin(), pinned_at_.end(), -1);
  for (int32_t block_id = 0; block_id < static_cast<int32_t>(pins_.size()); ++block_id) {
    if (!pins_[block_id]) continue;
    pinned_at_[block_id] = static_cast<int32_t>(pinned_list_.size());
    pinned_list_.push_back(block_id);
  }
}

void Engine::hand_down(int32_t block_id, int32_t parent_id) noexcept {
  const int64_t stamp = pin_stamp_[block_id], owed = pin_pending_[block_id];
  last_access_[parent_id] = std::max(last_access_[parent_id], stamp);
  pin_stamp_[parent_id] = std::max(pin_stamp_[parent_id], stamp);
  num_accesses_[parent_id] += owed;
  pin_pending_[parent_id] += owed;
}

int64_t Engine::effective_stamp(int32_t block_id) {
  std::vector<int32_t> order;
  subtree(block_id, order);  // excludes nothing a candidate's subtree holds
  int64_t stamp = last_access_[block_id];
  for (const int32_t member : order) stamp = std::max(stamp, pin_stamp_[member]);
  return stamp;
}

}  // namespace prefixcache
