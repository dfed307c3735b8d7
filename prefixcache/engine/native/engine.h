// Engine: the native implementation of prefixcache's EngineCore interface.
//
// The same state as prefixcache/engine/python_engine.py, as flat arrays
// indexed by block ID (DESIGN.md, "The engine seam"): the free stack, active
// and paused reference counts with their partition counters, the hash
// registry (HashIndex plus parent/child links, child counts and depths),
// last access and hand-out counts, and an eviction policy: a Policy unit
// (policy.h) the engine calls at the points the Python engine calls its
// policy object, or none in the ref-zero mode, which caches nothing. Method names and the order of operations follow the Python
// engine, so a reader can move between them; every order that an observer can
// see (IDs handed out, the free stack, child lists, removed hashes) is the
// Python engine's, which the differential test checks step by step.
//
// Every method validates all it needs before it changes anything and throws
// EngineError (mapped to the library's exception classes by module.cpp);
// after the first write nothing throws. Not thread-safe.

#ifndef PREFIXCACHE_ENGINE_NATIVE_ENGINE_H_
#define PREFIXCACHE_ENGINE_NATIVE_ENGINE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "free_set.h"
#include "hash_index.h"
#include "policy.h"

namespace prefixcache {

enum class ErrorKind {
  kInvalidArgument,
  kInvalidBlockId,
  kInvalidTensor,
  kBlockState,
  kReferenceCount,
  kHashConflict,
  kCapacity,
  kBudgetExceeded,
  kInvariant,
  kReentrantCall,
  kPolicyRaised,  // a Python policy's hook raised: its exception is the pending Python error
};

struct EngineError {
  ErrorKind kind;
  std::string message;
};

constexpr int32_t kRoot = -1;  // parent of a chain's first block; "no block" in links

struct Counters {
  int64_t num_allocated = 0;
  int64_t num_released = 0;
  int64_t num_queried = 0;
  int64_t num_hits = 0;
  int64_t num_evicted = 0;
  int64_t num_dropped = 0;
  int64_t clock = 0;
};

class Engine {
 public:
  // policy: the eviction policy for block IDs below total_count, or null for the ref-zero
  // mode (nothing unreferenced is cached). lowest_first: the free list hands out the lowest
  // free IDs first (a LowestFreeList, pages of page_size blocks) instead of popping the
  // stack (free_list="lowest").
  Engine(int32_t total_count, int32_t paused_count, std::unique_ptr<Policy> policy,
         bool track_changes, bool lowest_first = false, int32_t page_size = 1);
  Engine(const Engine&) = delete;
  friend class EngineCheckpoint;  // saves and restores the state (engine_checkpoint.h)
  Engine& operator=(const Engine&) = delete;

  // ---- configuration and O(1) counters
  int32_t num_usable() const noexcept { return num_usable_; }
  int32_t paused_count() const noexcept { return paused_count_; }
  int32_t active_count() const noexcept { return num_usable_ - paused_count_; }
  bool retains_unreferenced() const noexcept { return policy_ != nullptr; }
  /// The eviction policy; null in the ref-zero mode.
  Policy* policy() const noexcept { return policy_.get(); }
  /// What the policy is told of ``block_id`` (registered): hash, last access, hand-outs, depth.
  LeafInfo leaf_info(int32_t block_id) const noexcept {
    return LeafInfo{hash_of_[block_id], last_access_[block_id], num_accesses_[block_id],
                    depth_[block_id]};
  }
  /// Forward a retention priority to the policy (which must have retention).
  void set_retention(int64_t block_hash, int64_t priority, int64_t expires_at) {
    policy_->set_retention(block_hash, priority, expires_at);
  }
  int64_t num_free() const noexcept { return num_free_; }
  int64_t num_active() const noexcept { return num_active_; }
  int64_t num_paused() const noexcept { return num_paused_; }
  int64_t num_holding_paused() const noexcept { return num_holding_paused_; }
  int64_t num_cached() const noexcept { return num_cached_; }
  int64_t num_registered() const noexcept { return static_cast<int64_t>(index_.size()); }
  int64_t clock() const noexcept { return counters_.clock; }
  const Counters& counters() const noexcept { return counters_; }
  int64_t advance_clock(int64_t ticks) noexcept { return counters_.clock += ticks; }
  int group_depth() const noexcept { return group_depth_; }

  // ---- allocation (IDs passed in are in [0, num_usable), checked by the caller)
  bool allocate(int64_t num_blocks, int32_t* out);
  void release(const int32_t* ids, size_t count, bool paused);
  void open_group() noexcept { ++group_depth_; }
  void close_group();

  // ---- prefix reuse
  size_t lookup(const int64_t* hashes, size_t count, int32_t* out) const noexcept;
  void take_hit(const int32_t* ids, size_t count, int64_t num_queried, bool acquire);
  void acquire(const int32_t* ids, size_t count);
  void register_chain(const int32_t* ids, const int64_t* hashes, size_t count, bool has_parent,
                      int64_t parent_hash, uint8_t* holds, uint8_t* is_new);
  int32_t block_of(int64_t block_hash) const noexcept { return index_.find(block_hash); }
  int64_t hash_of(int32_t block_id) const noexcept { return hash_of_[block_id]; }
  bool is_registered(int32_t block_id) const noexcept { return hash_of_[block_id] != 0; }
  /// The block's registration generation (0: unregistered). Given once per registration (the
  /// counter survives reset; a rollback restores it with the state, so only a registration
  /// no caller saw gets a number again): an unchanged value means the block kept its hash
  /// since it was read; its parent too, unless relocation renamed it (the layout epoch's).
  int64_t registration_of(int32_t block_id) const noexcept {
    return hash_of_[block_id] != 0 ? registration_[block_id] : 0;
  }
  int32_t parent_of(int32_t block_id) const noexcept { return parent_[block_id]; }
  int32_t depth_of(int32_t block_id) const noexcept { return depth_[block_id]; }
  /// Registered blocks ordered by (depth, registration order): parents first.
  std::vector<int32_t> registered_in_order() const;

  // ---- chain pins (engine_pins.cpp; prefixcache/engine/pins.py is the reference)
  /// Whether a session may pin its chain's tail instead of referencing each block.
  bool can_pin() const noexcept { return policy_ && !policy_->uses_on_hit(); }
  /// The pinned chains' ancestors counted with repeats: at least the cached blocks they keep.
  int64_t pin_bound() const noexcept { return pin_bound_; }
  /// take_hit(chain, chain_length, num_queried, true) on a chain of chain_length >= 2 blocks
  /// ending at tail, referencing only the tail: O(1), the ancestors are never read.
  void pin_chain(int32_t tail, int64_t chain_length, int64_t num_queried);
  /// Release ids (ids[0] a tail pinned with a chain of chain_length) and the pin.
  void release_pinned(const int32_t* ids, size_t count, int64_t chain_length);
  /// Free plus cached blocks less the cached ones among ids and those pinned chains keep.
  int64_t reclaimable(const int32_t* ids, size_t count);
  /// num_blocks (at most the cached blocks) less what pinned chains keep.
  int64_t num_evictable(int64_t num_blocks);
  /// (tail, pins) of every pinned tail, by ID.
  std::vector<std::pair<int32_t, int32_t>> pinned_tails() const;

  // ---- fused request path
  /// Admit one request whose ``num_full`` block hashes are given; see module.cpp.
  int64_t admit(const int64_t* hashes, size_t num_full, size_t num_matchable,
                size_t num_blocks, int32_t* out_row);

  // ---- partitions and time
  void move(const int32_t* ids, size_t count, bool to_paused);
  void touch(const int32_t* ids, size_t count);
  int64_t evict(int64_t num_blocks);
  /// Free the cached leaves among ids, tail-first (engine_evict_blocks.cpp); how many.
  int64_t evict_blocks(const int32_t* ids, size_t count);
  int32_t active_refs(int32_t block_id) const noexcept { return active_[block_id]; }
  int32_t paused_refs(int32_t block_id) const noexcept { return paused_[block_id]; }
  const char* describe_state(int32_t block_id) const noexcept;

  // ---- layout (engine_layout.cpp)
  /// Move each source's whole state to its destination (free); the sources become free.
  /// Refused (nothing changes) inside a free group, for an ID listed twice, a free
  /// source or a destination that is not free. Complexity: O(total_count + k log n).
  void relocate(const int32_t* sources, const int32_t* destinations, size_t count);
  /// relocate's checks alone (throws as it would; changes only scratch state).
  void check_relocation(const int32_t* sources, const int32_t* destinations, size_t count);
  bool is_free(int32_t block_id) const noexcept;

  // ---- collaborators above the engine
  bool tracks_changes() const noexcept { return track_changes_; }
  std::vector<int32_t>& freed_blocks() noexcept { return changed_free_; }
  std::vector<int64_t>& removed_hashes() noexcept { return removed_hashes_; }
  void reset();
  std::vector<std::string> find_problems() const;
  bool lowest_first() const noexcept { return lowest_first_; }
  /// Free IDs, bottom of the stack first (descending in lowest-first mode), into ``out``.
  void free_ids(std::vector<int32_t>& out) const;
  size_t memory_bytes() const noexcept;

 private:
  // Distinct IDs of ``ids`` (input order when all are distinct, else ascending, as
  // numpy's unique) into unique_, with counts_ (empty when all are distinct).
  void count_occurrences(const int32_t* ids, size_t count);
  void check_reference_counts(const int32_t* held_minus, const char* partition) const;
  void drop_references(bool paused);
  void on_unreferenced(const std::vector<int32_t>& block_ids);
  void drop_blocks(const std::vector<int32_t>& hashed, const std::vector<int32_t>& unhashed);
  void take_references();
  /// Tell a policy that uses on_hit the hashes of the hit ``ids`` (after their references).
  void report_hit(const int32_t* ids, size_t count);
  // Fast paths for IDs that are all distinct (a session's chain, a request's row): one
  // pass checks every ID and detects a repeat (stamp_), one pass writes. False when an ID
  // repeats or a check fails: nothing changed, and the caller runs the general path, which
  // raises exactly its own errors. The same writes in the same order as the general path.
  bool acquire_distinct(const int32_t* ids, size_t count);
  bool release_distinct(const int32_t* ids, size_t count);
  void check_headroom(const std::vector<int32_t>& refs, const char* partition) const;
  void queue_release();
  void flush_releases();
  void plan_eviction(int64_t num_blocks, std::vector<int32_t>& freed);
  int32_t drop_pinned_subtree();
  // Chain pins: the cached blocks among ids and the pinned tails' ancestors (distinct);
  // stamps the ancestors with the current generation_. O(count + pinned chains).
  int64_t num_reserved(const int32_t* ids, size_t count);
  void rebuild_pinned_list();  // from pins_, after a relocation or a reset
  /// Give parent_id what block_id's pins owe it: the stamp (max) and pending accesses (sum).
  void hand_down(int32_t block_id, int32_t parent_id) noexcept;
  /// The stamp full references would have written on block_id (with its descendants' pins).
  int64_t effective_stamp(int32_t block_id);
  void subtree(int32_t root_id, std::vector<int32_t>& order);
  void deregister_leaf(int32_t block_id);
  void register_block(int32_t block_id, int64_t block_hash, int32_t parent_id);
  void link_child(int32_t parent_id, int32_t child_id) noexcept;
  void unlink_child(int32_t parent_id, int32_t child_id) noexcept;
  bool is_tracked_leaf(int32_t block_id) const noexcept;
  bool is_unreferenced(int32_t block_id) const noexcept {
    return active_[block_id] == 0 && paused_[block_id] == 0;
  }
  void push_free(int32_t block_id) noexcept;
  void rebuild_free_list();
  void insert_leaf(int32_t block_id) { policy_->insert(block_id, leaf_info(block_id)); }
  void notify_registrations(const int32_t* ids, const int64_t* hashes, const uint8_t* is_new,
                            size_t count);
  void reset_counters() noexcept;

  const int32_t total_count_;
  const int32_t num_usable_;
  const int32_t paused_count_;
  // What a policy may read of the engine (EngineView), bound to the policy once.
  class View final : public EngineView {
   public:
    explicit View(const Engine* engine) noexcept : engine_(engine) {}
    int32_t num_usable() const noexcept override { return engine_->num_usable_; }
    bool is_free(int32_t block_id) const noexcept override { return engine_->is_free(block_id); }
    bool is_held(int32_t block_id) const noexcept override {
      return !engine_->is_unreferenced(block_id);
    }
    int64_t clock() const noexcept override { return engine_->counters_.clock; }

   private:
    const Engine* engine_;
  };
  View view_{this};
  std::unique_ptr<Policy> policy_;
  const bool track_changes_;
  const bool lowest_first_;

  std::vector<int32_t> stack_;  // free IDs; the top is at num_free_ - 1
  int64_t num_free_ = 0;
  LowestFreeList lowest_;  // the free IDs in lowest-first mode (stack_ unused then)
  std::vector<int32_t> active_;   // references of running requests
  std::vector<int32_t> paused_;   // references of paused requests
  std::vector<int32_t> pending_;  // active releases queued by open free groups
  std::vector<int32_t> pending_blocks_;  // blocks with pending_ > 0, in queueing order
  int group_depth_ = 0;

  // Registry. hash_of_ == 0: not registered.
  HashIndex index_;
  std::vector<int64_t> hash_of_;
  std::vector<int32_t> parent_;  // kRoot for a chain's first block
  std::vector<int32_t> first_child_, next_sibling_, prev_sibling_;  // kRoot: none
  std::vector<int32_t> num_children_;
  std::vector<int32_t> depth_;
  std::vector<int64_t> registration_;  // order of registration, for registered_in_order
  int64_t num_registrations_ = 0;
  // Of registered blocks: clock of registration or last hit/touch; hand-outs since.
  std::vector<int64_t> last_access_;
  std::vector<int64_t> num_accesses_;  // hand-outs: a hot prefix passes 2**31 in days
  // Chain pins: pins on each tail; per block the stamp and accesses its pins (or its evicted
  // descendants') still owe its ancestors; the pinned chains' ancestors, with repeats.
  std::vector<int32_t> pins_;
  std::vector<int64_t> pin_stamp_, pin_pending_;
  int64_t pin_bound_ = 0;
  // The pinned tails (pins_ > 0) in no order, and each block's position there (-1: none):
  // the capacity walk visits the pinned chains without a scan of every block ID.
  std::vector<int32_t> pinned_list_, pinned_at_;

  int64_t num_active_ = 0, num_paused_ = 0, num_cached_ = 0;
  int64_t num_holding_paused_ = 0;  // blocks holding any paused reference (paused budget)
  Counters counters_;

  std::vector<int32_t> changed_free_;
  std::vector<int64_t> removed_hashes_;

  // Scratch, reused across calls (no allocation on the hot paths once warm).
  std::vector<uint32_t> stamp_;  // stamp_[b] == generation_: seen in this pass
  std::vector<int32_t> slot_;    // b's index in unique_ while stamped
  uint32_t generation_ = 0;
  std::vector<int32_t> unique_, counts_, held_, scratch_, scratch2_, stack_scratch_;
  std::vector<int64_t> ended_hashes_;  // evict_blocks: the freed blocks' hashes, for on_end
  std::vector<int32_t> hashed_, unhashed_;  // on_unreferenced's split
  std::vector<int32_t> hits_;
  std::vector<int64_t> hit_hashes_;  // report_hit's hashes for Policy::on_hit
  std::vector<int32_t> leaves_;  // touch's tracked leaves; registration's parents gaining a child
  std::vector<uint8_t> flags_;

  uint32_t next_generation() noexcept;
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_ENGINE_H_
