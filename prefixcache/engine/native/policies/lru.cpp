// lru and fifo (policies/lru.py, policies/fifo.py): cached leaves in an indexed heap.
//
// Both order leaves by (key, block ID), lowest first: lru's key is the last access (a
// touch re-keys the leaf), fifo's the last access the leaf had when it entered (touches
// change nothing). Keys and IDs together are unique, so the victim is the Python class's
// whatever the heap's layout; evicts_first compares with the top.
#include "factories.h"
#include "keyed_heap.h"

namespace prefixcache {

namespace {

class HeapPolicy final : public CopyablePolicy<HeapPolicy> {
 public:
  HeapPolicy(int32_t num_blocks, bool rekey_on_touch)
      : heap_(static_cast<size_t>(num_blocks)), rekey_on_touch_(rekey_on_touch) {}

  void insert(int32_t block_id, const LeafInfo& leaf) override {
    heap_.insert(block_id, leaf.last_access);
  }
  void discard(int32_t block_id) override { heap_.remove(block_id); }
  void touch(int32_t block_id, int64_t now) override {
    if (rekey_on_touch_) heap_.rekey(block_id, now);
  }
  int32_t evict_one() override { return heap_.empty() ? kNoBlock : heap_.pop(); }
  void clear() override { heap_.clear(); }
  size_t size() const noexcept override { return heap_.size(); }
  bool contains(int32_t block_id) const noexcept override { return heap_.contains(block_id); }
  size_t memory_bytes() const noexcept override { return heap_.memory_bytes(); }
  bool evicts_first(int32_t block_id, const LeafInfo& leaf) override {
    return heap_.before_all(leaf.last_access, block_id);
  }
  bool uses_touch() const noexcept override { return rekey_on_touch_; }

 private:
  KeyedHeap<int64_t> heap_;  // by last access (lru) or last access at entry (fifo)
  const bool rekey_on_touch_;
};

}  // namespace

std::unique_ptr<Policy> make_lru_policy(int32_t num_blocks, const PolicyOptions&) {
  return std::make_unique<HeapPolicy>(num_blocks, true);
}

std::unique_ptr<Policy> make_fifo_policy(int32_t num_blocks, const PolicyOptions&) {
  return std::make_unique<HeapPolicy>(num_blocks, false);
}

}  // namespace prefixcache
