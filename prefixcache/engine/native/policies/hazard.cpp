// hazard (policies/hazard.py): evict the leaf least likely to be reused within the next
// few cache lifetimes.
//
// Leaves fall into 32 classes by use count (carried across evictions by hash) and chain
// depth; per class the policy learns the distribution of reuse ages (decayed counts per
// log-spaced age bin) and scores the oldest leaf of each class by the empirical hazard of
// reuse within window lifetimes; the lowest score goes, ties to the oldest. Every count,
// table refresh and score repeats the Python class's double arithmetic in its order. The
// class heaps share one position and key array (a leaf is in one class at a time).
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "factories.h"
#include "linked_map.h"

namespace prefixcache {

namespace {

constexpr int kBinsPerOctave = 4;
constexpr int kNumAgeBins = 128;
constexpr int kNumUseBuckets = 4;
constexpr int kNumDepthBuckets = 8;
constexpr int kNumClasses = kNumUseBuckets * kNumDepthBuckets;
constexpr int64_t kRefreshEvents = 256;

int bit_length(int64_t value) noexcept {
  int bits = 0;
  for (uint64_t v = static_cast<uint64_t>(value); v; v >>= 1) ++bits;
  return bits;
}

int age_bin(double age) noexcept {
  const double bin = std::log2(age + 1.0) * kBinsPerOctave;
  return bin >= kNumAgeBins - 1 ? kNumAgeBins - 1 : static_cast<int>(bin);
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
};

struct Ghost {
  int64_t num_uses;
  int64_t last_access;
  int klass;
};

// Per-class heaps of leaves keyed (last access, -depth, block ID), lowest first.
class ClassHeaps {
 public:
  explicit ClassHeaps(size_t num_blocks) : key_(num_blocks), position_(num_blocks, -1),
                                           class_(num_blocks, 0) {}
  using Key = std::tuple<int64_t, int64_t, int32_t>;

  size_t size() const noexcept { return size_; }
  bool contains(int32_t block_id) const noexcept { return position_[block_id] >= 0; }
  const Key& key_of(int32_t block_id) const noexcept { return key_[block_id]; }
  bool empty(int klass) const noexcept { return heaps_[klass].empty(); }
  int32_t top(int klass) const noexcept { return heaps_[klass][0]; }

  void insert(int32_t block_id, int klass, int64_t last_access, int64_t depth) {
    key_[block_id] = Key{last_access, -depth, block_id};
    class_[block_id] = klass;
    std::vector<int32_t>& heap = heaps_[klass];
    heap.push_back(block_id);
    position_[block_id] = static_cast<int32_t>(heap.size() - 1);
    sift_up(heap, heap.size() - 1);
    ++size_;
  }

  void remove(int32_t block_id) noexcept {
    std::vector<int32_t>& heap = heaps_[class_[block_id]];
    const size_t at = static_cast<size_t>(position_[block_id]);
    position_[block_id] = -1;
    --size_;
    const int32_t last = heap.back();
    heap.pop_back();
    if (at == heap.size()) return;
    heap[at] = last;
    position_[last] = static_cast<int32_t>(at);
    if (!sift_up(heap, at)) sift_down(heap, at);
  }

  void clear() noexcept {
    for (std::vector<int32_t>& heap : heaps_) {
      for (const int32_t block_id : heap) position_[block_id] = -1;
      heap.clear();
    }
    size_ = 0;
  }

  size_t memory_bytes() const noexcept {
    size_t bytes = key_.capacity() * sizeof(Key) + position_.capacity() * sizeof(int32_t) +
                   class_.capacity() * sizeof(int8_t);
    for (const std::vector<int32_t>& heap : heaps_) bytes += heap.capacity() * sizeof(int32_t);
    return bytes;
  }

 private:
  bool sift_up(std::vector<int32_t>& heap, size_t at) noexcept {
    const int32_t block_id = heap[at];
    const size_t start = at;
    while (at > 0) {
      const size_t parent = (at - 1) / 2;
      if (!(key_[block_id] < key_[heap[parent]])) break;
      heap[at] = heap[parent];
      position_[heap[at]] = static_cast<int32_t>(at);
      at = parent;
    }
    heap[at] = block_id;
    position_[block_id] = static_cast<int32_t>(at);
    return at != start;
  }

  void sift_down(std::vector<int32_t>& heap, size_t at) noexcept {
    const int32_t block_id = heap[at];
    for (;;) {
      size_t child = 2 * at + 1;
      if (child >= heap.size()) break;
      if (child + 1 < heap.size() && key_[heap[child + 1]] < key_[heap[child]]) ++child;
      if (!(key_[heap[child]] < key_[block_id])) break;
      heap[at] = heap[child];
      position_[heap[at]] = static_cast<int32_t>(at);
      at = child;
    }
    heap[at] = block_id;
    position_[block_id] = static_cast<int32_t>(at);
  }

  std::vector<Key> key_;
  std::vector<int32_t> position_;
  std::vector<int8_t> class_;
  std::vector<int32_t> heaps_[kNumClasses];
  size_t size_ = 0;
};

class HazardPolicy final : public CopyablePolicy<HazardPolicy> {
 public:
  HazardPolicy(int32_t num_blocks, int64_t history_capacity, int64_t half_life,
               double prior_weight, double smoothing, double window)
      : history_capacity_(history_capacity),
        window_(window),
        decay_(std::pow(0.5, static_cast<double>(kRefreshEvents) / static_cast<double>(half_life))),
        prior_weight_(prior_weight),
        smoothing_(smoothing),
        heaps_(static_cast<size_t>(num_blocks)),
        stays_(static_cast<size_t>(num_blocks)),
        history_(static_cast<size_t>(std::min<int64_t>(history_capacity, 1 << 16))),
        returned_(16) {
    clear();
  }

  void insert(int32_t block_id, const LeafInfo& leaf) override {
    now_ = std::max(now_, leaf.last_access);
    Stay& stay = stays_[block_id];
    if (stay.live && stay.block_hash == leaf.block_hash &&
        stay.num_accesses <= leaf.num_accesses) {
      const int64_t new_uses = leaf.num_accesses - stay.num_accesses;
      if (new_uses) {
        record_reuse(stay.klass, leaf.last_access - stay.last_access);
        stay.num_uses += new_uses;
        stay.num_accesses = leaf.num_accesses;
        stay.klass = class_of(stay.num_uses, leaf.depth);
        enter(stay.klass);
      }
      stay.last_access = leaf.last_access;
    } else {
      int64_t num_uses = leaf.num_accesses;
      if (const int64_t* earlier = returned_.get(leaf.block_hash)) {
        num_uses += *earlier;  // its reuse was recorded at registration
        returned_.erase(leaf.block_hash);
      } else if (const Ghost* ghost = history_.get(leaf.block_hash)) {
        const Ghost seen = *ghost;
        history_.erase(leaf.block_hash);
        record_reuse(seen.klass, leaf.last_access - seen.last_access);
        num_uses += seen.num_uses;
      }
      const int klass = class_of(num_uses, leaf.depth);
      stay = Stay{true, leaf.block_hash, leaf.num_accesses, num_uses, leaf.depth,
                  leaf.last_access, klass};
      enter(klass);
    }
    heaps_.insert(block_id, stay.klass, stay.last_access, stay.depth);
  }

  void on_register(const int64_t* hashes, size_t count, int64_t) override {
    for (size_t i = 0; i < count; ++i) {
      const Ghost* ghost = history_.get(hashes[i]);
      if (!ghost) continue;
      const Ghost seen = *ghost;
      history_.erase(hashes[i]);
      record_reuse(seen.klass, now_ - seen.last_access);
      returned_.put(hashes[i], seen.num_uses);
      if (static_cast<int64_t>(returned_.size()) > history_capacity_) returned_.pop_oldest();
    }
  }

  void discard(int32_t block_id) override { heaps_.remove(block_id); }

  void touch(int32_t block_id, int64_t now) override {
    heaps_.remove(block_id);
    Stay& stay = stays_[block_id];
    now_ = std::max(now_, now);
    record_reuse(stay.klass, now - stay.last_access);
    ++stay.num_uses;
    stay.last_access = now;
    stay.klass = class_of(stay.num_uses, stay.depth);
    enter(stay.klass);
    heaps_.insert(block_id, stay.klass, stay.last_access, stay.depth);
  }

  int32_t evict_one() override {
    if (heaps_.size() == 0) return kNoBlock;
    int best_class = -1;
    double best_score = 0.0;
    for (int klass = 0; klass < kNumClasses; ++klass) {
      if (heaps_.empty(klass)) continue;
      const int32_t candidate = heaps_.top(klass);
      const double candidate_score = score(klass, now_ - std::get<0>(heaps_.key_of(candidate)));
      if (best_class < 0 || candidate_score < best_score ||
          (candidate_score == best_score &&
           heaps_.key_of(candidate) < heaps_.key_of(heaps_.top(best_class)))) {
        best_class = klass;
        best_score = candidate_score;
      }
    }
    const int32_t block_id = heaps_.top(best_class);
    heaps_.remove(block_id);
    forget(block_id);
    return block_id;
  }

  void clear() override {
    heaps_.clear();
    std::fill(stays_.begin(), stays_.end(), Stay{});
    history_.clear();
    returned_.clear();
    std::fill(std::begin(entered_), std::end(entered_), 0.0);
    for (auto& reuses : reuses_) std::fill(std::begin(reuses), std::end(reuses), 0.0);
    for (auto& cumulative : cumulative_) {
      std::fill(std::begin(cumulative), std::end(cumulative), 0.0);
    }
    std::fill(std::begin(pooled_), std::end(pooled_), 0.0);
    events_ = 0;
    lifetime_ = 0.0;
    now_ = 0;
  }

  size_t size() const noexcept override { return heaps_.size(); }
  bool contains(int32_t block_id) const noexcept override { return heaps_.contains(block_id); }
  size_t memory_bytes() const noexcept override {
    return heaps_.memory_bytes() + stays_.capacity() * sizeof(Stay) + history_.memory_bytes() +
           returned_.memory_bytes() + sizeof(*this);
  }

 private:
  void enter(int klass) {
    entered_[klass] += 1.0;
    tick();
  }

  void record_reuse(int klass, int64_t age) {
    reuses_[klass][age_bin(static_cast<double>(std::max<int64_t>(age, 0)))] += 1.0;
  }

  void tick() {
    if (++events_ % kRefreshEvents == 0) refresh();
  }

  void refresh() {
    double total_entered = 0.0;
    double pooled[kNumAgeBins + 1] = {};
    for (int klass = 0; klass < kNumClasses; ++klass) {
      entered_[klass] *= decay_;
      total_entered += entered_[klass];
      double running = 0.0;
      for (int bin = 0; bin < kNumAgeBins; ++bin) {
        reuses_[klass][bin] *= decay_;
        running += reuses_[klass][bin];
        cumulative_[klass][bin + 1] = running;
        pooled[bin + 1] += running;
      }
    }
    const double scale = total_entered > 0 ? 1.0 / total_entered : 0.0;
    for (int bin = 0; bin <= kNumAgeBins; ++bin) pooled_[bin] = pooled[bin] * scale;
  }

  double score(int klass, int64_t age) const noexcept {
    const int low = age_bin(static_cast<double>(age));
    const int high = age_bin(static_cast<double>(age) + window_ * lifetime_) + 1;
    const double* cumulative = cumulative_[klass];
    const double reused_in_window =
        cumulative[high] - cumulative[low] + prior_weight_ * (pooled_[high] - pooled_[low]);
    const double survivors =
        entered_[klass] - cumulative[low] + prior_weight_ * (1.0 - pooled_[low]);
    return survivors > 0 ? reused_in_window / survivors : 0.0;
  }

  void forget(int32_t block_id) {
    Stay& stay = stays_[block_id];
    stay.live = false;
    lifetime_ += (static_cast<double>(now_ - stay.last_access) - lifetime_) * smoothing_;
    if (history_capacity_ > 0) {
      history_.put(stay.block_hash, Ghost{stay.num_uses, stay.last_access, stay.klass});
      if (static_cast<int64_t>(history_.size()) > history_capacity_) history_.pop_oldest();
    }
    tick();
  }

  const int64_t history_capacity_;
  const double window_;
  const double decay_;
  const double prior_weight_;
  const double smoothing_;
  ClassHeaps heaps_;
  std::vector<Stay> stays_;     // by block ID: tracked, or out for a hit
  LinkedMap<Ghost> history_;    // evicted hash -> its last stay, oldest first
  LinkedMap<int64_t> returned_;  // hash registered again -> uses of earlier stays
  double entered_[kNumClasses];
  double reuses_[kNumClasses][kNumAgeBins];
  double cumulative_[kNumClasses][kNumAgeBins + 1];
  double pooled_[kNumAgeBins + 1];
  int64_t events_ = 0;
  double lifetime_ = 0.0;  // running mean idle age of victims
  int64_t now_ = 0;        // the largest clock value seen
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
