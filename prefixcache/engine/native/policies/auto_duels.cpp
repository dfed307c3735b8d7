// auto's choice of expert (policies/auto_duels.py): counterfactual duels, decayed charges,
// a sequential test. Where the experts' candidates differ at an eviction, a duel watches
// the victim's and the kept block's hashes; the first used again charges the expert that
// named it one miss. Open duels are slots linked in ID order (the oldest is dropped past
// max_duels_) and, per side, among the duels of that side's hash (by_hash_ holds the most
// recent side of each hash). Charges decay lazily: a miss charged now weighs weight_, which
// grows by growth_ per registered block; all are rescaled past 1e100.
#include <cmath>

#include "auto.h"

namespace prefixcache {

void AutoPolicy::age(int64_t num_registered) {
  weight_ = weight_ * std::pow(growth_, static_cast<double>(num_registered));
  if (weight_ > 1e100) {
    const double scale = weight_;
    charges_[0] = charges_[0] / scale;
    charges_[1] = charges_[1] / scale;
    gap_ = gap_ / scale;
    volume_ = volume_ / scale;
    weight_ = 1.0;
  }
}

int AutoPolicy::next_leader() const {
  // The leader once a challenger ahead by the margin has taken over.
  const double lead = charges_[leader_], challenger = charges_[1 - leader_];
  if (challenger < options_.keep * lead - weight_ &&
      lead - challenger > options_.switch_z * std::sqrt((lead + challenger) * weight_)) {
    return 1 - leader_;
  }
  return leader_;
}

void AutoPolicy::reused(int64_t block_hash) {
  // ``block_hash`` is used again: it wins every open duel it is in, and the expert that
  // named its side for eviction is charged one miss in each.
  const int32_t* head = by_hash_.get(block_hash);
  if (head == nullptr) return;
  int64_t misses[2] = {0, 0};
  for (int32_t side_ref = *head; side_ref >= 0;) {
    const int32_t slot = side_ref >> 1;
    const int side = side_ref & 1;
    const int named = duels_[static_cast<size_t>(slot)].namers[side];
    misses[0] += named & 1;
    misses[1] += (named >> 1) & 1;
    side_ref = duels_[static_cast<size_t>(slot)].next[side];
    close(slot);
  }
  charges_[0] = charges_[0] + static_cast<double>(misses[0]) * weight_;
  charges_[1] = charges_[1] + static_cast<double>(misses[1]) * weight_;
}

void AutoPolicy::link_side(int32_t slot, int side) {
  Duel& duel = duels_[static_cast<size_t>(slot)];
  const int32_t ref = slot * 2 + side;
  bool added = false;
  int32_t& head = by_hash_.get_or_put(duel.block_hash[side], ref, added);
  duel.prev[side] = -1;
  if (added) {
    duel.next[side] = -1;
    return;
  }
  duel.next[side] = head;
  Duel& after = duels_[static_cast<size_t>(head >> 1)];
  after.prev[head & 1] = ref;
  head = ref;
}

void AutoPolicy::unlink_side(int32_t slot, int side) {
  Duel& duel = duels_[static_cast<size_t>(slot)];
  const int32_t before = duel.prev[side], after = duel.next[side];
  if (after >= 0) duels_[static_cast<size_t>(after >> 1)].prev[after & 1] = before;
  if (before >= 0) {
    duels_[static_cast<size_t>(before >> 1)].next[before & 1] = after;
  } else if (after >= 0) {
    *by_hash_.get(duel.block_hash[side]) = after;
  } else {
    by_hash_.erase(duel.block_hash[side]);
  }
}

void AutoPolicy::open(int64_t victim_hash, int victim_namers, int64_t kept_hash,
                      int kept_namers) {
  // The two hashes differ (the callers check: two blocks under one hash are one prefix).
  int32_t slot;
  if (free_duels_.empty()) {
    slot = static_cast<int32_t>(duels_.size());
    duels_.emplace_back();
  } else {
    slot = free_duels_.back();
    free_duels_.pop_back();
  }
  Duel& duel = duels_[static_cast<size_t>(slot)];
  duel.block_hash[0] = victim_hash;
  duel.namers[0] = victim_namers;
  duel.block_hash[1] = kept_hash;
  duel.namers[1] = kept_namers;
  duel.older = newest_;
  duel.newer = -1;
  (newest_ >= 0 ? duels_[static_cast<size_t>(newest_)].newer : oldest_) = slot;
  newest_ = slot;
  link_side(slot, 0);
  link_side(slot, 1);
  ++num_duels_;
  if (num_duels_ > max_duels_) close(oldest_);
}

void AutoPolicy::close(int32_t slot) {
  Duel& duel = duels_[static_cast<size_t>(slot)];
  unlink_side(slot, 0);
  unlink_side(slot, 1);
  (duel.older >= 0 ? duels_[static_cast<size_t>(duel.older)].newer : oldest_) = duel.newer;
  (duel.newer >= 0 ? duels_[static_cast<size_t>(duel.newer)].older : newest_) = duel.older;
  free_duels_.push_back(slot);
  --num_duels_;
}

}  // namespace prefixcache
