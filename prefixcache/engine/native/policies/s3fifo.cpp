// s3fifo (policies/s3fifo.py): small and main FIFO queues with a ghost list of hashes.
//
// Step for step the Python class's rules: a stay per block ID (hash, queue place, queue,
// reuse count capped at 3, hand-outs seen) that survives a hit, so a block released again
// returns to its place; new blocks enter small, or main when their hash is a ghost; small's
// head moves to main once reused promote_after times, else is evicted to the ghost list;
// main's head gets second chances while reused. Queue places are (clock, sequence), the
// SortedList keys of the Python class, kept in two keyed heaps.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "factories.h"
#include "keyed_heap.h"
#include "linked_map.h"

namespace prefixcache {

namespace {

constexpr int64_t kMaxFrequency = 3;  // S3-FIFO's two-bit counter
// The ghost list's index starts this small and doubles as it fills: a table sized for the
// whole ghost_capacity (50,000) up front spreads a short run's few hashes over megabytes,
// so each probe missed the cache.
constexpr int64_t kGhostStart = 1024;

using Place = std::pair<int64_t, int64_t>;  // (clock, sequence)

struct Stay {
  bool live = false;  // a stay is remembered for this block ID
  bool in_main = false;
  int64_t block_hash = 0;
  int64_t frequency = 0;
  int64_t num_accesses = 0;
  Place place{0, 0};
};

class S3FifoPolicy final : public CopyablePolicy<S3FifoPolicy> {
 public:
  S3FifoPolicy(int32_t num_blocks, double small_fraction, int64_t ghost_capacity,
               int64_t promote_after)
      : small_fraction_(small_fraction),
        ghost_capacity_(ghost_capacity),
        promote_after_(promote_after),
        small_(static_cast<size_t>(num_blocks)),
        main_(static_cast<size_t>(num_blocks)),
        stays_(static_cast<size_t>(num_blocks)),
        ghost_(static_cast<size_t>(std::min<int64_t>(ghost_capacity, kGhostStart))) {}

  void insert(int32_t block_id, const LeafInfo& leaf) override {
    Stay& stay = stays_[block_id];
    now_ = std::max(now_, leaf.last_access);
    if (!stay.live || stay.block_hash != leaf.block_hash ||
        stay.num_accesses > leaf.num_accesses) {
      const bool in_main = ghost_.erase(leaf.block_hash);
      const int64_t reuses = in_main ? 0 : leaf.num_accesses - 1;
      stay = Stay{true, in_main, leaf.block_hash, std::min(reuses, kMaxFrequency),
                  leaf.num_accesses, next_place(leaf.last_access)};
    } else {
      const int64_t reuses = leaf.num_accesses - stay.num_accesses;
      stay.frequency = std::min(stay.frequency + reuses, kMaxFrequency);
      stay.num_accesses = leaf.num_accesses;
    }
    queue_of(stay).insert(block_id, stay.place);
    ++num_tracked_;
  }

  void discard(int32_t block_id) override {
    queue_of(stays_[block_id]).remove(block_id);
    --num_tracked_;
  }

  void touch(int32_t block_id, int64_t now) override {
    Stay& stay = stays_[block_id];
    now_ = std::max(now_, now);
    stay.frequency = std::min(stay.frequency + 1, kMaxFrequency);
  }

  int32_t evict_one() override {
    while (num_tracked_ > 0) {
      const bool small_is_full = static_cast<double>(small_.size()) >
                                 small_fraction_ * static_cast<double>(num_tracked_);
      const int32_t victim =
          !small_.empty() && (small_is_full || main_.empty()) ? pop_small() : pop_main();
      if (victim != kNoBlock) return victim;
    }
    return kNoBlock;
  }

  void clear() override {
    small_.clear();
    main_.clear();
    std::fill(stays_.begin(), stays_.end(), Stay{});
    ghost_.clear();
    num_tracked_ = 0;
    now_ = sequence_ = 0;
  }

  size_t size() const noexcept override { return num_tracked_; }
  bool contains(int32_t block_id) const noexcept override {
    return small_.contains(block_id) || main_.contains(block_id);
  }
  size_t memory_bytes() const noexcept override {
    return small_.memory_bytes() + main_.memory_bytes() + stays_.capacity() * sizeof(Stay) +
           ghost_.memory_bytes();
  }

 private:
  KeyedHeap<Place>& queue_of(const Stay& stay) noexcept { return stay.in_main ? main_ : small_; }

  Place next_place(int64_t clock) noexcept { return Place{clock, ++sequence_}; }

  // Small's head: to main if reused enough (no victim), else evicted to the ghost list.
  int32_t pop_small() {
    const int32_t block_id = small_.pop();
    Stay& stay = stays_[block_id];
    if (stay.frequency >= promote_after_) {
      requeue(block_id, stay, 0);
      return kNoBlock;
    }
    forget(block_id, stay);
    if (ghost_capacity_ > 0) {
      ghost_.put(stay.block_hash, 0);
      if (static_cast<int64_t>(ghost_.size()) > ghost_capacity_) ghost_.pop_oldest();
    }
    return block_id;
  }

  // Main's head: a second chance at main's back while reused, else evicted.
  int32_t pop_main() {
    const int32_t block_id = main_.pop();
    Stay& stay = stays_[block_id];
    if (stay.frequency > 0) {
      requeue(block_id, stay, stay.frequency - 1);
      return kNoBlock;
    }
    forget(block_id, stay);
    return block_id;
  }

  void requeue(int32_t block_id, Stay& stay, int64_t frequency) {
    stay.in_main = true;
    stay.frequency = frequency;
    stay.place = next_place(now_);
    main_.insert(block_id, stay.place);
  }

  void forget(int32_t, Stay& stay) noexcept {
    stay.live = false;
    --num_tracked_;
  }

  const double small_fraction_;
  const int64_t ghost_capacity_;
  const int64_t promote_after_;
  KeyedHeap<Place> small_, main_;
  std::vector<Stay> stays_;   // by block ID
  LinkedMap<char> ghost_;     // evicted hashes, oldest first
  size_t num_tracked_ = 0;
  int64_t now_ = 0;       // the largest clock value seen
  int64_t sequence_ = 0;  // tie-break of equal clock values, in queueing order
};

}  // namespace

std::unique_ptr<Policy> make_s3fifo_policy(int32_t num_blocks, const PolicyOptions& options) {
  const double small_fraction = options.get("small_fraction", 0.1);
  if (!(small_fraction > 0 && small_fraction < 1)) {
    throw std::invalid_argument("small_fraction must lie in (0, 1), got " +
                                std::to_string(small_fraction));
  }
  const int64_t ghost_capacity = options.get_int("ghost_capacity", 50'000, 0);
  const int64_t promote_after = options.get_int("promote_after", 1, 1);
  return std::make_unique<S3FifoPolicy>(num_blocks, small_fraction, ghost_capacity,
                                        promote_after);
}

}  // namespace prefixcache
