// Engine::evict_blocks: free given cached leaves tail-first, for a conversation's end
// (DESIGN.md, "Scheduler hints"). The Python engine's is EvictionPlanner.plan_blocks
// (prefixcache/engine/eviction.py) with PythonEvictionSteps.evict_blocks: the same policy
// calls in the same order, the same hand-downs, free-stack pushes and removed hashes.

#include <cstdint>
#include <vector>

#include "engine.h"

namespace prefixcache {

int64_t Engine::evict_blocks(const int32_t* ids, size_t count) {
  // IDs are in [0, num_usable) (checked by the binding). Nothing after the first change
  // throws but a Python policy's hook, which the binding's PolicyTransaction takes back: the
  // scratch vectors get their room (the only allocation) before the walk.
  if (!policy_ || count == 0) return 0;
  std::vector<int32_t>& freed = scratch_;
  freed.clear();
  ended_hashes_.clear();
  freed.reserve(count);
  ended_hashes_.reserve(count);
  int32_t held_back = kRoot;  // an exposed parent that is the walk's next ID: kept from the policy
  for (size_t index = count; index-- > 0;) {
    const int32_t block_id = ids[index];
    // Freed blocks are deregistered as the walk goes: a repeat reads as unregistered.
    if (!is_registered(block_id) || !is_unreferenced(block_id) || num_children_[block_id] != 0) {
      continue;
    }
    if (block_id != held_back) policy_->discard(block_id);
    held_back = kRoot;
    freed.push_back(block_id);
    ended_hashes_.push_back(hash_of_[block_id]);
    const int32_t parent_id = parent_[block_id];
    deregister_leaf(block_id);
    if (parent_id != kRoot && pin_pending_[block_id]) hand_down(block_id, parent_id);
    if (parent_id != kRoot && num_children_[parent_id] == 0 && is_unreferenced(parent_id)) {
      if (index > 0 && ids[index - 1] == parent_id) {
        held_back = parent_id;
      } else {
        policy_->insert(parent_id, leaf_info(parent_id));
      }
    }
  }
  for (const int32_t block_id : freed) push_free(block_id);
  if (!freed.empty()) policy_->on_end(ended_hashes_.data(), ended_hashes_.size());
  const auto num_freed = static_cast<int64_t>(freed.size());
  num_cached_ -= num_freed;
  counters_.num_evicted += num_freed;
  return num_freed;
}

}  // namespace prefixcache
