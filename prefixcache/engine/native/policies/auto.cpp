// auto (policies/auto.py): the leaves, their heaps and stays, eviction, the pool estimate,
// and the factory. See auto.h for the whole class and how it keeps the Python decisions.
#include "auto.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "factories.h"

namespace prefixcache {

namespace {

// Python's random.Random(0).getrandbits(64) | 1, four times (AutoPolicy(seed=0)).
constexpr uint64_t kSeedZeroMultipliers[kAutoRows] = {
    0x629f6fbed82c07cdULL, 0xe3e70682c2094cadULL, 0x0a5d2f346baa9455ULL, 0xf728b4fa42485e3bULL};

// Python's int(value) of a finite positive double, saturated where int64 would overflow.
int64_t truncate(double value) noexcept {
  return value >= 9.0e18 ? INT64_C(9000000000000000000) : static_cast<int64_t>(value);
}

}  // namespace

AutoPolicy::AutoPolicy(int32_t num_blocks, const AutoOptions& options)
    : options_(options),
      lru_(static_cast<size_t>(num_blocks)),
      frequent_(static_cast<size_t>(num_blocks)),
      stays_(static_cast<size_t>(num_blocks)) {
  clear();
}

void AutoPolicy::resize(int64_t pool) {
  // AutoPolicy._resize: the sketch, the open duels, the decay.
  resize_sketch(pool);
  max_duels_ = std::max<int64_t>(1, truncate(options_.duel_ratio * static_cast<double>(pool)));
  growth_ = std::pow(2.0, 1.0 / (options_.half_life_ratio * static_cast<double>(pool)));
}

void AutoPolicy::grow_pool(int32_t block_id) {
  pool_ = static_cast<int64_t>(block_id) + 1;
  resize(pool_);
}

void AutoPolicy::push(int32_t block_id, int64_t last_access, int64_t uses) {
  lru_.insert(block_id, last_access);
  frequent_.insert(block_id, FrequentKey{std::min(uses, kAutoFrequencyCap), last_access});
}

void AutoPolicy::insert(int32_t block_id, const LeafInfo& leaf) {
  if (block_id >= pool_) grow_pool(block_id);
  Stay& stay = stays_[block_id];
  // _new_uses: back from a hit, the hand-outs since; else the first use was counted at
  // registration.
  const bool back = stay.live && stay.block_hash == leaf.block_hash &&
                    stay.num_accesses <= leaf.num_accesses;
  const int64_t new_uses = leaf.num_accesses - (back ? stay.num_accesses : 1);
  stay = Stay{true, leaf.block_hash, leaf.num_accesses};
  const int64_t uses_now = new_uses > 0 ? count(leaf.block_hash, new_uses) : uses(leaf.block_hash);
  push(block_id, leaf.last_access, uses_now);
}

int64_t AutoPolicy::untrack_use(int32_t block_id) {
  lru_.remove(block_id);
  frequent_.remove(block_id);
  const int64_t block_hash = stays_[block_id].block_hash;
  if (num_duels_ > 0) reused(block_hash);
  return block_hash;
}

void AutoPolicy::touch(int32_t block_id, int64_t now) {
  const int64_t block_hash = untrack_use(block_id);
  push(block_id, now, count(block_hash, 1));
}

void AutoPolicy::on_register(const int64_t* hashes, size_t count, int64_t) {
  // Duels and counts are separate state: settle the duels, then count.
  if (num_duels_ > 0) {
    for (size_t i = 0; i < count; ++i) {
      reused(hashes[i]);  // nothing when the hash is in no duel
    }
  }
  count_run(hashes, count);
  resize_shadow(static_cast<int64_t>(count));
  shadow_misses(hashes, count);
  age(static_cast<int64_t>(count));
}

int32_t AutoPolicy::evict_one() {
  if (lru_.empty()) return kNoBlock;
  const int32_t candidates[2] = {lru_.top(), frequent_.top()};
  leader_ = next_leader();
  const bool fallback = next_fallback();
  set_fallback(fallback);
  const int acting = fallback ? 0 : leader_;  // the safety net hands eviction to lru
  const int32_t victim = candidates[acting];
  lru_.remove(victim);
  frequent_.remove(victim);
  Stay& stay = stays_[victim];
  stay.live = false;
  const int32_t kept = candidates[1 - acting];
  if (kept != victim) {
    const int64_t kept_hash = stays_[kept].block_hash;
    // Two blocks under one hash are one prefix: a duel between them decides nothing.
    if (kept_hash != stay.block_hash) open(stay.block_hash, 1 << acting, kept_hash, 2 >> acting);
  }
  resize_shadow(-1);
  return victim;
}

void AutoPolicy::clear() {
  lru_.clear();
  frequent_.clear();
  std::fill(stays_.begin(), stays_.end(), Stay{});
  duels_.clear();
  free_duels_.clear();
  by_hash_.clear();
  oldest_ = newest_ = -1;
  num_duels_ = 0;
  charges_[0] = charges_[1] = 0.0;
  weight_ = 1.0;
  leader_ = 1;  // "frequent"
  pool_ = kAutoMinPool;
  width_ = 1;
  sketch_.assign(kAutoRows, 0);
  shift_ = 64;
  added_ = 0;
  clear_shadow();
  resize(pool_);
}

size_t AutoPolicy::memory_bytes() const noexcept {
  return lru_.memory_bytes() + frequent_.memory_bytes() + stays_.capacity() * sizeof(Stay) +
         sketch_.capacity() + duels_.capacity() * sizeof(Duel) +
         free_duels_.capacity() * sizeof(int32_t) + by_hash_.memory_bytes() +
         shadow_.memory_bytes();
}

std::unique_ptr<Policy> make_auto_policy(int32_t num_blocks, const PolicyOptions& options) {
  AutoOptions parsed;
  const int64_t seed = options.get_int("seed", 0, 0);
  const char* ratios[] = {"duel_ratio", "sketch_ratio", "sample_ratio", "half_life_ratio"};
  double* targets[] = {&parsed.duel_ratio, &parsed.sketch_ratio, &parsed.sample_ratio,
                       &parsed.half_life_ratio};
  for (int i = 0; i < 4; ++i) {
    const double value = options.get(ratios[i], *targets[i]);
    if (!(value > 0) || !std::isfinite(value)) {
      throw std::invalid_argument(std::string(ratios[i]) + " must be a number > 0, got " +
                                  std::to_string(value));
    }
    *targets[i] = value;
  }
  // The sketch grows to sketch_ratio x the largest pool: refuse what no memory holds (the
  // Python class would fail allocating it).
  if (parsed.sketch_ratio * static_cast<double>(num_blocks) > 1099511627776.0) {
    throw std::invalid_argument("sketch_ratio x num_blocks must be at most 2**40");
  }
  const double margin = options.get("switch_margin", 0.0);
  if (!(margin >= 0 && margin < 1)) {
    throw std::invalid_argument("switch_margin must lie in [0, 1), got " +
                                std::to_string(margin));
  }
  parsed.keep = 1.0 - margin;
  parsed.switch_z = options.get("switch_z", 1.5);
  parsed.safety_z = options.get("safety_z", 2.0);
  for (const double z : {parsed.switch_z, parsed.safety_z}) {
    if (!(z >= 0)) throw std::invalid_argument("switch_z and safety_z must be numbers >= 0");
  }
  // safety_z=None in Python: the net is off (the option safety_net=0 here).
  parsed.safety_on = options.get_int("safety_net", 1, 0) != 0;
  if (!parsed.safety_on) parsed.safety_z = 0.0;
  // The sketch's multipliers, as 32-bit halves (a double holds 53 bits).
  int given = 0;
  for (int row = 0; row < kAutoRows; ++row) {
    const std::string name = "multiplier" + std::to_string(row);
    const int64_t high = options.get_int(name + "_high", -1, -1);
    const int64_t low = options.get_int(name + "_low", -1, -1);
    if (high > 0xFFFFFFFFLL || low > 0xFFFFFFFFLL) {
      throw std::invalid_argument(name + " halves must be 32-bit");
    }
    if (high >= 0 && low >= 0) {
      parsed.multipliers[row] = (static_cast<uint64_t>(high) << 32) | static_cast<uint64_t>(low);
      ++given;
    } else if (high >= 0 || low >= 0) {
      throw std::invalid_argument(name + " needs both halves");
    }
  }
  if (given == 0 && seed == 0) {
    std::copy(kSeedZeroMultipliers, kSeedZeroMultipliers + kAutoRows, parsed.multipliers);
  } else if (given != kAutoRows) {
    throw std::invalid_argument(
        "auto with seed " + std::to_string(seed) +
        " needs its sketch multipliers (multiplier0_high ... multiplier3_low), computed in "
        "Python by prefixcache.engine.selection.native_policy_spec");
  }
  return std::make_unique<AutoPolicy>(num_blocks, parsed);
}

}  // namespace prefixcache
