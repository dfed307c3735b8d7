// Policy: the interface every native eviction policy implements, and the engine calls.
//
// The C++ twin of policies/base.py's EvictionPolicy (DESIGN.md, "Native policies"): the
// engine tells a policy which cached blocks became evictable leaves (insert), stopped being
// leaves (discard) or were used (touch), and asks it for victims one at a time at the one
// choke point, evict_one. Each built-in policy is one file in native/policies/, registered
// by name in policy_factory.cpp, and makes exactly the decisions of its Python class: the
// same victims for the same calls (tests/native/test_native_policies.py drives both with
// the same random call programs).
//
// Calls arrive valid (the engine, or the NativePolicy binding, checks them): insert only an
// untracked block, discard/touch/relocate's old only a tracked one, block IDs below the
// capacity given at construction. Built-in policies never throw except std::bad_alloc.
// Not thread-safe.

#ifndef PREFIXCACHE_ENGINE_NATIVE_POLICY_H_
#define PREFIXCACHE_ENGINE_NATIVE_POLICY_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace prefixcache {

constexpr int32_t kNoBlock = -1;

/// What a policy is told of a leaf (EvictionPolicy.insert's arguments after the ID).
struct LeafInfo {
  int64_t block_hash;    // chained content hash; names the prefix for good (IDs recycle)
  int64_t last_access;   // clock of the block's last access
  int64_t num_accesses;  // hand-outs of the block (1: filled once, never hit)
  int64_t depth;         // 0-based position in its hash chain
};

/// Read-only engine state a policy may consult (page_aware: which blocks are held or free).
class EngineView {
 public:
  virtual ~EngineView() = default;
  virtual int32_t num_usable() const noexcept = 0;
  virtual bool is_free(int32_t block_id) const noexcept = 0;
  virtual bool is_held(int32_t block_id) const noexcept = 0;  // any active or paused ref
  virtual int64_t clock() const noexcept = 0;
};

/// Named numeric options of a policy (the Python class's keyword arguments).
class PolicyOptions {
 public:
  void set(std::string name, double value) { values_.emplace_back(std::move(name), value); }
  /// The option ``name`` or ``fallback``; marks it used.
  double get(const std::string& name, double fallback) const;
  /// The option ``name`` as an integer >= ``minimum``, or ``fallback``; throws
  /// std::invalid_argument ("NAME must be an int >= MINIMUM, got VALUE") otherwise.
  int64_t get_int(const std::string& name, int64_t fallback, int64_t minimum) const;
  /// The names given but never read by the policy (an unknown option), comma-separated.
  std::string unused() const;

 private:
  std::vector<std::pair<std::string, double>> values_;
  mutable std::vector<std::string> used_;
};

class Policy {
 public:
  virtual ~Policy() = default;

  // ---- tracking (EvictionPolicy's abstract methods)
  /// Start tracking ``block_id``, which just became an evictable leaf.
  virtual void insert(int32_t block_id, const LeafInfo& leaf) = 0;
  /// Stop tracking ``block_id`` (hit, or it gained a child).
  virtual void discard(int32_t block_id) = 0;
  /// An access at clock ``now`` to the tracked leaf ``block_id``.
  virtual void touch(int32_t block_id, int64_t now) = 0;
  /// evict(1): the next victim, no longer tracked; kNoBlock when nothing is tracked.
  virtual int32_t evict_one() = 0;
  /// Forget every tracked block and all history (engine reset).
  virtual void clear() = 0;
  virtual size_t size() const noexcept = 0;
  virtual bool contains(int32_t block_id) const noexcept = 0;
  virtual size_t memory_bytes() const noexcept = 0;

  // ---- optional hooks (the defaults are EvictionPolicy's)
  /// ``count`` hashes were just registered as one chain run, the first at ``first_depth``.
  virtual void on_register(const int64_t* hashes, size_t count, int64_t first_depth) {
    (void)hashes, (void)count, (void)first_depth;
  }
  /// A request took the cached prefix ``hashes`` (root first; EvictionPolicy.on_hit),
  /// called after the hit's references are taken. Only where uses_on_hit() says so.
  virtual void on_hit(const int64_t* hashes, size_t count) { (void)hashes, (void)count; }
  /// Whether on_hit does anything (auto: its safety net counts hits), so the engine may
  /// skip collecting the hashes for every other policy.
  virtual bool uses_on_hit() const noexcept { return false; }
  /// A conversation's end freed the cached blocks ``hashes`` (Engine::evict_blocks, after
  /// their discard and the frees; EvictionPolicy.on_end): auto's LRU shadow drops them.
  virtual void on_end(const int64_t* hashes, size_t count) { (void)hashes, (void)count; }
  /// Whether set_retention does anything (the Python class overrides it).
  virtual bool has_retention() const noexcept { return false; }
  /// Retention ``priority`` for ``block_hash`` until ``expires_at`` (kNoExpiry: forever).
  virtual void set_retention(int64_t block_hash, int64_t priority, int64_t expires_at) {
    (void)block_hash, (void)priority, (void)expires_at;
  }
  /// Whether evict_one() would return ``block_id`` right after insert(block_id, leaf).
  /// A policy that answers true books the eviction itself: the engine then evicts the
  /// block without inserting it.
  virtual bool evicts_first(int32_t block_id, const LeafInfo& leaf) {
    (void)block_id, (void)leaf;
    return false;
  }
  /// The tracked leaf ``old_id`` now lives at ``new_id`` (defragmentation).
  virtual void relocate(int32_t old_id, int32_t new_id, const LeafInfo& leaf) {
    discard(old_id);
    insert(new_id, leaf);
  }
  /// Whether touch() can change anything (fifo: no), so the engine may skip the calls.
  virtual bool uses_touch() const noexcept { return true; }
  /// Give the policy read access to the engine's state (called once, before any other call).
  virtual void bind(const EngineView* view) noexcept { (void)view; }
  /// An independent copy of the policy and all its history (a bound view is shared).
  virtual std::unique_ptr<Policy> clone() const = 0;

  // ---- transactions (a policy that can fail: one written in Python, python_policy.h)
  /// Whether calls can fail (throw EngineError), so the engine must run each of its
  /// calls as a transaction (engine_checkpoint.h). Built-in policies: false, and they
  /// pay nothing for the hooks below.
  virtual bool transactional() const noexcept { return false; }
  /// An engine call begins: the calls until commit() or abort() are one transaction.
  virtual void begin() {}
  /// The engine call succeeded: keep every change.
  virtual void commit() {}
  /// The engine call failed: return to the state at begin(). Must not throw.
  virtual void abort() noexcept {}
};

/// The base of a policy class: clone() as its copy constructor, written once.
template <class Derived>
class CopyablePolicy : public Policy {
 public:
  std::unique_ptr<Policy> clone() const override {
    return std::make_unique<Derived>(static_cast<const Derived&>(*this));
  }
};

constexpr int64_t kNoExpiry = INT64_MAX;

/// Build the built-in policy ``name`` for block IDs below ``num_blocks``. Throws
/// std::invalid_argument naming the problem for an unknown name, an unknown option, or
/// an option out of range.
std::unique_ptr<Policy> make_policy(const std::string& name, int32_t num_blocks,
                                    const PolicyOptions& options);

/// Names make_policy knows, sorted.
std::vector<std::string> native_policy_names();

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_POLICY_H_
