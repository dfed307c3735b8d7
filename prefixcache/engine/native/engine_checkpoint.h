// EngineCheckpoint and PolicyTransaction: the transaction rule for a policy that can fail.
//
// The native engine writes its state as it goes (the planner deregisters each victim before
// it asks the policy for the next one), which is safe with the built-in policies: they cannot
// fail. A policy written in Python can raise in any hook, after some of the engine's writes.
// PolicyTransaction runs one engine call as a transaction when the policy is transactional():
// it saves the engine's state (EngineCheckpoint) and opens the policy's transaction before the
// call; on success it commits the policy's; on any exception it restores the engine's state
// and aborts the policy's, so the failed call leaves both exactly as they were (DESIGN.md,
// "The transaction rule"). A built-in policy skips both: one virtual call a call.
//
// Cost with a Python policy: one copy of the engine's per-block arrays per call (a memcpy of
// about 80 bytes a block into buffers kept across calls), O(total_count).

#ifndef PREFIXCACHE_ENGINE_NATIVE_ENGINE_CHECKPOINT_H_
#define PREFIXCACHE_ENGINE_NATIVE_ENGINE_CHECKPOINT_H_

#include <cstdint>
#include <vector>

#include "engine.h"

namespace prefixcache {

/// A copy of an Engine's state (everything but scratch), restorable into the same engine.
class EngineCheckpoint {
 public:
  void save(const Engine& engine);
  void restore(Engine& engine) const;

 private:
  template <class To, class From>
  static void copy_state(To& to, const From& from);  // every field both name: to = from

  std::vector<int32_t> stack_;
  int64_t num_free_ = 0;
  LowestFreeList lowest_{0, 1};
  std::vector<int32_t> active_, paused_, pending_, pending_blocks_;
  int group_depth_ = 0;
  HashIndex index_{0};
  std::vector<int64_t> hash_of_;
  std::vector<int32_t> parent_, first_child_, next_sibling_, prev_sibling_;
  std::vector<int32_t> num_children_, depth_;
  std::vector<int64_t> registration_;
  int64_t num_registrations_ = 0;
  std::vector<int64_t> last_access_, num_accesses_;
  std::vector<int32_t> pins_;
  std::vector<int64_t> pin_stamp_, pin_pending_;
  std::vector<int32_t> pinned_list_, pinned_at_;
  int64_t pin_bound_ = 0;
  int64_t num_active_ = 0, num_paused_ = 0, num_cached_ = 0, num_holding_paused_ = 0;
  Counters counters_;
  std::vector<int32_t> changed_free_;
  std::vector<int64_t> removed_hashes_;
};

/// One engine call as a transaction of the engine and its policy (see the file comment).
/// Construct it before the call and call commit() after it; destroyed without commit()
/// (an exception), it restores the engine and aborts the policy.
class PolicyTransaction {
 public:
  /// ``checkpoint``: the engine's buffers for the saved state; null when its policy is not
  /// transactional (nothing to do then).
  PolicyTransaction(Engine* engine, EngineCheckpoint* checkpoint);
  ~PolicyTransaction();
  PolicyTransaction(const PolicyTransaction&) = delete;
  PolicyTransaction& operator=(const PolicyTransaction&) = delete;
  void commit();

 private:
  Engine* engine_;
  EngineCheckpoint* checkpoint_;  // null: not transactional, or ended
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_ENGINE_CHECKPOINT_H_
