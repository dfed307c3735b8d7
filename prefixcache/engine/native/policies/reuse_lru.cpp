// reuse_lru (policies/reuse_lru.py): LRU with a bonus for reused prefixes, scale-free.
//
// Leaves are ordered by last access plus, for a prefix handed out more than once
// (counting earlier stays of its hash, kept in a bounded history after eviction),
// reuse_weight times the eviction age: a running mean of how long victims sat since their
// last access. The double arithmetic is the Python class's, in its order.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "factories.h"
#include "keyed_heap.h"
#include "use_history.h"

namespace prefixcache {

namespace {

class ReuseLruPolicy final : public CopyablePolicy<ReuseLruPolicy> {
 public:
  ReuseLruPolicy(int32_t num_blocks, double reuse_weight, int64_t history_capacity,
                 double smoothing)
      : reuse_weight_(reuse_weight),
        smoothing_(smoothing),
        order_(static_cast<size_t>(num_blocks)),
        last_access_(static_cast<size_t>(num_blocks), 0),
        uses_(num_blocks, history_capacity) {}

  void insert(int32_t block_id, const LeafInfo& leaf) override {
    const UseHistory::Stay& stay = uses_.enter(block_id, leaf);
    place(block_id, leaf.last_access, stay.earlier + stay.num_accesses);
  }

  // Whether evict_one() would return ``block_id`` right after insert(block_id, leaf); if
  // so, book what that round trip changes (the stay, the clock, the eviction age, the
  // history), leaving the order as it is.
  bool evicts_first(int32_t block_id, const LeafInfo& leaf) override {
    const int64_t num_uses = uses_.earlier(block_id, leaf) + leaf.num_accesses;
    const double bonus = num_uses > 1 ? reuse_weight_ * eviction_age_ : 0.0;
    if (!order_.before_all(static_cast<double>(leaf.last_access) + bonus, block_id)) {
      return false;
    }
    uses_.enter(block_id, leaf);
    now_ = std::max(now_, leaf.last_access);
    age(leaf.last_access);
    uses_.leave(block_id, false);
    return true;
  }

  void discard(int32_t block_id) override { order_.remove(block_id); }

  void touch(int32_t block_id, int64_t now) override {
    order_.remove(block_id);
    UseHistory::Stay& stay = uses_[block_id];
    ++stay.earlier;
    place(block_id, now, stay.earlier + stay.num_accesses);
  }

  int32_t evict_one() override {
    if (order_.empty()) return kNoBlock;
    const int32_t block_id = order_.pop();
    age(last_access_[block_id]);
    uses_.leave(block_id, false);  // a remembered hash keeps its place
    return block_id;
  }

  void clear() override {
    order_.clear();
    uses_.clear();
    eviction_age_ = 0.0;
    now_ = 0;
  }

  size_t size() const noexcept override { return order_.size(); }
  bool contains(int32_t block_id) const noexcept override { return order_.contains(block_id); }
  size_t memory_bytes() const noexcept override {
    return order_.memory_bytes() + last_access_.capacity() * sizeof(int64_t) +
           uses_.memory_bytes();
  }

 private:
  // A victim last accessed at ``last_access`` moves the running eviction age.
  void age(int64_t last_access) noexcept {
    const double waited = static_cast<double>(now_ - last_access);
    eviction_age_ += (waited - eviction_age_) * smoothing_;
  }

  void place(int32_t block_id, int64_t last_access, int64_t num_uses) {
    now_ = std::max(now_, last_access);
    const double bonus = num_uses > 1 ? reuse_weight_ * eviction_age_ : 0.0;
    last_access_[block_id] = last_access;
    order_.insert(block_id, static_cast<double>(last_access) + bonus);
  }

  const double reuse_weight_;
  const double smoothing_;
  double eviction_age_ = 0.0;  // running mean of (now - last access) of victims
  int64_t now_ = 0;            // the largest clock value seen
  KeyedHeap<double> order_;    // by last access + bonus
  std::vector<int64_t> last_access_;  // by block ID, while tracked
  UseHistory uses_;                   // stays and evicted hashes' hand-out counts
};

}  // namespace

std::unique_ptr<Policy> make_reuse_lru_policy(int32_t num_blocks, const PolicyOptions& options) {
  const double reuse_weight = options.get("reuse_weight", 1.0);
  if (!(reuse_weight >= 0)) {
    throw std::invalid_argument("reuse_weight must be a number >= 0, got " +
                                std::to_string(reuse_weight));
  }
  const int64_t history_capacity = options.get_int("history_capacity", 100'000, 0);
  const double smoothing = options.get("age_smoothing", 0.01);
  if (!(smoothing > 0 && smoothing <= 1)) {
    throw std::invalid_argument("age_smoothing must lie in (0, 1], got " +
                                std::to_string(smoothing));
  }
  return std::make_unique<ReuseLruPolicy>(num_blocks, reuse_weight, history_capacity, smoothing);
}

}  // namespace prefixcache
