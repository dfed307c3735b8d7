// slru (policies/slru.py): segmented LRU, probation for blocks used once, protected for
// reused ones.
//
// Victims come from probation, least recently used first, unless protected holds more
// than protected_fraction of the tracked leaves or probation is empty. A touch moves the
// leaf to protected at the touch's clock. Each segment is a keyed heap by
// (last access, block ID), the Python class's SortedList keys.
#include <stdexcept>
#include <string>
#include <vector>

#include "factories.h"
#include "keyed_heap.h"

namespace prefixcache {

namespace {

class SlruPolicy final : public CopyablePolicy<SlruPolicy> {
 public:
  SlruPolicy(int32_t num_blocks, double protected_fraction)
      : protected_fraction_(protected_fraction),
        probation_(static_cast<size_t>(num_blocks)),
        protected_(static_cast<size_t>(num_blocks)) {}

  void insert(int32_t block_id, const LeafInfo& leaf) override {
    (leaf.num_accesses > 1 ? protected_ : probation_).insert(block_id, leaf.last_access);
  }
  void discard(int32_t block_id) override { segment_of(block_id).remove(block_id); }
  void touch(int32_t block_id, int64_t now) override {
    segment_of(block_id).remove(block_id);
    protected_.insert(block_id, now);
  }
  int32_t evict_one() override {
    const size_t tracked = size();
    if (tracked == 0) return kNoBlock;
    const bool over_share = static_cast<double>(protected_.size()) >
                            protected_fraction_ * static_cast<double>(tracked);
    return (over_share || probation_.empty() ? protected_ : probation_).pop();
  }
  void clear() override {
    probation_.clear();
    protected_.clear();
  }
  size_t size() const noexcept override { return probation_.size() + protected_.size(); }
  bool contains(int32_t block_id) const noexcept override {
    return probation_.contains(block_id) || protected_.contains(block_id);
  }
  size_t memory_bytes() const noexcept override {
    return probation_.memory_bytes() + protected_.memory_bytes();
  }

 private:
  KeyedHeap<int64_t>& segment_of(int32_t block_id) noexcept {
    return protected_.contains(block_id) ? protected_ : probation_;
  }

  const double protected_fraction_;
  KeyedHeap<int64_t> probation_, protected_;  // keyed by last access
};

}  // namespace

std::unique_ptr<Policy> make_slru_policy(int32_t num_blocks, const PolicyOptions& options) {
  const double fraction = options.get("protected_fraction", 0.8);
  if (!(fraction >= 0 && fraction <= 1)) {
    throw std::invalid_argument("protected_fraction must lie in [0, 1], got " +
                                std::to_string(fraction));
  }
  return std::make_unique<SlruPolicy>(num_blocks, fraction);
}

}  // namespace prefixcache
