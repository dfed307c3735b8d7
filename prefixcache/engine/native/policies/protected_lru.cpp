// protected_lru (policies/protected_lru.py): probation before protection, use counts that
// outlive eviction.
//
// A leaf is protected when its prefix was handed out at least twice, counting earlier
// stays of its hash (a bounded history of evicted hashes and their use counts, refreshed
// when a remembered hash is registered again); the victim is the least recently used
// probationary leaf, else the least recently used protected one. The Python class's lazy
// heaps amount to the minimum (last access, block ID) of each class: two keyed heaps here.
#include <algorithm>
#include <vector>

#include "factories.h"
#include "keyed_heap.h"
#include "use_history.h"

namespace prefixcache {

namespace {

class ProtectedLruPolicy final : public CopyablePolicy<ProtectedLruPolicy> {
 public:
  ProtectedLruPolicy(int32_t num_blocks, int64_t history_capacity)
      : probation_(static_cast<size_t>(num_blocks)),
        protected_(static_cast<size_t>(num_blocks)),
        uses_(num_blocks, history_capacity) {}

  void insert(int32_t block_id, const LeafInfo& leaf) override {
    const UseHistory::Stay& stay = uses_.enter(block_id, leaf);
    place(block_id, leaf.last_access, stay.earlier + stay.num_accesses);
  }

  void on_register(const int64_t* hashes, size_t count, int64_t) override {
    uses_.refresh_all(hashes, count);
  }

  // Whether evict_one() would return ``block_id`` right after insert(block_id, leaf); if
  // so, book what that round trip changes (the stay ended, the use count remembered).
  bool evicts_first(int32_t block_id, const LeafInfo& leaf) override {
    const bool is_protected = uses_.earlier(block_id, leaf) + leaf.num_accesses >= 2;
    if (is_protected ? !(probation_.empty() && protected_.before_all(leaf.last_access, block_id))
                     : !probation_.before_all(leaf.last_access, block_id)) {
      return false;
    }
    uses_.enter(block_id, leaf);
    uses_.leave(block_id, true);
    return true;
  }

  void discard(int32_t block_id) override { class_of(block_id).remove(block_id); }

  void touch(int32_t block_id, int64_t now) override {
    class_of(block_id).remove(block_id);
    UseHistory::Stay& stay = uses_[block_id];
    ++stay.earlier;
    place(block_id, now, stay.earlier + stay.num_accesses);
  }

  int32_t evict_one() override {
    KeyedHeap<int64_t>& from = probation_.empty() ? protected_ : probation_;
    if (from.empty()) return kNoBlock;
    const int32_t block_id = from.pop();
    uses_.leave(block_id, true);
    return block_id;
  }

  void clear() override {
    probation_.clear();
    protected_.clear();
    uses_.clear();
  }

  size_t size() const noexcept override { return probation_.size() + protected_.size(); }
  bool contains(int32_t block_id) const noexcept override {
    return probation_.contains(block_id) || protected_.contains(block_id);
  }
  size_t memory_bytes() const noexcept override {
    return probation_.memory_bytes() + protected_.memory_bytes() + uses_.memory_bytes();
  }

 private:
  void place(int32_t block_id, int64_t last_access, int64_t num_uses) {
    (num_uses >= 2 ? protected_ : probation_).insert(block_id, last_access);
  }
  KeyedHeap<int64_t>& class_of(int32_t block_id) noexcept {
    return protected_.contains(block_id) ? protected_ : probation_;
  }

  KeyedHeap<int64_t> probation_, protected_;  // by last access
  UseHistory uses_;                            // stays and evicted hashes' use counts
};

}  // namespace

std::unique_ptr<Policy> make_protected_lru_policy(int32_t num_blocks,
                                                  const PolicyOptions& options) {
  return std::make_unique<ProtectedLruPolicy>(num_blocks,
                                              options.get_int("history_capacity", 100'000, 0));
}

}  // namespace prefixcache
