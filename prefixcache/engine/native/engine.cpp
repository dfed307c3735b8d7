// Engine: construction, allocation, release and eviction (see engine.h).
//
// References and partitions are in engine_references.cpp; registration, the fused request
// path, reset and the invariant check in engine_registry.cpp.

#include "engine.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

namespace prefixcache {

namespace {

[[noreturn]] void fail(ErrorKind kind, std::string message) {
  throw EngineError{kind, std::move(message)};
}

}  // namespace

Engine::Engine(int32_t total_count, int32_t paused_count, std::unique_ptr<Policy> policy,
               bool track_changes, bool lowest_first, int32_t page_size)
    : total_count_(total_count),
      num_usable_(total_count - 1),
      paused_count_(paused_count),
      track_changes_(track_changes),
      lowest_first_(lowest_first),
      stack_(lowest_first ? 0 : static_cast<size_t>(total_count - 1)),
      lowest_(lowest_first ? static_cast<size_t>(total_count - 1) : 0, page_size),
      active_(total_count, 0),
      paused_(total_count, 0),
      pending_(total_count, 0),
      index_(static_cast<size_t>(total_count)),
      hash_of_(total_count, 0),
      parent_(total_count, kRoot),
      first_child_(total_count, kRoot),
      next_sibling_(total_count, kRoot),
      prev_sibling_(total_count, kRoot),
      num_children_(total_count, 0),
      depth_(total_count, 0),
      registration_(total_count, 0),
      last_access_(total_count, 0),
      num_accesses_(total_count, 0),
      pins_(total_count, 0),
      pin_stamp_(total_count, 0),
      pin_pending_(total_count, 0),
      pinned_at_(total_count, -1),
      stamp_(total_count, 0),
      slot_(total_count, 0) {
  policy_ = std::move(policy);
  if (policy_) policy_->bind(&view_);
  reset();
}

uint32_t Engine::next_generation() noexcept {
  if (++generation_ == 0) {  // wrapped: forget every old stamp
    std::fill(stamp_.begin(), stamp_.end(), 0u);
    generation_ = 1;
  }
  return generation_;
}

void Engine::count_occurrences(const int32_t* ids, size_t count) {
  unique_.clear();
  counts_.clear();
  const uint32_t generation = next_generation();
  bool repeated = false;
  for (size_t i = 0; i < count; ++i) {
    const int32_t block_id = ids[i];
    if (stamp_[block_id] != generation) {
      stamp_[block_id] = generation;
      slot_[block_id] = static_cast<int32_t>(unique_.size());
      unique_.push_back(block_id);
      counts_.push_back(1);
    } else {
      ++counts_[slot_[block_id]];
      repeated = true;
    }
  }
  if (!repeated) {  // the common case: one each, in the caller's order
    counts_.clear();
    return;
  }
  held_.assign(counts_.begin(), counts_.end());  // counts by first occurrence
  std::sort(unique_.begin(), unique_.end());     // numpy.unique's order
  for (size_t j = 0; j < unique_.size(); ++j) counts_[j] = held_[slot_[unique_[j]]];
}

const char* Engine::describe_state(int32_t block_id) const noexcept {
  if (active_[block_id] > 0) return "active";
  if (paused_[block_id] > 0) return "paused";
  return is_registered(block_id) ? "cached" : "free";
}

void Engine::push_free(int32_t block_id) noexcept {
  if (lowest_first_) {
    lowest_.insert(block_id);
    ++num_free_;
  } else {
    stack_[num_free_++] = block_id;
  }
  if (track_changes_) changed_free_.push_back(block_id);
}

// ------------------------------------------------------------------ allocation

bool Engine::allocate(int64_t num_blocks, int32_t* out) {
  const int64_t shortfall = num_blocks - num_free_;
  if (shortfall > 0 && shortfall > num_evictable(shortfall)) return false;
  int64_t filled = 0;
  if (shortfall > 0) {
    // Evicted blocks go straight to the caller, in the order that pushing them
    // on the stack and popping would give.
    std::vector<int32_t>& freed = scratch_;
    freed.clear();
    plan_eviction(shortfall, freed);
    if (lowest_first_) {  // through the free set: it picks the order (the Python engine's)
      for (const int32_t block_id : freed) lowest_.insert(block_id);
      num_free_ += static_cast<int64_t>(freed.size());
    } else {
      for (size_t i = freed.size(); i-- > 0;) out[filled++] = freed[i];
    }
  }
  if (lowest_first_) {
    num_free_ -= num_blocks - filled;
    lowest_.take(num_blocks - filled, out + filled);
  } else {
    while (filled < num_blocks) out[filled++] = stack_[--num_free_];
  }
  ++counters_.clock;
  for (int64_t i = 0; i < num_blocks; ++i) active_[out[i]] = 1;
  num_active_ += num_blocks;
  counters_.num_allocated += num_blocks;
  return true;
}

void Engine::release(const int32_t* ids, size_t count, bool paused) {
  if (count == 0) return;
  // The fast path caches or frees what it drops; ref-zero's subtree drops take the general one.
  if (!paused && !group_depth_ && (policy_ || index_.size() == 0) &&
      release_distinct(ids, count)) {
    return;
  }
  if (group_depth_ && !paused) {
    count_occurrences(ids, count);
    queue_release();
    return;
  }
  count_occurrences(ids, count);
  const std::vector<int32_t>& refs = paused ? paused_ : active_;
  for (size_t j = 0; j < unique_.size(); ++j) {
    const int32_t asked = counts_.empty() ? 1 : counts_[j];
    const int32_t block_id = unique_[j];
    if (refs[block_id] < asked) {
      fail(ErrorKind::kReferenceCount,
           "block " + std::to_string(block_id) + " (" + describe_state(block_id) + ") holds " +
               std::to_string(refs[block_id]) + (paused ? " paused" : " active") +
               " reference(s); asked to drop " + std::to_string(asked));
    }
  }
  drop_references(paused);
}

bool Engine::release_distinct(const int32_t* ids, size_t count) {
  // release's check (an active reference to drop) and the repeat test, in one pass without
  // branches. Raw pointers: nothing below resizes the arrays (a policy cannot).
  uint32_t* const stamp = stamp_.data();
  int32_t* const active = active_.data();
  const uint32_t generation = next_generation();
  bool fine = true;
  for (size_t i = 0; i < count; ++i) {
    const int32_t block_id = ids[i];
    fine &= (stamp[block_id] != generation) & (active[block_id] > 0);
    stamp[block_id] = generation;
  }
  if (!fine) return false;
  // drop_references and on_unreferenced in one pass: of the blocks left unreferenced, the
  // hashed leaves go to the policy in release order, then the unhashed to the free list.
  const int32_t* const paused = paused_.data();
  const int64_t* const hash_of = hash_of_.data();
  const int32_t* const num_children = num_children_.data();
  std::vector<int32_t>& leaves = hashed_;
  std::vector<int32_t>& unhashed = unhashed_;
  leaves.clear();
  unhashed.clear();
  int64_t emptied = 0, still_held = 0, cached = 0;
  for (size_t i = 0; i < count; ++i) {
    const int32_t block_id = ids[i];
    if (--active[block_id] != 0) continue;
    ++emptied;
    if (paused[block_id]) {
      ++still_held;
    } else if (hash_of[block_id] != 0) {  // only with a policy: see release
      ++cached;
      if (num_children[block_id] == 0) leaves.push_back(block_id);
    } else {
      unhashed.push_back(block_id);
    }
  }
  counters_.num_released += static_cast<int64_t>(count);
  for (const int32_t block_id : leaves) insert_leaf(block_id);
  for (const int32_t block_id : unhashed) push_free(block_id);
  num_cached_ += cached;
  num_active_ -= emptied;
  num_paused_ += still_held;
  return true;
}

void Engine::queue_release() {
  for (size_t j = 0; j < unique_.size(); ++j) {
    const int32_t asked = counts_.empty() ? 1 : counts_[j];
    const int32_t block_id = unique_[j];
    const int32_t available = active_[block_id] - pending_[block_id];
    if (available < asked) {
      fail(ErrorKind::kReferenceCount,
           "block " + std::to_string(block_id) + " (" + describe_state(block_id) + ") holds " +
               std::to_string(available) +
               " active (after queued releases) reference(s); asked to drop " +
               std::to_string(asked));
    }
  }
  for (size_t j = 0; j < unique_.size(); ++j) {
    const int32_t block_id = unique_[j];
    if (pending_[block_id] == 0) pending_blocks_.push_back(block_id);
    pending_[block_id] += counts_.empty() ? 1 : counts_[j];
  }
}

void Engine::close_group() {
  if (group_depth_ == 0) fail(ErrorKind::kInvalidArgument, "close_group without open_group");
  if (--group_depth_ == 0) flush_releases();
}

void Engine::flush_releases() {
  if (pending_blocks_.empty()) return;
  std::sort(pending_blocks_.begin(), pending_blocks_.end());
  unique_.assign(pending_blocks_.begin(), pending_blocks_.end());
  counts_.resize(unique_.size());
  for (size_t j = 0; j < unique_.size(); ++j) {
    counts_[j] = pending_[unique_[j]];
    pending_[unique_[j]] = 0;
  }
  pending_blocks_.clear();
  if (counts_.size() == 1 && counts_[0] == 1) counts_.clear();  // same effect, one each
  drop_references(false);
}

void Engine::drop_references(bool paused) {
  std::vector<int32_t>& refs = paused ? paused_ : active_;
  const std::vector<int32_t>& other = paused ? active_ : paused_;
  std::vector<int32_t>& emptied = scratch_;
  emptied.clear();
  int64_t released = 0;
  for (size_t j = 0; j < unique_.size(); ++j) {
    const int32_t block_id = unique_[j];
    const int32_t count = counts_.empty() ? 1 : counts_[j];
    released += count;
    if ((refs[block_id] -= count) == 0) emptied.push_back(block_id);
  }
  counters_.num_released += released;
  if (emptied.empty()) return;
  std::vector<int32_t>& unreferenced = scratch2_;
  unreferenced.clear();
  int64_t still_held = 0;
  for (const int32_t block_id : emptied) {
    if (other[block_id]) {
      ++still_held;
    } else {
      unreferenced.push_back(block_id);
    }
  }
  const int64_t num_emptied = static_cast<int64_t>(emptied.size());
  if (!unreferenced.empty()) on_unreferenced(unreferenced);
  if (paused) {  // still-active blocks do not change state; the rest were paused
    num_paused_ -= num_emptied - still_held;
    num_holding_paused_ -= num_emptied;
  } else {  // blocks with paused references become paused
    num_active_ -= num_emptied;
    num_paused_ += still_held;
  }
}

void Engine::on_unreferenced(const std::vector<int32_t>& block_ids) {
  if (index_.size() == 0) {  // always so with prefix caching off
    for (const int32_t block_id : block_ids) push_free(block_id);
    return;
  }
  std::vector<int32_t>& hashed = hashed_;
  std::vector<int32_t>& unhashed = unhashed_;
  hashed.clear();
  unhashed.clear();
  for (const int32_t block_id : block_ids) {
    (is_registered(block_id) ? hashed : unhashed).push_back(block_id);
  }
  if (hashed.empty()) {
    for (const int32_t block_id : unhashed) push_free(block_id);
  } else if (retains_unreferenced()) {
    for (const int32_t block_id : hashed) {
      if (num_children_[block_id] == 0) insert_leaf(block_id);
    }
    for (const int32_t block_id : unhashed) push_free(block_id);
    num_cached_ += static_cast<int64_t>(hashed.size());
  } else {
    drop_blocks(hashed, unhashed);
  }
}

void Engine::drop_blocks(const std::vector<int32_t>& hashed, const std::vector<int32_t>& unhashed) {
  // Ref-zero: each hashed block takes its registered descendants' hashes with it.
  const uint32_t gone = next_generation();
  std::vector<int32_t> dropped, order;
  for (const int32_t block_id : hashed) {
    if (stamp_[block_id] == gone) continue;
    subtree(block_id, order);
    for (const int32_t member : order) stamp_[member] = gone;
    dropped.insert(dropped.end(), order.begin(), order.end());
  }
  int64_t num_freed = 0;
  for (const int32_t block_id : unhashed) push_free(block_id);
  for (const int32_t block_id : dropped) {
    if (is_unreferenced(block_id)) {
      push_free(block_id);
      ++num_freed;
    }
  }
  for (const int32_t block_id : dropped) deregister_leaf(block_id);
  counters_.num_dropped += num_freed;
}

void Engine::subtree(int32_t root_id, std::vector<int32_t>& order) {
  // Children first, in exactly the Python planner's order (a stack popped from
  // the end, each block's children pushed in list order, then reversed).
  const uint32_t gone = generation_;
  order.clear();
  std::vector<int32_t>& stack = stack_scratch_;
  stack.clear();
  stack.push_back(root_id);
  while (!stack.empty()) {
    const int32_t block_id = stack.back();
    stack.pop_back();
    order.push_back(block_id);
    for (int32_t child = first_child_[block_id]; child != kRoot; child = next_sibling_[child]) {
      if (stamp_[child] != gone) stack.push_back(child);
    }
  }
  std::reverse(order.begin(), order.end());
}

// ------------------------------------------------------------------ eviction

int64_t Engine::evict(int64_t num_blocks) {
  const int64_t count = num_evictable(std::min(num_blocks, num_cached_));
  if (count <= 0) return 0;
  std::vector<int32_t>& freed = scratch_;
  freed.clear();
  plan_eviction(count, freed);
  for (const int32_t block_id : freed) push_free(block_id);
  return count;
}

void Engine::plan_eviction(int64_t num_blocks, std::vector<int32_t>& freed) {
  // Victims one at a time, as the Python planner (eviction.py) asks for them: evicting a
  // leaf may expose its parent, which then competes with the other leaves for the next
  // slot, unless the policy says it would evict it next (evicts_first): then it is.
  int32_t next_victim = kRoot;
  while (static_cast<int64_t>(freed.size()) < num_blocks) {
    int32_t block_id = next_victim;
    next_victim = kRoot;
    if (block_id == kRoot) block_id = policy_->evict_one();
    if (block_id == kNoBlock) block_id = drop_pinned_subtree();
    freed.push_back(block_id);
    const int32_t parent_id = parent_[block_id];
    deregister_leaf(block_id);
    if (parent_id != kRoot && pin_pending_[block_id]) hand_down(block_id, parent_id);
    if (parent_id != kRoot && num_children_[parent_id] == 0 && is_unreferenced(parent_id)) {
      const LeafInfo leaf = leaf_info(parent_id);
      if (static_cast<int64_t>(freed.size()) < num_blocks &&
          policy_->evicts_first(parent_id, leaf)) {
        next_victim = parent_id;
      } else {
        policy_->insert(parent_id, leaf);
      }
    }
  }
  num_cached_ -= num_blocks;
  counters_.num_evicted += num_blocks;
}

int32_t Engine::drop_pinned_subtree() {
  // No cached leaf is left: the deepest cached block with children (pinned
  // below by a referenced descendant) goes with its subtree; among equals the
  // least recently used, then the lowest ID. A pinned chain's ancestors are never
  // taken (full references would hold them). O(total_count), rare.
  const bool pinned = pin_bound_ > 0;
  if (pinned) num_reserved(nullptr, 0);  // stamps the pinned chains' ancestors
  const uint32_t kept = generation_;
  bool owed = false;  // a pin owes some block its stamp: compare the stamps it gives
  for (int32_t block_id = 0; block_id < num_usable_ && !owed; ++block_id) {
    owed = pin_pending_[block_id] != 0;
  }
  int32_t best = kRoot;
  int64_t best_stamp = 0;
  for (int32_t block_id = 0; block_id < num_usable_; ++block_id) {
    if (!is_registered(block_id) || !is_unreferenced(block_id) || num_children_[block_id] == 0 ||
        (pinned && stamp_[block_id] == kept)) {
      continue;
    }
    if (best != kRoot && depth_[block_id] < depth_[best]) continue;
    const int64_t stamp = owed ? effective_stamp(block_id) : last_access_[block_id];
    if (best == kRoot || depth_[block_id] > depth_[best] || stamp < best_stamp) {
      best = block_id;
      best_stamp = stamp;
    }
  }
  if (best == kRoot) {
    fail(ErrorKind::kInvariant, "the native policy has no leaf to evict, yet cached blocks remain");
  }
  next_generation();  // nothing is excluded from the subtree
  std::vector<int32_t> order;
  subtree(best, order);
  int64_t cached = 0;
  for (const int32_t block_id : order) cached += is_unreferenced(block_id);
  if (cached != 1) {
    fail(ErrorKind::kInvariant, "the subtree of pinned block " + std::to_string(best) +
                                    " holds cached blocks below it");
  }
  for (size_t i = 0; i + 1 < order.size(); ++i) {
    if (pin_pending_[order[i]]) hand_down(order[i], best);  // its pins owe best, then its parent
    deregister_leaf(order[i]);
  }
  return best;
}

}  // namespace prefixcache
