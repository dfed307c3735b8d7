// auto (policies/auto.py and its mixins): two experts order the leaves; the one whose
// choices lost fewest hits lately evicts, and a safety net hands eviction to LRU when plain
// LRU, simulated beside it, leads by a significant margin.
//
// One class over one state, split in files as the Python mixins are: auto.cpp (leaves,
// heaps, stays, eviction, the pool estimate, the factory), auto_sketch.cpp (the count-min
// sketch of uses), auto_duels.cpp (counterfactual duels, decayed charges, the leader),
// auto_safety.cpp (the LRU shadow, on_hit, the net), auto_shortcut.cpp (evicts_first);
// auto_heads.h maps a hash to its most recent duel side.
// Step for step the Python class's decisions: the same double arithmetic in the same order
// (std::pow for Python's float ** int, std::sqrt), the same ties (lower block ID). Where the
// Python class keeps lazy heaps of versioned keys, this keeps indexed heaps (keyed_heap.h):
// the live minimum by (key, block ID) is the same entry. Duels live in slots linked in ID
// order (the oldest first) and per hash; the LRU shadow is a RecencySet (recency_set.h:
// the Python class's stamps only ever order it). No undo log: a native policy is never
// rolled back (the engine checks before it writes), and the Python class's never-reused
// counters (versions, duel IDs, stamps) only ever order or identify, so skipping them
// changes nothing. The sketch's multipliers come from Python's random.Random(seed), computed
// in Python (auto_native_options) and passed as options; seed 0's are built in.
// Hashes are never 0 (HashIndex's empty key), as in the engine. Not thread-safe.
#ifndef PREFIXCACHE_ENGINE_NATIVE_POLICIES_AUTO_H_
#define PREFIXCACHE_ENGINE_NATIVE_POLICIES_AUTO_H_

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "../policy.h"
#include "auto_heads.h"
#include "keyed_heap.h"
#include "recency_set.h"

namespace prefixcache {

constexpr int kAutoRows = 4;               // count-min sketch rows (auto_sketch.ROWS)
constexpr int64_t kAutoFrequencyCap = 3;   // auto_shortcut.FREQUENCY_CAP
constexpr uint8_t kAutoMaxCount = 15;      // auto_sketch.MAX_COUNT
constexpr int64_t kAutoMinPool = 64;       // auto._MIN_POOL

/// The Python class's keyword arguments, checked (make_auto_policy).
struct AutoOptions {
  double duel_ratio = 1.0;
  double sketch_ratio = 8.0;
  double sample_ratio = 16.0;
  double half_life_ratio = 4.0;
  double keep = 1.0;  // 1 - switch_margin
  double switch_z = 1.5;
  bool safety_on = true;
  double safety_z = 2.0;
  uint64_t multipliers[kAutoRows] = {0, 0, 0, 0};
};

class AutoPolicy final : public CopyablePolicy<AutoPolicy> {
 public:
  AutoPolicy(int32_t num_blocks, const AutoOptions& options);

  void insert(int32_t block_id, const LeafInfo& leaf) override;
  void discard(int32_t block_id) override { untrack_use(block_id); }
  void touch(int32_t block_id, int64_t now) override;
  int32_t evict_one() override;
  void clear() override;
  size_t size() const noexcept override { return lru_.size(); }
  bool contains(int32_t block_id) const noexcept override { return lru_.contains(block_id); }
  size_t memory_bytes() const noexcept override;
  void on_register(const int64_t* hashes, size_t count, int64_t first_depth) override;
  void on_hit(const int64_t* hashes, size_t count) override;
  bool uses_on_hit() const noexcept override { return true; }
  void on_end(const int64_t* hashes, size_t count) override;
  bool evicts_first(int32_t block_id, const LeafInfo& leaf) override;

 private:
  using FrequentKey = std::pair<int64_t, int64_t>;  // (uses class, last access)

  struct Stay {  // a block's (hash, hand-outs seen), kept while tracked or out for a hit
    bool live = false;
    int64_t block_hash = 0;
    int64_t num_accesses = 0;
  };

  struct Duel {  // sides 0 (victim) and 1 (kept): hash and the experts that named it
    int64_t block_hash[2] = {0, 0};
    int namers[2] = {0, 0};
    int32_t older = -1, newer = -1;              // open duels in ID order
    int32_t prev[2] = {-1, -1}, next[2] = {-1, -1};  // each side among its hash's duels
  };

  // auto.cpp: tracking
  void push(int32_t block_id, int64_t last_access, int64_t uses);
  int64_t untrack_use(int32_t block_id);  // the hash; its open duels are settled
  void grow_pool(int32_t block_id);
  void resize(int64_t pool);

  // auto_sketch.cpp
  void resize_sketch(int64_t pool);
  uint8_t locate(int64_t block_hash, size_t* at) const noexcept;
  int64_t uses(int64_t block_hash) const noexcept;
  int64_t count(int64_t block_hash, int64_t num_uses);
  int64_t count_at(const size_t* at, int64_t least, int64_t num_uses);
  void count_run(const int64_t* hashes, size_t count);
  int64_t uses_after(int64_t least, int64_t new_uses) const noexcept;
  void halve() noexcept;

  // auto_duels.cpp
  void age(int64_t num_registered);
  int next_leader() const;
  void reused(int64_t block_hash);
  void open(int64_t victim_hash, int victim_namers, int64_t kept_hash, int kept_namers);
  void close(int32_t slot);
  void link_side(int32_t slot, int side);
  void unlink_side(int32_t slot, int side);

  // auto_safety.cpp
  void clear_shadow();
  size_t shadow_limit() const noexcept { return static_cast<size_t>(shadow_size_); }
  void resize_shadow(int64_t change);
  void score(int64_t lru_lead, int64_t counted);
  void shadow_misses(const int64_t* hashes, size_t count);
  bool next_fallback() const;
  void set_fallback(bool fallback);

  // Options.
  AutoOptions options_;
  double hold_ratio_ = 1.0;  // registrations per pool block one trip holds eviction

  // Leaves and stays (auto.cpp).
  KeyedHeap<int64_t> lru_;           // by last access
  KeyedHeap<FrequentKey> frequent_;  // by (min(uses, 3), last access)
  std::vector<Stay> stays_;          // by block ID
  int64_t pool_ = kAutoMinPool;      // highest block ID seen + 1, at least kAutoMinPool

  // Sketch (auto_sketch.cpp).
  std::vector<uint8_t> sketch_;  // kAutoRows rows of width_ counters
  int64_t width_ = 1;
  int shift_ = 64;
  int64_t added_ = 0;   // uses counted since the last halving
  int64_t sample_ = 1;  // uses between two halvings

  // Duels and charges (auto_duels.cpp).
  std::vector<Duel> duels_;      // slots; free ones on free_duels_
  std::vector<int32_t> free_duels_;
  AutoHeads by_hash_;            // hash -> its most recent duel side (slot * 2 + side)
  int32_t oldest_ = -1, newest_ = -1;
  int64_t num_duels_ = 0;
  int64_t max_duels_ = 1;
  double charges_[2] = {0.0, 0.0};  // in units of weight_
  double weight_ = 1.0;             // what one miss charged now weighs
  double growth_ = 1.0;             // weight_'s growth per registered block
  int leader_ = 1;                  // "frequent" leads at first

  // Safety net (auto_safety.cpp).
  RecencySet shadow_;  // hashes, least recently used first
  int64_t shadow_size_ = 1;
  bool sees_hits_ = false;
  double gap_ = 0.0, volume_ = 0.0;  // the net's decayed (gap, volume), in units of weight_
  bool fallback_ = false;
  int64_t registered_ = 0;
  int64_t hold_until_ = 0;
};

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_POLICIES_AUTO_H_
