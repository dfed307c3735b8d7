// Engine: relocation of blocks for defragmentation (see engine.h and
// prefixcache/engine/defragment.py, the Python engine's twin; DESIGN.md,
// "Defragmentation").
//
// relocate() moves each source block's whole state (reference counts, hash,
// parent/child links, depth, registration order, access history, its place
// in the leaf heap) to a free destination block, and the source becomes
// free. The moves are disjoint swaps of a live and a free block, so the new
// state is the old one with every per-block array permuted and every link
// renamed through the same permutation: O(total_count) for the permutation,
// O(log n) per relocated leaf for the heap.

#include <numeric>
#include <string>

#include "engine.h"

namespace prefixcache {

namespace {

[[noreturn]] void fail(ErrorKind kind, std::string message) {
  throw EngineError{kind, std::move(message)};
}

}  // namespace

bool Engine::is_free(int32_t block_id) const noexcept {
  return is_unreferenced(block_id) && !is_registered(block_id);
}

void Engine::check_relocation(const int32_t* sources, const int32_t* destinations,
                              size_t count) {
  // In the Python engine's order (prefixcache/engine/defragment.py, check_moves).
  if (group_depth_) {
    fail(ErrorKind::kBlockState, "blocks cannot be relocated while a free group is open");
  }
  const uint32_t generation = next_generation();
  for (size_t i = 0; i < 2 * count; ++i) {
    const int32_t block_id = i < count ? sources[i] : destinations[i - count];
    if (stamp_[block_id] == generation) {
      fail(ErrorKind::kInvalidArgument,
           "block " + std::to_string(block_id) + " appears twice among the moves");
    }
    stamp_[block_id] = generation;
  }
  for (size_t i = 0; i < count; ++i) {
    if (is_free(sources[i])) {
      fail(ErrorKind::kBlockState,
           "source block " + std::to_string(sources[i]) + " is free; nothing to move");
    }
  }
  for (size_t i = 0; i < count; ++i) {
    if (!is_free(destinations[i])) {
      fail(ErrorKind::kBlockState, "destination block " + std::to_string(destinations[i]) +
                                       " is " + describe_state(destinations[i]) +
                                       "; moves go to free blocks");
    }
  }
}

void Engine::relocate(const int32_t* sources, const int32_t* destinations, size_t count) {
  check_relocation(sources, destinations, count);  // every check before the first write
  if (count == 0) return;
  // The policy learns each cached leaf's new ID first, in the order of the moves (the
  // Python engine's defragment.py); the destinations are free, so none is tracked.
  if (policy_) {
    for (size_t i = 0; i < count; ++i) {
      const int32_t source = sources[i];
      if (is_tracked_leaf(source)) policy_->relocate(source, destinations[i], leaf_info(source));
    }
  }
  std::vector<int32_t>& perm = scratch2_;
  perm.resize(static_cast<size_t>(total_count_));
  std::iota(perm.begin(), perm.end(), 0);
  for (size_t i = 0; i < count; ++i) {
    const int32_t source = sources[i], destination = destinations[i];
    perm[source] = destination;
    perm[destination] = source;
    std::swap(active_[source], active_[destination]);
    std::swap(paused_[source], paused_[destination]);
    std::swap(hash_of_[source], hash_of_[destination]);
    std::swap(parent_[source], parent_[destination]);
    std::swap(first_child_[source], first_child_[destination]);
    std::swap(next_sibling_[source], next_sibling_[destination]);
    std::swap(prev_sibling_[source], prev_sibling_[destination]);
    std::swap(num_children_[source], num_children_[destination]);
    std::swap(depth_[source], depth_[destination]);
    std::swap(registration_[source], registration_[destination]);
    std::swap(last_access_[source], last_access_[destination]);
    std::swap(num_accesses_[source], num_accesses_[destination]);
    std::swap(pins_[source], pins_[destination]);
    std::swap(pin_stamp_[source], pin_stamp_[destination]);
    std::swap(pin_pending_[source], pin_pending_[destination]);
    if (hash_of_[destination] != 0) {
      index_.erase(hash_of_[destination]);
      index_.insert(hash_of_[destination], destination);
    }
  }
  for (std::vector<int32_t>* links : {&parent_, &first_child_, &next_sibling_, &prev_sibling_}) {
    for (int32_t& link : *links) {
      if (link >= 0) link = perm[link];
    }
  }
  rebuild_pinned_list();
  rebuild_free_list();
}

void Engine::rebuild_free_list() {
  // Both free lists end as after reset: the lowest free ID goes out first.
  if (lowest_first_) {
    lowest_.clear();
    for (int32_t block_id = 0; block_id < num_usable_; ++block_id) {
      if (is_free(block_id)) lowest_.insert(block_id);
    }
    return;
  }
  int64_t top = 0;
  for (int32_t block_id = num_usable_; block_id-- > 0;) {
    if (is_free(block_id)) stack_[top++] = block_id;
  }
  num_free_ = top;
}

}  // namespace prefixcache
