// auto's chain shortcut (policies/auto_shortcut.py): evicts_first answers whether the
// acting expert would evict an exposed parent next and, if so, books that eviction (new
// uses, stay, duel, leader, the net's state, shadow size) as insert-then-evict_one would,
// so the engine evicts the block without the round trip and the policy learns the same.
#include <algorithm>

#include "auto.h"

namespace prefixcache {

bool AutoPolicy::evicts_first(int32_t block_id, const LeafInfo& leaf) {
  if (block_id >= pool_) return false;  // the pool estimate would grow
  Stay& stay = stays_[block_id];
  const bool back = stay.live && stay.block_hash == leaf.block_hash &&
                    stay.num_accesses <= leaf.num_accesses;
  const int64_t new_uses = leaf.num_accesses - (back ? stay.num_accesses : 1);
  if (lru_.empty()) {
    if (new_uses > 0) count(leaf.block_hash, new_uses);
    resize_shadow(-1);
    return true;
  }
  const int lead = next_leader();
  const bool fallback = next_fallback();
  const int acting = fallback ? 0 : lead;  // the expert that evicts (see evict_one)
  const bool lru_first = lru_.before_all(leaf.last_access, block_id);
  if (!lru_first && acting == 0) return false;
  size_t at[kAutoRows];  // the hash's counters: read here, counted below if it evicts
  const int64_t least = locate(leaf.block_hash, at);
  const int64_t uses = std::min(uses_after(least, new_uses), kAutoFrequencyCap);
  const bool frequent_first = frequent_.before_all(FrequentKey{uses, leaf.last_access}, block_id);
  if (!frequent_first && acting == 1) return false;
  // Booked as evict_one would: the leader, the new uses, the stay, the duel.
  leader_ = lead;
  set_fallback(fallback);
  if (new_uses > 0) count_at(at, least, new_uses);
  stay.live = false;
  if (!(lru_first && frequent_first)) {
    const int32_t kept = acting == 0 ? frequent_.top() : lru_.top();
    const int64_t kept_hash = stays_[kept].block_hash;
    if (kept_hash != leaf.block_hash) open(leaf.block_hash, 1 << acting, kept_hash, 2 >> acting);
  }
  resize_shadow(-1);
  return true;
}

}  // namespace prefixcache
