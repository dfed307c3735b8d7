// Engine: the hash registry, registration, the fused request path, reset and
// the invariant check (see engine.h).

#include <algorithm>
#include <string>

#include "engine.h"

namespace prefixcache {

namespace {

[[noreturn]] void fail(ErrorKind kind, std::string message) {
  throw EngineError{kind, std::move(message)};
}

}  // namespace

// ------------------------------------------------------------------ registry links

void Engine::link_child(int32_t parent_id, int32_t child_id) noexcept {
  const int32_t head = first_child_[parent_id];
  next_sibling_[child_id] = head;
  prev_sibling_[child_id] = kRoot;
  if (head != kRoot) prev_sibling_[head] = child_id;
  first_child_[parent_id] = child_id;
}

void Engine::unlink_child(int32_t parent_id, int32_t child_id) noexcept {
  const int32_t before = prev_sibling_[child_id];
  const int32_t after = next_sibling_[child_id];
  if (before == kRoot) {
    first_child_[parent_id] = after;
  } else {
    next_sibling_[before] = after;
  }
  if (after != kRoot) prev_sibling_[after] = before;
  next_sibling_[child_id] = prev_sibling_[child_id] = kRoot;
}

void Engine::register_block(int32_t block_id, int64_t block_hash, int32_t parent_id) {
  index_.insert(block_hash, block_id);
  hash_of_[block_id] = block_hash;
  parent_[block_id] = parent_id;
  registration_[block_id] = ++num_registrations_;
  if (parent_id == kRoot) {
    depth_[block_id] = 0;
  } else {
    depth_[block_id] = depth_[parent_id] + 1;
    ++num_children_[parent_id];
    link_child(parent_id, block_id);
  }
  // A block's cache life starts here: allocation leaves these untouched.
  last_access_[block_id] = counters_.clock;
  num_accesses_[block_id] = 1;
  pin_stamp_[block_id] = pin_pending_[block_id] = 0;
}

void Engine::deregister_leaf(int32_t block_id) {
  const int64_t block_hash = hash_of_[block_id];
  index_.erase(block_hash);
  hash_of_[block_id] = 0;
  const int32_t parent_id = parent_[block_id];
  parent_[block_id] = kRoot;
  if (parent_id != kRoot) {
    --num_children_[parent_id];
    unlink_child(parent_id, block_id);
  }
  if (track_changes_) removed_hashes_.push_back(block_hash);
}

bool Engine::is_tracked_leaf(int32_t block_id) const noexcept {
  return block_id != kRoot && retains_unreferenced() && is_registered(block_id) &&
         num_children_[block_id] == 0 && is_unreferenced(block_id);
}

size_t Engine::lookup(const int64_t* hashes, size_t count, int32_t* out) const noexcept {
  // The longest registered prefix; equals the Python registry's binary search
  // followed by its cut at the first hash with no block.
  size_t matched = 0;
  while (matched < count) {
    const int64_t block_hash = hashes[matched];
    const int32_t block_id = block_hash == 0 ? -1 : index_.find(block_hash);
    if (block_id < 0) break;
    out[matched++] = block_id;
  }
  return matched;
}

std::vector<int32_t> Engine::registered_in_order() const {
  std::vector<int32_t> blocks;
  blocks.reserve(index_.size());
  for (int32_t block_id = 0; block_id < num_usable_; ++block_id) {
    if (is_registered(block_id)) blocks.push_back(block_id);
  }
  std::sort(blocks.begin(), blocks.end(), [this](int32_t a, int32_t b) {
    return depth_[a] < depth_[b] || (depth_[a] == depth_[b] && registration_[a] < registration_[b]);
  });
  return blocks;
}

// ------------------------------------------------------------------ registration

void Engine::register_chain(const int32_t* ids, const int64_t* hashes, size_t count,
                            bool has_parent, int64_t parent_hash, uint8_t* holds,
                            uint8_t* is_new) {
  for (size_t i = 0; i < count; ++i) {
    if (is_unreferenced(ids[i])) {
      fail(ErrorKind::kBlockState, "block " + std::to_string(ids[i]) + " (" +
                                       describe_state(ids[i]) +
                                       ") is not referenced; register blocks while a request "
                                       "holds them");
    }
  }
  int32_t parent_id = kRoot;
  if (has_parent) {
    parent_id = parent_hash == 0 ? -1 : index_.find(parent_hash);
    if (parent_id < 0) {
      fail(ErrorKind::kHashConflict,
           "parent hash " + std::to_string(parent_hash) + " is not registered");
    }
  }
  // Every conflict is found before anything changes.
  const uint32_t generation = next_generation();
  for (size_t i = 0; i < count; ++i) {
    index_.prefetch_insert(hashes[i]);  // the loop below probes these slots
    const int32_t block_id = ids[i];
    const int64_t current = hash_of_[block_id];
    if (current != 0 && current != hashes[i]) {
      fail(ErrorKind::kHashConflict, "block " + std::to_string(block_id) +
                                         " already carries hash " + std::to_string(current) +
                                         "; cannot register " + std::to_string(hashes[i]));
    }
    if (stamp_[block_id] == generation) {
      const int64_t first = hashes[slot_[block_id]];
      if (first != hashes[i]) {
        fail(ErrorKind::kHashConflict, "block " + std::to_string(block_id) +
                                           " appears twice with different hashes (" +
                                           std::to_string(first) + " and " +
                                           std::to_string(hashes[i]) + ")");
      }
    } else {
      stamp_[block_id] = generation;
      slot_[block_id] = static_cast<int32_t>(i);
    }
  }
  // A hash already held (by another block, or earlier in this chain) keeps its
  // holder and the chain continues under it; a parent that gains its first
  // child stops being a cached leaf.
  leaves_.clear();
  int32_t previous = parent_id;
  for (size_t i = 0; i < count; ++i) {
    const int32_t block_id = ids[i];
    int32_t holder = index_.find(hashes[i]);
    const bool fresh = holder < 0;
    if (fresh) {
      if (previous != kRoot && is_tracked_leaf(previous)) leaves_.push_back(previous);
      register_block(block_id, hashes[i], previous);
      holder = block_id;
    }
    holds[i] = holder == block_id;
    is_new[i] = fresh;
    previous = holder;
  }
  if (policy_) notify_registrations(ids, hashes, is_new, count);
}

void Engine::notify_registrations(const int32_t* ids, const int64_t* hashes,
                                  const uint8_t* is_new, size_t count) {
  // The Python engine's order (registration.py): on_register once per run of consecutive
  // new positions, then the parents that gained a child leave the policy, in chain order.
  for (size_t start = 0; start < count;) {
    if (!is_new[start]) {
      ++start;
      continue;
    }
    size_t end = start;
    while (end < count && is_new[end]) ++end;
    policy_->on_register(hashes + start, end - start, depth_[ids[start]]);
    start = end;
  }
  for (const int32_t block_id : leaves_) policy_->discard(block_id);
}

void Engine::report_hit(const int32_t* ids, size_t count) {
  // The Python engine's take_hit: on_hit(hashes of the matched blocks), in match order.
  hit_hashes_.resize(count);
  for (size_t i = 0; i < count; ++i) hit_hashes_[i] = hash_of_[ids[i]];
  policy_->on_hit(hit_hashes_.data(), count);
}

// ------------------------------------------------------------------ fused request path

int64_t Engine::admit(const int64_t* hashes, size_t num_full, size_t num_matchable,
                      size_t num_blocks, int32_t* out_row) {
  // Match, then check that the rest fits once the hits leave the cache, all
  // before any change: a request that cannot be admitted changes nothing.
  hits_.resize(num_matchable);
  const size_t num_hit = lookup(hashes, num_matchable, hits_.data());
  const int64_t needed = static_cast<int64_t>(num_blocks - num_hit);
  int64_t cached_hits = 0;
  if (num_hit) {
    // A chain (each block the parent of the next) repeats no block, which
    // spares the duplicate scan; a hash collision may break the chain.
    bool chain = true;
    for (size_t i = 1; i < num_hit && chain; ++i) chain = parent_[hits_[i]] == hits_[i - 1];
    if (chain) {
      unique_.assign(hits_.begin(), hits_.begin() + static_cast<std::ptrdiff_t>(num_hit));
      counts_.clear();
    } else {
      count_occurrences(hits_.data(), num_hit);
    }
    for (const int32_t block_id : unique_) cached_hits += is_unreferenced(block_id);
  }
  int64_t room = num_free_ + num_cached_ - cached_hits;
  if (pin_bound_ && needed > room - pin_bound_) {  // pinned chains keep their cached blocks
    room = num_free_ + num_cached_ - num_reserved(unique_.data(), num_hit ? unique_.size() : 0);
  }
  if (needed > room) {
    fail(ErrorKind::kCapacity, "request needs " + std::to_string(needed) + " blocks; " +
                                   std::to_string(room) + " can be freed");
  }
  if (num_hit) check_headroom(active_, "active");
  counters_.num_queried += static_cast<int64_t>(num_matchable);
  counters_.num_hits += static_cast<int64_t>(num_hit);
  if (num_hit) take_references();  // unique_ and counts_ are the hits'
  // on_hit (take_hit's report_hit): the matched keys are the hits' hashes (index_.find).
  if (num_hit && policy_ && policy_->uses_on_hit()) policy_->on_hit(hashes, num_hit);
  std::copy(hits_.begin(), hits_.begin() + static_cast<std::ptrdiff_t>(num_hit), out_row);
  allocate(needed, out_row + num_hit);
  if (num_full > num_hit) {
    const size_t count = num_full - num_hit;
    flags_.resize(2 * count);
    register_chain(out_row + num_hit, hashes + num_hit, count, num_hit > 0,
                   num_hit ? hashes[num_hit - 1] : 0, flags_.data(), flags_.data() + count);
  }
  return static_cast<int64_t>(num_hit);
}

// ------------------------------------------------------------------ reset and checks

void Engine::reset_counters() noexcept {
  counters_ = Counters{};
  num_active_ = num_paused_ = num_cached_ = num_holding_paused_ = 0;
}

void Engine::reset() {
  if (policy_) policy_->clear();
  if (lowest_first_) {
    lowest_.clear();
    for (int32_t i = 0; i < num_usable_; ++i) lowest_.insert(i);
  } else {
    for (int32_t i = 0; i < num_usable_; ++i) stack_[i] = num_usable_ - 1 - i;  // ID 0 on top
  }
  num_free_ = num_usable_;
  index_.clear();
  std::fill(hash_of_.begin(), hash_of_.end(), 0);
  std::fill(parent_.begin(), parent_.end(), kRoot);
  std::fill(first_child_.begin(), first_child_.end(), kRoot);
  std::fill(next_sibling_.begin(), next_sibling_.end(), kRoot);
  std::fill(prev_sibling_.begin(), prev_sibling_.end(), kRoot);
  std::fill(num_children_.begin(), num_children_.end(), 0);
  std::fill(depth_.begin(), depth_.end(), 0);
  std::fill(registration_.begin(), registration_.end(), 0);
  std::fill(active_.begin(), active_.end(), 0);
  std::fill(paused_.begin(), paused_.end(), 0);
  std::fill(pending_.begin(), pending_.end(), 0);
  std::fill(last_access_.begin(), last_access_.end(), 0);
  std::fill(num_accesses_.begin(), num_accesses_.end(), 0);
  std::fill(pins_.begin(), pins_.end(), 0);
  std::fill(pin_stamp_.begin(), pin_stamp_.end(), 0);
  std::fill(pin_pending_.begin(), pin_pending_.end(), 0);
  pin_bound_ = 0;
  rebuild_pinned_list();
  pending_blocks_.clear();
  // num_registrations_ keeps counting: a generation is never handed out twice (sessions).
  changed_free_.clear();
  removed_hashes_.clear();
  reset_counters();
}

std::vector<std::string> Engine::find_problems() const {
  std::vector<std::string> problems;
  const int32_t dummy = num_usable_;
  if (active_[dummy] || paused_[dummy] || is_registered(dummy)) {
    problems.push_back("dummy block " + std::to_string(dummy) + " is referenced or registered");
  }
  std::vector<uint8_t> on_stack(num_usable_, 0);
  std::vector<int32_t> free;
  free_ids(free);
  if (static_cast<int64_t>(free.size()) != num_free_) {
    problems.push_back("the free list holds " + std::to_string(free.size()) + " IDs, num_free " +
                       std::to_string(num_free_));
  }
  for (const int32_t block_id : free) {
    if (block_id < 0 || block_id >= num_usable_) {
      problems.push_back("the free stack holds " + std::to_string(block_id));
      continue;
    }
    if (on_stack[block_id]) problems.push_back("a block is on the free stack twice");
    on_stack[block_id] = 1;
  }
  int64_t num_active = 0, num_paused = 0, num_cached = 0, num_leaves = 0, num_registered = 0;
  int64_t num_holding_paused = 0;
  std::vector<int32_t> children(total_count_, 0);
  for (int32_t block_id = 0; block_id < num_usable_; ++block_id) {
    const int32_t active = active_[block_id], paused = paused_[block_id];
    if (active < 0 || paused < 0) problems.push_back("a reference count is negative");
    const bool registered = is_registered(block_id);
    const bool is_free = active <= 0 && paused <= 0 && !registered;
    if (static_cast<bool>(on_stack[block_id]) != is_free) {
      problems.push_back("block " + std::to_string(block_id) + ": on free stack=" +
                         std::to_string(on_stack[block_id]) + " but free=" +
                         std::to_string(is_free));
    }
    num_active += active > 0;
    num_paused += active <= 0 && paused > 0;
    num_holding_paused += paused > 0;
    const bool cached = active <= 0 && paused <= 0 && registered;
    num_cached += cached;
    if (registered) {
      ++num_registered;
      if (index_.find(hash_of_[block_id]) != block_id) {
        problems.push_back("block " + std::to_string(block_id) + " carries a hash that maps "
                           "elsewhere");
      }
      const int32_t parent_id = parent_[block_id];
      if (parent_id != kRoot) {
        if (!is_registered(parent_id)) {
          problems.push_back("block " + std::to_string(block_id) +
                             " is registered under unregistered parent " +
                             std::to_string(parent_id));
        }
        ++children[parent_id];
      }
    }
    const bool leaf = cached && num_children_[block_id] == 0;
    num_leaves += leaf;
    if (policy_ && block_id < num_usable_ && leaf != policy_->contains(block_id)) {
      problems.push_back("block " + std::to_string(block_id) + ": cached leaf=" +
                         std::to_string(leaf) + " but tracked=" +
                         std::to_string(policy_->contains(block_id)));
    }
  }
  const struct { const char* name; int64_t counted, counter; } partitions[] = {
      {"active", num_active, num_active_},
      {"paused", num_paused, num_paused_},
      {"cached", num_cached, num_cached_},
      {"paused-holding", num_holding_paused, num_holding_paused_},
  };
  for (const auto& p : partitions) {
    if (p.counted != p.counter) {
      problems.push_back(std::string(p.name) + " counter " + std::to_string(p.counter) + " but " +
                         std::to_string(p.counted) + " " + p.name + " blocks");
    }
  }
  if (num_holding_paused_ > paused_count_) {
    problems.push_back(std::to_string(num_holding_paused_) +
                       " blocks hold paused references over a paused budget of " +
                       std::to_string(paused_count_));
  }
  if (num_paused_ > num_holding_paused_) {
    problems.push_back(std::to_string(num_paused_) + " paused-only blocks but only " +
                       std::to_string(num_holding_paused_) + " hold paused references");
  }
  const int64_t total = num_free_ + num_active_ + num_paused_ + num_cached_;
  if (total != num_usable_) {
    problems.push_back("free+active+paused+cached = " + std::to_string(total) +
                       ", usable = " + std::to_string(num_usable_));
  }
  if (num_registered != static_cast<int64_t>(index_.size())) {
    problems.push_back(std::to_string(num_registered) + " blocks flagged registered, " +
                       std::to_string(index_.size()) + " hashes");
  }
  for (size_t slot = 0; slot < index_.capacity(); ++slot) {
    const int64_t key = index_.key_at(slot);
    if (key != 0 && hash_of_[index_.value_at(slot)] != key) {
      problems.push_back("hash " + std::to_string(key) + " maps to block " +
                         std::to_string(index_.value_at(slot)) + ", which carries another");
    }
  }
  for (int32_t block_id = 0; block_id < total_count_; ++block_id) {
    if (children[block_id] != num_children_[block_id]) {
      problems.push_back("block " + std::to_string(block_id) + " counts " +
                         std::to_string(num_children_[block_id]) + " children, " +
                         std::to_string(children[block_id]) + " registered");
      continue;
    }
    int32_t seen = 0, previous = kRoot;
    for (int32_t child = first_child_[block_id]; child != kRoot && seen <= children[block_id];
         child = next_sibling_[child]) {
      if (parent_[child] != block_id || !is_registered(child)) {
        problems.push_back("block " + std::to_string(child) + " is listed as a child of " +
                           std::to_string(block_id));
      }
      if (prev_sibling_[child] != previous) {
        problems.push_back("block " + std::to_string(child) + " has a broken back link");
      }
      ++seen;
      previous = child;
    }
    if (seen != children[block_id]) {
      problems.push_back("block " + std::to_string(block_id) + " lists " + std::to_string(seen) +
                         " children, " + std::to_string(children[block_id]) + " registered");
    }
  }
  if (!retains_unreferenced()) {
    if (num_cached_) {
      problems.push_back("policy keeps nothing but " + std::to_string(num_cached_) +
                         " blocks are cached");
    }
  } else if (static_cast<int64_t>(policy_->size()) != num_leaves) {
    problems.push_back("policy tracks " + std::to_string(policy_->size()) + " blocks, " +
                       std::to_string(num_leaves) + " cached leaves");
  }
  if (!pending_blocks_.empty() && group_depth_ == 0) {
    problems.push_back("releases are queued outside a free group");
  }
  return problems;
}

void Engine::free_ids(std::vector<int32_t>& out) const {
  if (lowest_first_) {
    lowest_.descending(out);
  } else {
    out.assign(stack_.begin(), stack_.begin() + static_cast<std::ptrdiff_t>(num_free_));
  }
}

size_t Engine::memory_bytes() const noexcept {
  const size_t per_block =
      sizeof(int32_t) * 11 + sizeof(int64_t) * 4 + sizeof(uint32_t);  // flat arrays below
  // stack, active, paused, pending, parent, 3 links, children, depth, slot (int32);
  // hash_of, registration, last_access, accesses (int64); stamp (uint32)
  return per_block * static_cast<size_t>(total_count_) + index_.memory_bytes() +
         (policy_ ? policy_->memory_bytes() : 0) + lowest_.memory_bytes();
}

}  // namespace prefixcache
