// arc (policies/arc.py): adaptive replacement over the cached leaves.
//
// T1 holds leaves used once, T2 leaves used again, each by (last access, block ID); the
// hashes of evicted leaves go to the ghost list of the list they left (B1, B2). A
// returning hash found on B1 raises the target share p of T1, one found on B2 lowers it,
// by ARC's steps over the tracked leaves; the victim is T1's oldest while T1 is over its
// share, else T2's. A stay per block ID (hash, hand-outs seen, frequent) survives a hit,
// as in the Python class, whose double arithmetic for p this repeats step for step.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "factories.h"
#include "keyed_heap.h"
#include "linked_map.h"

namespace prefixcache {

namespace {

struct Stay {
  bool live = false;
  bool frequent = false;
  int64_t block_hash = 0;
  int64_t num_accesses = 0;
};

class ArcPolicy final : public CopyablePolicy<ArcPolicy> {
 public:
  ArcPolicy(int32_t num_blocks, int64_t ghost_capacity, double initial_share)
      : ghost_capacity_(ghost_capacity),
        initial_share_(initial_share),
        share_(initial_share),
        t1_(static_cast<size_t>(num_blocks)),
        t2_(static_cast<size_t>(num_blocks)),
        stays_(static_cast<size_t>(num_blocks)),
        b1_(static_cast<size_t>(std::min<int64_t>(ghost_capacity, 1 << 16))),
        b2_(static_cast<size_t>(std::min<int64_t>(ghost_capacity, 1 << 16))) {}

  void insert(int32_t block_id, const LeafInfo& leaf) override {
    Stay& stay = stays_[block_id];
    GhostHit hit{nullptr, share_};
    const bool frequent = goes_to_t2(stay, leaf, &hit);
    take_ghost(hit, leaf.block_hash);
    stay = Stay{true, frequent, leaf.block_hash, leaf.num_accesses};
    (frequent ? t2_ : t1_).insert(block_id, leaf.last_access);
  }

  // Whether evict_one() would return ``block_id`` right after insert(block_id, leaf); if
  // so, book what that round trip changes: the ghost hit (hash off its list, p adapted),
  // the stay ended, the hash remembered on the ghost list of the list it would have left.
  bool evicts_first(int32_t block_id, const LeafInfo& leaf) override {
    Stay& stay = stays_[block_id];
    GhostHit hit{nullptr, share_};
    const bool frequent = goes_to_t2(stay, leaf, &hit);
    // evict_one's rule with the block tracked: T1 first while over its share, or alone.
    const double tracked = static_cast<double>(size() + 1);
    if (frequent) {
      if (!t1_.empty() && static_cast<double>(t1_.size()) > hit.share * tracked) return false;
      if (!t2_.before_all(leaf.last_access, block_id)) return false;
    } else {
      const bool t1_over_share = static_cast<double>(t1_.size() + 1) > hit.share * tracked;
      if (!(t1_over_share || t2_.empty())) return false;
      if (!t1_.before_all(leaf.last_access, block_id)) return false;
    }
    take_ghost(hit, leaf.block_hash);
    stay = Stay{false, frequent, leaf.block_hash, leaf.num_accesses};
    remember(frequent ? b2_ : b1_, leaf.block_hash);
    return true;
  }

  void discard(int32_t block_id) override { list_of(block_id).remove(block_id); }

  void touch(int32_t block_id, int64_t now) override {
    list_of(block_id).remove(block_id);
    stays_[block_id].frequent = true;
    t2_.insert(block_id, now);
  }

  int32_t evict_one() override {
    const size_t tracked = size();
    if (tracked == 0) return kNoBlock;
    const bool t1_over_share =
        static_cast<double>(t1_.size()) > share_ * static_cast<double>(tracked);
    const bool from_t1 = !t1_.empty() && (t1_over_share || t2_.empty());
    const int32_t block_id = (from_t1 ? t1_ : t2_).pop();
    Stay& stay = stays_[block_id];
    stay.live = false;
    remember(from_t1 ? b1_ : b2_, stay.block_hash);
    return block_id;
  }

  void clear() override {
    t1_.clear();
    t2_.clear();
    std::fill(stays_.begin(), stays_.end(), Stay{});
    b1_.clear();
    b2_.clear();
    share_ = initial_share_;
  }

  size_t size() const noexcept override { return t1_.size() + t2_.size(); }
  bool contains(int32_t block_id) const noexcept override {
    return t1_.contains(block_id) || t2_.contains(block_id);
  }
  size_t memory_bytes() const noexcept override {
    return t1_.memory_bytes() + t2_.memory_bytes() + stays_.capacity() * sizeof(Stay) +
           b1_.memory_bytes() + b2_.memory_bytes();
  }

 private:
  KeyedHeap<int64_t>& list_of(int32_t block_id) noexcept {
    return t2_.contains(block_id) ? t2_ : t1_;
  }

  // A ghost list holding a hash (none: nullptr) and p after the hit.
  struct GhostHit {
    LinkedMap<char>* ghosts;
    double share;
  };

  // Which ghost list holds ``block_hash``, and p after its hit; changes nothing.
  GhostHit ghost_share(int64_t block_hash) {
    b1_.prefetch(block_hash);  // both lists' misses at once, not one after the other
    b2_.prefetch(block_hash);
    const double scale = static_cast<double>(std::max<size_t>(size(), 1));
    if (b1_.contains(block_hash)) {
      const double step =
          std::max(1.0, static_cast<double>(b2_.size()) / static_cast<double>(b1_.size()));
      return {&b1_, std::min(1.0, share_ + step / scale)};
    }
    if (b2_.contains(block_hash)) {
      const double step =
          std::max(1.0, static_cast<double>(b1_.size()) / static_cast<double>(b2_.size()));
      return {&b2_, std::max(0.0, share_ - step / scale)};
    }
    return {nullptr, share_};
  }

  // Whether insert(block_id, leaf) puts the leaf on T2: its stay goes on (a hit) and it was
  // frequent or was handed out since, or it was handed out twice, or its hash is a ghost
  // (then *hit names the list and the adapted share, for take_ghost). Changes nothing.
  bool goes_to_t2(const Stay& stay, const LeafInfo& leaf, GhostHit* hit) {
    if (stay.live && stay.block_hash == leaf.block_hash &&
        stay.num_accesses <= leaf.num_accesses) {
      return stay.frequent || leaf.num_accesses > stay.num_accesses;
    }
    if (leaf.num_accesses > 1) return true;
    *hit = ghost_share(leaf.block_hash);
    return hit->ghosts != nullptr;
  }

  // Apply a ghost hit, if there was one: p adapted, the hash off its list.
  void take_ghost(const GhostHit& hit, int64_t block_hash) {
    if (hit.ghosts == nullptr) return;
    share_ = hit.share;
    hit.ghosts->erase(block_hash);
  }

  // An evicted leaf's hash joins ``ghosts`` (one already there keeps its place), the
  // oldest dropped past capacity.
  void remember(LinkedMap<char>& ghosts, int64_t block_hash) {
    if (ghost_capacity_ <= 0) return;
    // Two independent index misses: the pop's, loaded while put() probes.
    if (static_cast<int64_t>(ghosts.size()) >= ghost_capacity_) ghosts.prefetch_oldest();
    ghosts.put(block_hash, 0);
    if (static_cast<int64_t>(ghosts.size()) > ghost_capacity_) ghosts.pop_oldest();
  }

  const int64_t ghost_capacity_;
  const double initial_share_;
  double share_;  // ARC's p, as a share of the tracked leaves
  KeyedHeap<int64_t> t1_, t2_;
  std::vector<Stay> stays_;  // by block ID: tracked, or out for a hit
  LinkedMap<char> b1_, b2_;  // hashes evicted from T1 / T2, oldest first
};

}  // namespace

std::unique_ptr<Policy> make_arc_policy(int32_t num_blocks, const PolicyOptions& options) {
  const int64_t ghost_capacity = options.get_int("ghost_capacity", 50'000, 0);
  const double share = options.get("initial_recency_share", 0.5);
  if (!(share >= 0 && share <= 1)) {
    throw std::invalid_argument("initial_recency_share must lie in [0, 1], got " +
                                std::to_string(share));
  }
  return std::make_unique<ArcPolicy>(num_blocks, ghost_capacity, share);
}

}  // namespace prefixcache
