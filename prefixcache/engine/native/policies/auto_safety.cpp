// auto's safety net (policies/auto_safety.py): plain LRU simulated over the same uses in a
// shadow of hashes as large as the real cache, and LRU's decayed lead over the real hits.
// A registration (a real miss) of a hash the shadow holds is +1 for LRU, a hit (on_hit) on
// a hash it lacks -1; when the lead passes safety_z standard deviations the lru expert
// evicts for 1 x pool registrations. The Python class orders its shadow by stamps that only
// grow; here a RecencySet keeps the same order (a use moves the hash to the newest end).
#include <algorithm>
#include <cmath>

#include "auto.h"

namespace prefixcache {

void AutoPolicy::clear_shadow() {
  shadow_.clear();
  shadow_size_ = 1;
  sees_hits_ = false;
  gap_ = volume_ = 0.0;
  fallback_ = false;
  registered_ = 0;
  hold_until_ = 0;
}

void AutoPolicy::resize_shadow(int64_t change) {
  // The real cache gained (registrations) or lost (evictions) ``change`` blocks.
  shadow_size_ = std::max<int64_t>(1, shadow_size_ + change);
  while (static_cast<int64_t>(shadow_.size()) > shadow_size_) shadow_.pop_oldest();
}

void AutoPolicy::score(int64_t lru_lead, int64_t counted) {
  if (counted == 0) return;
  gap_ = gap_ + static_cast<double>(lru_lead) * weight_;
  volume_ = volume_ + static_cast<double>(counted) * weight_;
}

void AutoPolicy::shadow_misses(const int64_t* hashes, size_t count) {
  // A run of registrations (real misses): +1 for LRU per hash the shadow holds. Deepest
  // first, so that the run's head ends most recent.
  // Each hash the shadow lacks joins it, and its oldest leaves when it outgrows the cache.
  registered_ += static_cast<int64_t>(count);
  const auto held = static_cast<int64_t>(shadow_.use_run(hashes, count, shadow_limit()));
  score(held, held);
}

void AutoPolicy::on_hit(const int64_t* hashes, size_t count) {
  // A request took the cached prefix: -1 for LRU per hash the shadow lacks (leaf first).
  sees_hits_ = true;
  const auto missed =
      static_cast<int64_t>(count - shadow_.use_run(hashes, count, shadow_limit()));
  score(-missed, missed);
}

void AutoPolicy::on_end(const int64_t* hashes, size_t count) {
  // A conversation's end freed these blocks: LRU, told the same, frees them too (the
  // shadow drops the hashes and the real cache's lost room).
  for (size_t i = 0; i < count; ++i) shadow_.erase(hashes[i]);
  resize_shadow(-static_cast<int64_t>(count));
}

bool AutoPolicy::next_fallback() const {
  // Whether the net holds eviction after this step. No change.
  if (!(options_.safety_on && sees_hits_)) return false;
  if (fallback_) return registered_ < hold_until_;
  return gap_ >= weight_ && gap_ > options_.safety_z * std::sqrt(volume_ * weight_);
}

void AutoPolicy::set_fallback(bool fallback) {
  // Trip (a fresh test: gap and volume to 0, eviction held 1 x pool registrations) or release.
  if (fallback == fallback_) return;
  fallback_ = fallback;
  if (fallback) {
    gap_ = volume_ = 0.0;
    const double hold = hold_ratio_ * static_cast<double>(pool_);
    hold_until_ = registered_ + std::max<int64_t>(1, static_cast<int64_t>(hold));
  }
}

}  // namespace prefixcache
