// priority (policies/priority.py): retention priorities per prefix, with expiry.
//
// Each leaf is keyed (priority of its hash, last access, block ID), lowest first; leaves
// above the default priority sit apart, and they give victims while they hold more than
// max_retained_fraction of the tracked leaves (ranked at the default priority then), or
// when nothing else is left. Retention entries expire at their clock; without a clock
// callable (the native policy is built by name) the clock is the largest value seen in
// insert and touch, as in the Python class, and expiry runs where it runs there.
#include <algorithm>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../hash_index.h"
#include "factories.h"
#include "keyed_heap.h"

namespace prefixcache {

namespace {

using Rank = std::pair<int64_t, int64_t>;  // (priority, last access)

struct Retention {
  int64_t priority;
  int64_t expires_at;  // kNoExpiry: forever
};

class PriorityPolicy final : public CopyablePolicy<PriorityPolicy> {
 public:
  PriorityPolicy(int32_t num_blocks, int64_t default_priority, double max_retained_fraction)
      : default_(default_priority),
        max_retained_fraction_(max_retained_fraction),
        retained_(static_cast<size_t>(num_blocks)),
        others_(static_cast<size_t>(num_blocks)),
        hash_of_(static_cast<size_t>(num_blocks), 0),
        block_of_(static_cast<size_t>(num_blocks)) {}

  bool has_retention() const noexcept override { return true; }

  void set_retention(int64_t block_hash, int64_t priority, int64_t expires_at) override {
    drop_retention(block_hash);
    if (priority != default_) {
      retention_[block_hash] = Retention{priority, expires_at};
      if (expires_at != kNoExpiry) expiries_.emplace(expires_at, block_hash);
    }
    rerank(block_hash);
    expire();
  }

  void insert(int32_t block_id, const LeafInfo& leaf) override {
    now_ = std::max(now_, leaf.last_access);
    expire();
    place(block_id, leaf.block_hash, leaf.last_access);
  }

  void discard(int32_t block_id) override { remove(block_id); }

  void touch(int32_t block_id, int64_t now) override {
    now_ = std::max(now_, now);
    const int64_t block_hash = hash_of_[block_id];
    remove(block_id);
    place(block_id, block_hash, now);
    expire();
  }

  int32_t evict_one() override {
    expire();  // nothing is due between calls without a clock
    if (size() == 0) return kNoBlock;
    const int32_t block_id = next_victim();
    remove(block_id);
    return block_id;
  }

  void clear() override {
    retention_.clear();
    expiries_.clear();
    now_ = 0;
    retained_.clear();
    others_.clear();
    block_of_.clear();
  }

  size_t size() const noexcept override { return retained_.size() + others_.size(); }
  bool contains(int32_t block_id) const noexcept override {
    return retained_.contains(block_id) || others_.contains(block_id);
  }
  size_t memory_bytes() const noexcept override {
    return retained_.memory_bytes() + others_.memory_bytes() +
           hash_of_.capacity() * sizeof(int64_t) + block_of_.memory_bytes() +
           retention_.size() * (sizeof(int64_t) + sizeof(Retention) + 32) +
           expiries_.size() * (2 * sizeof(int64_t) + 32);
  }

 private:
  int64_t priority_of(int64_t block_hash) const {
    if (retention_.empty()) return default_;  // the common case: no probe
    const auto found = retention_.find(block_hash);
    return found == retention_.end() ? default_ : found->second.priority;
  }

  void place(int32_t block_id, int64_t block_hash, int64_t last_access) {
    const int64_t priority = priority_of(block_hash);
    hash_of_[block_id] = block_hash;
    if (block_of_.find(block_hash) >= 0) block_of_.erase(block_hash);  // the latest of twins
    block_of_.insert(block_hash, block_id);
    (priority > default_ ? retained_ : others_).insert(block_id, Rank{priority, last_access});
  }

  // Untrack ``block_id``; its last access.
  int64_t remove(int32_t block_id) {
    KeyedHeap<Rank>& list = retained_.contains(block_id) ? retained_ : others_;
    const int64_t last_access = list.key_of(block_id).second;
    list.remove(block_id);
    if (block_of_.find(hash_of_[block_id]) == block_id) block_of_.erase(hash_of_[block_id]);
    return last_access;
  }

  void rerank(int64_t block_hash) {
    const int32_t block_id = block_of_.find(block_hash);
    if (block_id < 0) return;
    const int64_t last_access = remove(block_id);
    place(block_id, block_hash, last_access);
  }

  void drop_retention(int64_t block_hash) {
    const auto found = retention_.find(block_hash);
    if (found == retention_.end()) return;
    if (found->second.expires_at != kNoExpiry) {
      expiries_.erase({found->second.expires_at, block_hash});
    }
    retention_.erase(found);
  }

  void expire() {
    while (!expiries_.empty() && expiries_.begin()->first <= now_) {
      const int64_t block_hash = expiries_.begin()->second;
      expiries_.erase(expiries_.begin());
      retention_.erase(block_hash);
      rerank(block_hash);
    }
  }

  int32_t next_victim() const {
    if (others_.empty()) return retained_.top();
    const int32_t candidate = others_.top();
    const bool over_cap = static_cast<double>(retained_.size()) >
                          max_retained_fraction_ * static_cast<double>(size());
    if (!over_cap) return candidate;
    // The oldest retained leaf competes at the default priority.
    const int32_t oldest = retained_.top();
    const Rank rank{default_, retained_.key_of(oldest).second};
    const Rank& other = others_.key_of(candidate);
    const bool oldest_first = rank < other || (!(other < rank) && oldest < candidate);
    return oldest_first ? oldest : candidate;
  }

  const int64_t default_;
  const double max_retained_fraction_;
  int64_t now_ = 0;  // the largest clock value seen
  std::unordered_map<int64_t, Retention> retention_;  // hash -> entry
  std::set<std::pair<int64_t, int64_t>> expiries_;     // (expires_at, hash) of expiring ones
  KeyedHeap<Rank> retained_, others_;  // leaves above the default priority, and the rest
  std::vector<int64_t> hash_of_;       // by tracked block ID
  HashIndex block_of_;                 // hash -> tracked block ID
};

}  // namespace

std::unique_ptr<Policy> make_priority_policy(int32_t num_blocks, const PolicyOptions& options) {
  const double priority = options.get("default_priority", 35);
  if (priority != static_cast<double>(static_cast<int64_t>(priority))) {
    throw std::invalid_argument("default_priority must be an int, got " +
                                std::to_string(priority));
  }
  const double fraction = options.get("max_retained_fraction", 0.5);
  if (!(fraction >= 0 && fraction <= 1)) {
    throw std::invalid_argument("max_retained_fraction must lie in [0, 1], got " +
                                std::to_string(fraction));
  }
  return std::make_unique<PriorityPolicy>(num_blocks, static_cast<int64_t>(priority), fraction);
}

}  // namespace prefixcache
