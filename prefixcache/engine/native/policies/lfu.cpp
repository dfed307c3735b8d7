// lfu (policies/lfu.py): least frequently used, with dynamic ageing.
//
// A leaf's score is the age (the score of the last victim) at its last insert or touch
// plus frequency_weight per access; the lowest (score, last access, block ID) goes first,
// and each victim raises the age to its score. The same double arithmetic as the Python
// class, in the same order, so scores and ties are bit for bit its own.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "factories.h"
#include "keyed_heap.h"

namespace prefixcache {

namespace {

using Score = std::pair<double, int64_t>;  // (age + weight * accesses, last access)

class LfuPolicy final : public CopyablePolicy<LfuPolicy> {
 public:
  LfuPolicy(int32_t num_blocks, double weight)
      : weight_(weight),
        order_(static_cast<size_t>(num_blocks)),
        accesses_(static_cast<size_t>(num_blocks), 0) {}

  void insert(int32_t block_id, const LeafInfo& leaf) override {
    accesses_[block_id] = leaf.num_accesses;
    order_.insert(block_id, score(block_id, leaf.last_access));
  }
  void discard(int32_t block_id) override { order_.remove(block_id); }
  void touch(int32_t block_id, int64_t now) override {
    ++accesses_[block_id];
    order_.rekey(block_id, score(block_id, now));
  }
  int32_t evict_one() override {
    if (order_.empty()) return kNoBlock;
    const int32_t block_id = order_.top();
    age_ = std::max(age_, order_.key_of(block_id).first);
    order_.pop();
    return block_id;
  }
  void clear() override {
    order_.clear();
    age_ = 0.0;
  }
  size_t size() const noexcept override { return order_.size(); }
  bool contains(int32_t block_id) const noexcept override { return order_.contains(block_id); }
  size_t memory_bytes() const noexcept override {
    return order_.memory_bytes() + accesses_.capacity() * sizeof(int64_t);
  }

 private:
  Score score(int32_t block_id, int64_t last_access) const noexcept {
    return Score{age_ + weight_ * static_cast<double>(accesses_[block_id]), last_access};
  }

  const double weight_;
  double age_ = 0.0;  // score of the last victim
  KeyedHeap<Score> order_;
  std::vector<int64_t> accesses_;  // accesses counted so far, by block ID (while tracked)
};

}  // namespace

std::unique_ptr<Policy> make_lfu_policy(int32_t num_blocks, const PolicyOptions& options) {
  const double weight = options.get("frequency_weight", 1.0);
  if (!(weight > 0)) {
    throw std::invalid_argument("frequency_weight must be a number > 0, got " +
                                std::to_string(weight));
  }
  return std::make_unique<LfuPolicy>(num_blocks, weight);
}

}  // namespace prefixcache
