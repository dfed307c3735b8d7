// Engine: references (acquire, hits) and partitions and time (pause/resume, touches), see
// engine.h. Split from engine.cpp (allocation, release, eviction); registration, the fused
// request path, reset and the invariant check are in engine_registry.cpp.

#include <algorithm>
#include <cstdint>
#include <string>

#include "engine.h"

namespace prefixcache {

namespace {

[[noreturn]] void fail(ErrorKind kind, std::string message) {
  throw EngineError{kind, std::move(message)};
}

}  // namespace

// ------------------------------------------------------------------ references

void Engine::acquire(const int32_t* ids, size_t count) {
  if (count == 0 || acquire_distinct(ids, count)) return;
  count_occurrences(ids, count);
  for (const int32_t block_id : unique_) {
    if (!is_registered(block_id) && is_unreferenced(block_id)) {
      fail(ErrorKind::kBlockState, "block " + std::to_string(block_id) +
                                       " is free; only cached or referenced blocks can be "
                                       "acquired (allocate fresh blocks instead)");
    }
  }
  check_headroom(active_, "active");
  take_references();
}

bool Engine::acquire_distinct(const int32_t* ids, size_t count) {
  // acquire's checks (not free, headroom for one more) and the repeat test, in one pass
  // without branches. Raw pointers: nothing below resizes the arrays (a policy cannot).
  uint32_t* const stamp = stamp_.data();
  int32_t* const active = active_.data();
  const int32_t* const paused = paused_.data();
  const int64_t* const hash_of = hash_of_.data();
  const uint32_t generation = next_generation();
  bool fine = true;
  for (size_t i = 0; i < count; ++i) {
    const int32_t block_id = ids[i];
    const int32_t held = active[block_id];
    fine &= (stamp[block_id] != generation) & (held != INT32_MAX) &
            ((hash_of[block_id] != 0) | (held != 0) | (paused[block_id] != 0));
    stamp[block_id] = generation;
  }
  if (!fine) return false;
  // take_references with one reference each, last_access_ written in the same pass (the
  // policy never reads it; the clock moves after the pass, as there).
  const int32_t* const num_children = num_children_.data();
  int64_t* const num_accesses = num_accesses_.data();
  int64_t* const last_access = last_access_.data();
  Policy* const policy = policy_.get();
  int64_t activated = 0, from_paused = 0, cached = 0;
  const int64_t now = counters_.clock + 1;
  for (size_t i = 0; i < count; ++i) {
    const int32_t block_id = ids[i];
    if (active[block_id] == 0) {
      ++activated;
      if (paused[block_id]) {
        ++from_paused;
      } else {
        ++cached;
        if (policy && num_children[block_id] == 0) policy->discard(block_id);
      }
    }
    ++active[block_id];
    ++num_accesses[block_id];
    last_access[block_id] = now;
  }
  num_active_ += activated;
  num_paused_ -= from_paused;
  num_cached_ -= cached;
  counters_.clock = now;
  return true;
}

void Engine::check_headroom(const std::vector<int32_t>& refs, const char* partition) const {
  // Counts are int32 in both engines: refuse a reference past 2**31 - 1, never wrap.
  for (size_t j = 0; j < unique_.size(); ++j) {
    const int64_t asked = counts_.empty() ? 1 : counts_[j];
    const int32_t block_id = unique_[j];
    if (refs[block_id] + asked > INT32_MAX) {
      fail(ErrorKind::kReferenceCount,
           "block " + std::to_string(block_id) + " holds " + std::to_string(refs[block_id]) +
               " " + partition + " reference(s); " + std::to_string(asked) +
               " more would pass the limit of 2**31 - 1");
    }
  }
}

void Engine::take_hit(const int32_t* ids, size_t count, int64_t num_queried, bool acquire_hits) {
  if (acquire_hits && count) acquire(ids, count);
  if (acquire_hits && count && policy_ && policy_->uses_on_hit()) report_hit(ids, count);
  counters_.num_queried += num_queried;
  counters_.num_hits += static_cast<int64_t>(count);
}

void Engine::take_references() {
  int64_t activated = 0, from_paused = 0, cached = 0;
  for (size_t j = 0; j < unique_.size(); ++j) {
    const int32_t block_id = unique_[j];
    const int32_t delta = counts_.empty() ? 1 : counts_[j];
    if (active_[block_id] == 0) {
      ++activated;
      if (paused_[block_id]) {
        ++from_paused;
      } else {
        ++cached;
        // A cached leaf stops being evictable (the Python engine's _discard_leaves).
        if (policy_ && num_children_[block_id] == 0) policy_->discard(block_id);
      }
    }
    active_[block_id] += delta;
    num_accesses_[block_id] += delta;
  }
  num_active_ += activated;
  num_paused_ -= from_paused;
  num_cached_ -= cached;
  const int64_t now = ++counters_.clock;
  for (const int32_t block_id : unique_) last_access_[block_id] = now;
}

// ------------------------------------------------------------------ partitions and time

void Engine::move(const int32_t* ids, size_t count, bool to_paused) {
  if (count == 0) return;
  count_occurrences(ids, count);
  int64_t was_active = 0, was_paused = 0, now_active = 0, now_paused = 0;
  int64_t was_holding = 0, now_holding = 0;
  for (size_t j = 0; j < unique_.size(); ++j) {
    const int32_t block_id = unique_[j];
    const int32_t delta = counts_.empty() ? 1 : counts_[j];
    const int32_t active = active_[block_id], paused = paused_[block_id];
    // Inside a free group, queued releases are no longer the caller's to pause.
    const int32_t held = to_paused ? active - pending_[block_id] : paused;
    if (held < delta) {
      fail(ErrorKind::kReferenceCount,
           "block " + std::to_string(block_id) + " (" + describe_state(block_id) + ") holds " +
               std::to_string(held) + (to_paused ? " active" : " paused") +
               " reference(s); asked to move " + std::to_string(delta));
    }
    if ((to_paused ? paused : active) + static_cast<int64_t>(delta) > INT32_MAX) {
      fail(ErrorKind::kReferenceCount,
           "block " + std::to_string(block_id) + " holds " +
               std::to_string(to_paused ? paused : active) +
               (to_paused ? " paused" : " active") + " reference(s); " + std::to_string(delta) +
               " more would pass the limit of 2**31 - 1");
    }
    const int32_t after_active = to_paused ? active - delta : active + delta;
    const int32_t after_paused = to_paused ? paused + delta : paused - delta;
    was_active += active != 0;
    was_paused += active == 0 && paused > 0;
    now_active += after_active != 0;
    now_paused += after_active == 0 && after_paused > 0;
    was_holding += paused > 0;
    now_holding += after_paused > 0;
  }
  const int64_t total_active = num_active_ + now_active - was_active;
  const int64_t total_paused = num_paused_ + now_paused - was_paused;
  const int64_t total_holding = num_holding_paused_ + now_holding - was_holding;
  // The paused budget bounds the blocks holding any paused reference (so releasing their
  // running holders later cannot overflow it); a pause that gives no block its first paused
  // reference always passes. A resume that activates no block never overflows the active one.
  if (to_paused && now_holding - was_holding > paused_count_ - num_holding_paused_) {
    fail(ErrorKind::kBudgetExceeded,
         "pausing would give " + std::to_string(now_holding - was_holding) +
             " more block(s) paused references (" + std::to_string(total_holding) +
             " in all); the paused budget is " + std::to_string(paused_count_));
  }
  if (!to_paused && now_active > was_active && total_active > active_count()) {
    fail(ErrorKind::kBudgetExceeded, "resuming would hold " + std::to_string(total_active) +
                                         " active blocks; budget is " +
                                         std::to_string(active_count()));
  }
  for (size_t j = 0; j < unique_.size(); ++j) {
    const int32_t block_id = unique_[j];
    const int32_t delta = counts_.empty() ? 1 : counts_[j];
    active_[block_id] += to_paused ? -delta : delta;
    paused_[block_id] += to_paused ? delta : -delta;
  }
  num_active_ = total_active;
  num_paused_ = total_paused;
  num_holding_paused_ = total_holding;
}

void Engine::touch(const int32_t* ids, size_t count) {
  if (count == 0) return;
  for (size_t i = 0; i < count; ++i) {
    const int32_t block_id = ids[i];
    if (is_unreferenced(block_id) && !is_registered(block_id)) {
      fail(ErrorKind::kBlockState,
           "block " + std::to_string(block_id) + " is free; it has no timestamp to update");
    }
  }
  const int64_t now = counters_.clock + 1;
  if (policy_ && policy_->uses_touch()) {  // the tracked leaves, ascending and once each
    leaves_.clear();
    for (size_t i = 0; i < count; ++i) {
      const int32_t block_id = ids[i];
      if (is_unreferenced(block_id) && num_children_[block_id] == 0) leaves_.push_back(block_id);
    }
    if (leaves_.size() > 1) {
      std::sort(leaves_.begin(), leaves_.end());
      leaves_.erase(std::unique(leaves_.begin(), leaves_.end()), leaves_.end());
    }
    for (const int32_t block_id : leaves_) policy_->touch(block_id, now);
  }
  counters_.clock = now;
  for (size_t i = 0; i < count; ++i) last_access_[ids[i]] = now;
}

}  // namespace prefixcache
