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
#include "linked_map.h"

namespace prefixcache {

namespace {

struct Stay {
  bool live = false;
  int64_t block_hash = 0;
  int64_t num_accesses = 0;  // hand-outs last seen
  int64_t earlier = 0;       // uses of earlier stays of the hash
};

class ProtectedLruPolicy final : public Policy {
 public:
  ProtectedLruPolicy(int32_t num_blocks, int64_t history_capacity)
      : history_capacity_(history_capacity),
        probation_(static_cast<size_t>(num_blocks)),
        protected_(static_cast<size_t>(num_blocks)),
        stays_(static_cast<size_t>(num_blocks)),
        history_(static_cast<size_t>(std::min<int64_t>(history_capacity, 1 << 16))) {}

  void insert(int32_t block_id, const LeafInfo& leaf) override {
    Stay& stay = stays_[block_id];
    int64_t earlier;
    if (!stay.live || stay.block_hash != leaf.block_hash ||
        stay.num_accesses > leaf.num_accesses) {
      const int64_t* uses = history_.get(leaf.block_hash);
      earlier = uses ? *uses : 0;
      history_.erase(leaf.block_hash);
    } else {
      earlier = stay.earlier;
    }
    stay = Stay{true, leaf.block_hash, leaf.num_accesses, earlier};
    place(block_id, leaf.last_access, earlier + leaf.num_accesses);
  }

  void on_register(const int64_t* hashes, size_t count, int64_t) override {
    for (size_t i = 0; i < count; ++i) {  // a remembered hash moves to the recent end
      const int64_t* uses = history_.get(hashes[i]);
      if (!uses) continue;
      const int64_t kept = *uses;
      history_.erase(hashes[i]);
      history_.put(hashes[i], kept);
    }
  }

  void discard(int32_t block_id) override { class_of(block_id).remove(block_id); }

  void touch(int32_t block_id, int64_t now) override {
    class_of(block_id).remove(block_id);
    Stay& stay = stays_[block_id];
    ++stay.earlier;
    place(block_id, now, stay.earlier + stay.num_accesses);
  }

  int32_t evict_one() override {
    KeyedHeap<int64_t>& from = probation_.empty() ? protected_ : probation_;
    if (from.empty()) return kNoBlock;
    const int32_t block_id = from.pop();
    Stay& stay = stays_[block_id];
    stay.live = false;
    if (history_capacity_ > 0) {
      history_.erase(stay.block_hash);
      history_.put(stay.block_hash, stay.earlier + stay.num_accesses);
      if (static_cast<int64_t>(history_.size()) > history_capacity_) history_.pop_oldest();
    }
    return block_id;
  }

  void clear() override {
    probation_.clear();
    protected_.clear();
    std::fill(stays_.begin(), stays_.end(), Stay{});
    history_.clear();
  }

  size_t size() const noexcept override { return probation_.size() + protected_.size(); }
  bool contains(int32_t block_id) const noexcept override {
    return probation_.contains(block_id) || protected_.contains(block_id);
  }
  size_t memory_bytes() const noexcept override {
    return probation_.memory_bytes() + protected_.memory_bytes() +
           stays_.capacity() * sizeof(Stay) + history_.memory_bytes();
  }

 private:
  void place(int32_t block_id, int64_t last_access, int64_t num_uses) {
    (num_uses >= 2 ? protected_ : probation_).insert(block_id, last_access);
  }
  KeyedHeap<int64_t>& class_of(int32_t block_id) noexcept {
    return protected_.contains(block_id) ? protected_ : probation_;
  }

  const int64_t history_capacity_;
  KeyedHeap<int64_t> probation_, protected_;  // by last access
  std::vector<Stay> stays_;                    // by block ID: tracked, or out for a hit
  LinkedMap<int64_t> history_;                 // evicted hash -> uses, least recent first
};

}  // namespace

std::unique_ptr<Policy> make_protected_lru_policy(int32_t num_blocks,
                                                  const PolicyOptions& options) {
  return std::make_unique<ProtectedLruPolicy>(num_blocks,
                                              options.get_int("history_capacity", 100'000, 0));
}

}  // namespace prefixcache
