// VllmQueue: the vLLM plugin's free-block queue with its bookkeeping in arrays (C++).
//
// The twin of integrations/vllm_queue.py's PolicyFreeBlockQueue for a native policy
// (DESIGN.md, "vLLM integration"): the same sections (hash-less blocks handed out first,
// the policy's free leaves, free inner blocks), the same parent links, clock, use counts
// and depths, the same calls to the policy in the same order, so it hands out the same
// blocks. It keeps them in arrays indexed by block ID and takes a whole request's blocks
// per call (append_n, popleft_n, note_registered, note_hits): no Python call per block.
// Blocks are vLLM KVCacheBlock objects (anything with block_id, block_hash, is_null);
// their IDs lie in [0, num_blocks). Not thread-safe (vLLM's scheduler owns its pool).
#ifndef PREFIXCACHE_ENGINE_NATIVE_VLLM_QUEUE_H_
#define PREFIXCACHE_ENGINE_NATIVE_VLLM_QUEUE_H_

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <utility>
#include <vector>

#include "policy.h"

namespace prefixcache {

/// An insertion-ordered set of block IDs linked through two arrays: push at either end,
/// erase any member, read the front, all O(1). Membership is kept by the caller.
class IdChain {
 public:
  void reset(size_t n);
  void push_back(int32_t id);
  void push_front(int32_t id);
  void erase(int32_t id);
  int32_t front() const noexcept { return head_; }
  int32_t back() const noexcept { return tail_; }
  int32_t next(int32_t id) const noexcept { return next_[static_cast<size_t>(id)]; }
  size_t size() const noexcept { return size_; }

 private:
  std::vector<int32_t> prev_, next_;
  int32_t head_ = kNoBlock, tail_ = kNoBlock;
  size_t size_ = 0;
};

/// What the queue reads of a vLLM block (vllm_block.cpp); false with a Python error set.
/// vLLM's own KVCacheBlock has its slots read at their offsets, any other type generically.
namespace vllm_block {
/// Interns each name not yet interned into its global; false with MemoryError set.
bool intern_names(std::initializer_list<std::pair<PyObject**, const char*>> names);
/// Interns the attribute names read below (once); false with MemoryError set.
bool ready();
/// policy_hash(key) of vllm_queue.py: XXH3-64 of bytes, else Python's hash; 63 bits.
bool policy_hash(PyObject* key, int64_t* out);
/// ``("unpinned", id)``: a hash-less leaf's key (a new reference, nullptr with an error set).
PyObject* unpinned_key(int32_t id);
/// Whether ``block`` is neither null nor hash-less; ``*key``: its block_hash (a new ref).
bool cacheable(PyObject* block, bool* out, PyObject** key);
bool is_null(PyObject* block, bool* out);
/// ``block.block_hash``, a new reference (nullptr with an error set).
PyObject* hash_key(PyObject* block);
/// ``block.block_id`` as a long long (false with an error set).
bool raw_id(PyObject* block, long long* out);
/// ``block.ref_cnt`` as a long long (false with an error set).
bool ref_cnt(PyObject* block, long long* out);
/// ``block.ref_cnt = value`` (false with an error set).
bool set_ref_cnt(PyObject* block, long value);
/// Whether blocks of ``type`` have all four attributes read at their slots' offsets.
bool uses_slots(PyTypeObject* type);
}  // namespace vllm_block

enum class Section : int8_t { kNone = 0, kFirst = 1, kLeaf = 2, kInner = 3, kHinted = 4 };

/// The queue's state and operations. Every method that returns bool returns false with a
/// Python exception set; errors about the caller's input are raised before any change.
class VllmQueueCore {
 public:
  /// ``leaf_hash``: the policy reads LeafInfo::hash (false for lru and fifo, which order by
  /// last access alone: inserting a leaf then reads no block hash and hashes nothing).
  VllmQueueCore(int32_t num_blocks, std::unique_ptr<Policy> policy, bool on_register,
                bool leaf_hash = true);
  ~VllmQueueCore();
  VllmQueueCore(const VllmQueueCore&) = delete;
  VllmQueueCore& operator=(const VllmQueueCore&) = delete;

  int64_t num_free() const noexcept { return num_free_; }
  /// One eviction counted (BlockPoolHook: a victim lost its hashes), for the metrics.
  void count_eviction() noexcept { ++evictions_; }
  /// Prefix hits on free blocks counted (BlockPoolHook around touch), for the metrics.
  void count_hits(int64_t n) noexcept { hits_ += n; }
  /// The evictions (hits) counted since the last call.
  int64_t take_evictions() noexcept { return std::exchange(evictions_, 0); }
  int64_t take_hits() noexcept { return std::exchange(hits_, 0); }
  bool popleft_n(int64_t n, PyObject** out);  // a new list
  bool remove(PyObject* block);
  bool append_n(PyObject* blocks);   // a list or tuple
  bool prepend_n(PyObject* blocks);  // a list or tuple
  bool note_registered(PyObject* blocks, Py_ssize_t start, Py_ssize_t stop);
  bool note_hits(PyObject* blocks);  // any iterable
  /// set_hinted: the hinted section becomes the free cached blocks of ``blocks`` (a list
  /// or tuple), at most ``limit``; ``*out``: how many (vllm_queue_hints.cpp).
  bool set_hinted(PyObject* blocks, int64_t limit, int64_t* out);
  int64_t num_hinted() const noexcept { return static_cast<int64_t>(hinted_.size()); }
  bool note_hash_removed(PyObject* block);
  bool knows(int64_t block_id) const noexcept;
  /// Whether ``block_id`` is free and one of the policy's leaves (cached, no cached child).
  bool is_free_leaf(int64_t block_id) const noexcept {
    return block_id >= 0 && block_id < num_blocks_ && where_[block_id] == Section::kLeaf;
  }
  bool note_moved(PyObject* source, PyObject* target);
  bool note_reset();
  bool eviction_order(PyObject** out);  // a new list: the hand-out order, on a copy
  bool check_invariants();
  int traverse(visitproc visit, void* arg);
  void clear_blocks();

 private:
  bool block_id(PyObject* block, int32_t* out) const;
  bool ids_of(PyObject* seq, std::vector<int32_t>& ids, std::vector<PyObject*>& items) const;
  bool check_not_free(const std::vector<int32_t>& ids);
  void keep(int32_t id, PyObject* block);
  bool leaf_info(int32_t id, PyObject* key, LeafInfo* out);
  /// ``id``'s LeafInfo with policy hash ``hash`` (its stamp, uses, depth as the twin passes
  /// them): what leaf_info builds once the key is hashed.
  LeafInfo leaf_of(int32_t id, int64_t hash) const;
  bool insert_leaf(int32_t id);
  bool cut(int32_t id);
  void link_child(int32_t parent, int32_t child);
  void unlink_child(int32_t child);
  void forget(int32_t id) noexcept;
  bool take_victim(int32_t* out);

  const int32_t num_blocks_;
  std::unique_ptr<Policy> policy_;
  const bool on_register_;
  const bool leaf_hash_;
  int64_t num_free_ = 0;
  int64_t clock_ = 0;
  int64_t evictions_ = 0;
  int64_t hits_ = 0;
  std::vector<PyObject*> blocks_;  // strong references, every block seen
  std::vector<Section> where_;
  IdChain first_, inner_;              // hash-less (handed out first); inner, in free order
  IdChain hinted_;                     // on queued prefixes, oldest hint first (set_hinted)
  std::vector<char> picked_;           // set_hinted's scratch marks, all 0 between calls
  std::vector<int64_t> stamp_;         // clock when last freed (0: none)
  std::vector<int64_t> depth_;         // position in its block table (-1: not registered)
  std::vector<int64_t> accesses_;      // 1 + prefix hits since filled (0: none)
  std::vector<int32_t> parent_;        // cached parent (kNoBlock: none)
  std::vector<int32_t> first_child_;   // children: a list per parent through sibling links
  std::vector<int32_t> sibling_prev_, sibling_next_;
  std::vector<int32_t> num_children_;
};

/// The core of a ``_native.VllmQueue`` (vllm_queue_module.cpp); nullptr for any other
/// object or an uninitialised queue, no error set.
VllmQueueCore* vllm_queue_core(PyObject* object);
/// Adds ``_native.BlockPoolHook`` (vllm_queue_hooks.cpp); false with an error set.
bool add_vllm_hook_type(PyObject* module);
/// The remove-hashes hook's work after vLLM's ``_remove_cached_block_hashes(pool, block)``
/// returned ``removed``: a block the queue knows forgets its hash, else a victim held by
/// nobody counts as one eviction (vllm_queue_hooks.cpp); false with an error set.
bool after_hashes_removed(VllmQueueCore* core, PyObject* block, PyObject* removed);
/// vLLM's function behind the remove-hashes BlockPoolHook at ``type.<name>`` (borrowed), or
/// nullptr (no error set) when something else stands there (vllm_queue_hooks.cpp).
PyObject* hooked_remover(PyTypeObject* type, PyObject* name);
/// Interns what vllm_get_new_blocks reads (vllm_get_new_blocks.cpp); false with an error set.
bool get_new_blocks_ready();
/// ``BlockPool.get_new_blocks(pool, n)`` (``args``: pool, n) for a pool whose queue's core is
/// ``core``: vLLM 0.33's steps in C, or ``original`` where the pool is not the plain case.
PyObject* vllm_get_new_blocks(PyObject* original, PyObject* const* args, VllmQueueCore* core);

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_VLLM_QUEUE_H_
