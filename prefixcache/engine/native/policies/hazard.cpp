// hazard (policies/hazard.py): evict the leaf least likely to be reused within the next
// few cache lifetimes.
//
// Leaves fall into 32 classes by use count (carried across evictions by hash) and chain
// depth; per class the policy learns the distribution of reuse ages (decayed counts per
// log-spaced age bin) and scores the oldest leaf of each class by the empirical hazard of
// reuse within window lifetimes; the lowest score goes, ties to the oldest. Every count,
// table refresh and score repeats the Python class's double arithmetic in its order. The
// class heaps share one position and key array (a leaf is in one class at a time). The leaf
// inserted last waits outside its heap until another call comes (pending_): evicting a chain
// from its end, each exposed parent is mostly the next victim, so it never enters a heap.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "factories.h"
#include "hazard_bins.h"
#include "hazard_hashes.h"
#include "hazard_heaps.h"
#include "hazard_learning.h"

namespace prefixcache {

namespace {

constexpr int kNumUseBuckets = 4;
constexpr int kNumDepthBuckets = 8;
constexpr int kNumClasses = kNumUseBuckets * kNumDepthBuckets;

int bit_length(int64_t value) noexcept {
#if defined(__GNUC__)
  return value != 0 ? 64 - __builtin_clzll(static_cast<uint64_t>(value)) : 0;
#else
  int bits = 0;
  for (uint64_t v = static_cast<uint64_t>(value); v; v >>= 1) ++bits;
  return bits;
#endif
}

int lowest_bit(uint32_t bits) noexcept {  // bits != 0
#if defined(__GNUC__)
  return __builtin_ctz(bits);
#else
  int index = 0;
  while (!(bits & 1)) bits >>= 1, ++index;
  return index;
#endif
}

int class_of(int64_t num_uses, int64_t depth) noexcept {
  const int use_bucket = std::min(bit_length(std::max<int64_t>(num_uses, 1) - 1),
                                  kNumUseBuckets - 1);
  return use_bucket * kNumDepthBuckets + std::min(bit_length(depth), kNumDepthBuckets - 1);
}

struct Stay {
  bool live = false;
  int64_t block_hash = 0;
  int64_t num_accesses = 0;
  int64_t num_uses = 0;
  int64_t depth = 0;
  int64_t last_access = 0;
  int klass = 0;
  int32_t entry = HazardHashes::kNone;  // its hash's place in hashes_ (a hint for forget)
};

class HazardPolicy final : public CopyablePolicy<HazardPolicy> {
  using Learning = HazardLearning<kNumClasses>;

 public:
  HazardPolicy(int32_t num_blocks, int64_t history_capacity, int64_t half_life,
               double prior_weight, double smoothing, double window)
      : history_capacity_(history_capacity),
        smoothing_(smoothing),
        heaps_(static_cast<size_t>(num_blocks)),
        stays_(static_cast<size_t>(num_blocks)),
        hashes_(2 * static_cast<size_t>(std::min<int64_t>(history_capacity, int64_t{1} << 30)) + 1),
        learning_(std::pow(0.5, static_cast<double>(Learning::kRefreshEvents) /
                                    static_cast<double>(half_life)),
                   prior_weight, window) {
    clear();
  }

  void insert(int32_t block_id, const LeafInfo& leaf) override {
    settle();
    // The maps are probed below unless the stay is live: start loading the index.
    hashes_.prefetch(leaf.block_hash);
    now_ = std::max(now_, leaf.last_access);
    Stay& stay = stays_[block_id];
    if (stay.live && stay.block_hash == leaf.block_hash &&
        stay.num_accesses <= leaf.num_accesses) {
      const int64_t new_uses = leaf.num_accesses - stay.num_accesses;
      if (new_uses) {
        learning_.record_reuse(stay.klass, leaf.last_access - stay.last_access);
        stay.num_uses += new_uses;
        stay.num_accesses = leaf.num_accesses;
        stay.klass = class_of(stay.num_uses, leaf.depth);
        learning_.enter(stay.klass);
      }
      stay.last_access = leaf.last_access;
    } else {
      int64_t num_uses = leaf.num_accesses;
      int64_t earlier_uses = 0;
      HazardGhost seen;
      HazardHashes::Found found;
      // Left in the table (in neither map) for forget(), which mostly follows.
      const int32_t entry = hashes_.take(leaf.block_hash, history_capacity_ > 0, &earlier_uses,
                                         &seen, &found);
      if (found == HazardHashes::Found::kReturned) {
        num_uses += earlier_uses;  // its reuse was recorded at registration
      } else if (found == HazardHashes::Found::kHistory) {
        learning_.record_reuse(seen.klass, leaf.last_access - seen.last_access);
        num_uses += seen.num_uses;
      }
      const int klass = class_of(num_uses, leaf.depth);
      stay = Stay{true,          leaf.block_hash, leaf.num_accesses, num_uses, leaf.depth,
                  leaf.last_access, klass,        entry};
      learning_.enter(klass);
    }
    pending_ = block_id;  // the heap insert waits: the next eviction most likely takes it
  }

  void on_register(const int64_t* hashes, size_t count, int64_t) override {
    constexpr size_t kAhead = 8;  // history lookups started before they are needed
    for (size_t i = 0; i < std::min(count, kAhead); ++i) hashes_.prefetch(hashes[i]);
    const size_t capacity = static_cast<size_t>(history_capacity_);
    for (size_t i = 0; i < count; ++i) {
      if (i + kAhead < count) hashes_.prefetch(hashes[i + kAhead]);
      HazardGhost seen;
      if (!hashes_.history_to_returned(hashes[i], &seen, capacity)) continue;
      learning_.record_reuse(seen.klass, now_ - seen.last_access);
    }
  }

  void discard(int32_t block_id) override {
    if (block_id == pending_) {
      pending_ = kNoBlock;
    } else {
      heaps_.remove(block_id);
    }
  }

  void touch(int32_t block_id, int64_t now) override {
    discard(block_id);
    Stay& stay = stays_[block_id];
    now_ = std::max(now_, now);
    learning_.record_reuse(stay.klass, now - stay.last_access);
    ++stay.num_uses;
    stay.last_access = now;
    stay.klass = class_of(stay.num_uses, stay.depth);
    learning_.enter(stay.klass);
    heaps_.insert(block_id, stay.klass, stay.last_access, stay.depth);
  }

  int32_t evict_one() override {
    // Each class's oldest leaf competes; the pending leaf is its class's oldest when it is
    // older than the heap's top (or the heap is empty).
    const uint32_t in_heaps = heaps_.non_empty();
    uint32_t classes = in_heaps;
    int pending_class = -1;
    Entry pending{};
    if (pending_ != kNoBlock) {
      const Stay& stay = stays_[pending_];
      pending_class = stay.klass;
      pending = Entry{stay.last_access, -stay.depth, pending_};
      classes |= uint32_t{1} << pending_class;
    }
    if (classes == 0) return kNoBlock;
    int best_class = -1;
    double best_score = 0.0;
    const Entry* best = nullptr;
    const double reach = learning_.reach();
    for (; classes; classes &= classes - 1) {
      const int klass = lowest_bit(classes);  // classes in increasing order, as Python's
      const Entry* top = klass == pending_class && (!(in_heaps >> klass & 1) ||
                                                    pending < heaps_.top(klass))
                             ? &pending
                             : &heaps_.top(klass);
      const double age = static_cast<double>(now_ - top->last_access);
      const double candidate_score = learning_.score(klass, age, reach);
      if (best_class < 0 || candidate_score < best_score ||
          (candidate_score == best_score && *top < *best)) {
        best_class = klass;
        best_score = candidate_score;
        best = top;
      }
    }
    const int32_t block_id = best->block_id;
    if (best == &pending) {
      pending_ = kNoBlock;
    } else {
      heaps_.remove(block_id);
    }
    forget(block_id);
    return block_id;
  }

  void clear() override {
    pending_ = kNoBlock;
    heaps_.clear();
    std::fill(stays_.begin(), stays_.end(), Stay{});
    hashes_.clear();
    learning_.clear();
    now_ = 0;
  }

  size_t size() const noexcept override { return heaps_.size() + (pending_ != kNoBlock); }
  bool contains(int32_t block_id) const noexcept override {
    return block_id == pending_ || heaps_.contains(block_id);
  }
  size_t memory_bytes() const noexcept override {
    return heaps_.memory_bytes() + stays_.capacity() * sizeof(Stay) + hashes_.memory_bytes() +
           sizeof(*this);
  }

 private:
  using Entry = HazardClassHeaps<kNumClasses>::Entry;

  // Put the pending leaf into its class's heap.
  void settle() {
    if (pending_ == kNoBlock) return;
    const Stay& stay = stays_[pending_];
    heaps_.insert(pending_, stay.klass, stay.last_access, stay.depth);
    pending_ = kNoBlock;
  }

  void forget(int32_t block_id) {
    Stay& stay = stays_[block_id];
    stay.live = false;
    if (history_capacity_ > 0) {
      hashes_.put_history(stay.block_hash, HazardGhost{stay.num_uses, stay.last_access, stay.klass},
                          stay.entry, static_cast<size_t>(history_capacity_));
    }
    learning_.evicted(now_ - stay.last_access, smoothing_);
  }

  const int64_t history_capacity_;
  const double smoothing_;
  HazardClassHeaps<kNumClasses> heaps_;
  std::vector<Stay> stays_;     // by block ID: tracked, or out for a hit
  // Evicted hash -> its last stay, and hash registered again -> uses of earlier stays;
  // each oldest first.
  HazardHashes hashes_;
  Learning learning_;
  int64_t now_ = 0;  // the largest clock value seen
  // The last leaf inserted, tracked but kept out of the heaps until another call needs them
  // in order (mostly a victim's exposed parent, which is the next victim); or kNoBlock.
  int32_t pending_ = kNoBlock;
};

}  // namespace

std::unique_ptr<Policy> make_hazard_policy(int32_t num_blocks, const PolicyOptions& options) {
  const int64_t history_capacity = options.get_int("history_capacity", 100'000, 0);
  const int64_t half_life = options.get_int("half_life", 200'000, 1);
  const double prior_weight = options.get("prior_weight", 8.0);
  if (!(prior_weight > 0)) {
    throw std::invalid_argument("prior_weight must be a number > 0, got " +
                                std::to_string(prior_weight));
  }
  const double smoothing = options.get("age_smoothing", 0.01);
  if (!(smoothing > 0 && smoothing <= 1)) {
    throw std::invalid_argument("age_smoothing must lie in (0, 1], got " +
                                std::to_string(smoothing));
  }
  const double window = options.get("window", 4.0);
  if (!(window > 0)) {
    throw std::invalid_argument("window must be a number > 0, got " + std::to_string(window));
  }
  return std::make_unique<HazardPolicy>(num_blocks, history_capacity, half_life, prior_weight,
                                        smoothing, window);
}

}  // namespace prefixcache
