// EngineCheckpoint and PolicyTransaction (see engine_checkpoint.h).

#include "engine_checkpoint.h"

namespace prefixcache {

template <class To, class From>
void EngineCheckpoint::copy_state(To& to, const From& from) {
  to.stack_ = from.stack_;
  to.num_free_ = from.num_free_;
  to.lowest_ = from.lowest_;
  to.active_ = from.active_;
  to.paused_ = from.paused_;
  to.pending_ = from.pending_;
  to.pending_blocks_ = from.pending_blocks_;
  to.group_depth_ = from.group_depth_;
  to.index_ = from.index_;
  to.hash_of_ = from.hash_of_;
  to.parent_ = from.parent_;
  to.first_child_ = from.first_child_;
  to.next_sibling_ = from.next_sibling_;
  to.prev_sibling_ = from.prev_sibling_;
  to.num_children_ = from.num_children_;
  to.depth_ = from.depth_;
  to.registration_ = from.registration_;
  to.num_registrations_ = from.num_registrations_;
  to.last_access_ = from.last_access_;
  to.num_accesses_ = from.num_accesses_;
  to.pins_ = from.pins_;
  to.pin_stamp_ = from.pin_stamp_;
  to.pin_pending_ = from.pin_pending_;
  to.pin_bound_ = from.pin_bound_;
  to.pinned_list_ = from.pinned_list_;
  to.pinned_at_ = from.pinned_at_;
  to.num_active_ = from.num_active_;
  to.num_paused_ = from.num_paused_;
  to.num_cached_ = from.num_cached_;
  to.num_holding_paused_ = from.num_holding_paused_;
  to.counters_ = from.counters_;
  to.changed_free_ = from.changed_free_;
  to.removed_hashes_ = from.removed_hashes_;
}

void EngineCheckpoint::save(const Engine& engine) { copy_state(*this, engine); }

void EngineCheckpoint::restore(Engine& engine) const { copy_state(engine, *this); }

PolicyTransaction::PolicyTransaction(Engine* engine, EngineCheckpoint* checkpoint)
    : engine_(engine), checkpoint_(checkpoint) {
  if (!checkpoint_) return;
  checkpoint_->save(*engine_);
  engine_->policy()->begin();
}

void PolicyTransaction::commit() {
  if (!checkpoint_) return;
  engine_->policy()->commit();
  checkpoint_ = nullptr;
}

PolicyTransaction::~PolicyTransaction() {
  if (!checkpoint_) return;
  checkpoint_->restore(*engine_);
  engine_->policy()->abort();
}

}  // namespace prefixcache
