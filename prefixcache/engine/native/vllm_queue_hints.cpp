// VllmQueueCore::set_hinted: the scheduler's queue hints in the vLLM plugin's native queue.
//
// PolicyFreeBlockQueue.set_hinted in integrations/vllm_queue.py, step for step (keep the two
// in step: tests/integrations/test_vllm_native_queue.py runs both on the same programs).
// The hinted section holds free cached blocks on the cached prefixes of queued requests
// (DESIGN.md, "vLLM integration"): out of the policy's leaves and the inner blocks, handed
// out only when no other free block is left, the newest hint's deepest block first
// (take_victim in vllm_queue.cpp). They stay free, so vLLM's accounting does not change.
#include <string>
#include <vector>

#include "binding.h"
#include "vllm_queue.h"

namespace prefixcache {

bool VllmQueueCore::set_hinted(PyObject* blocks, int64_t limit, int64_t* out) {
  if (limit < 0) {
    native_raise(ErrorKind::kInvalidArgument,
                 "the hint limit must be >= 0, got " + std::to_string(limit));
    return false;
  }
  // The blocks to hint, in order: free (not hash-less), cached, each once, at most limit.
  // Every ID is read before any change; an ID outside the pool is not free: skipped.
  std::vector<int32_t> picked;
  const Py_ssize_t size = PySequence_Fast_GET_SIZE(blocks);
  PyObject** items = PySequence_Fast_ITEMS(blocks);
  bool ok = true;
  for (Py_ssize_t i = 0; i < size && static_cast<int64_t>(picked.size()) < limit; ++i) {
    long long raw;
    if (!vllm_block::raw_id(items[i], &raw)) {
      ok = false;
      break;
    }
    if (raw < 0 || raw >= num_blocks_) continue;
    const auto id = static_cast<int32_t>(raw);
    const Section section = where_[id];
    if (section == Section::kNone || section == Section::kFirst || depth_[id] < 0) continue;
    if (picked_[id]) continue;
    picked_[id] = 1;
    picked.push_back(id);
  }
  if (!ok) {
    for (const int32_t id : picked) picked_[id] = 0;
    return false;
  }
  // Dropped hints go back to their section, the last hinted first (an inner block's place
  // is by free order, and vLLM frees a request's blocks from its last one).
  std::vector<int32_t> old;
  for (int32_t id = hinted_.front(); id != kNoBlock; id = hinted_.next(id)) old.push_back(id);
  for (auto it = old.rbegin(); it != old.rend(); ++it) {
    const int32_t id = *it;
    if (picked_[id]) continue;
    hinted_.erase(id);
    if (num_children_[id] > 0) {
      inner_.push_back(id);
      where_[id] = Section::kInner;
    } else if (!insert_leaf(id)) {  // its hash could not be read: it stays hinted
      hinted_.push_back(id);
      for (const int32_t mark : picked) picked_[mark] = 0;
      return false;
    }
  }
  for (const int32_t id : picked) {
    picked_[id] = 0;
    const Section section = where_[id];
    if (section == Section::kLeaf) {
      policy_->discard(id);
    } else if (section == Section::kInner) {
      inner_.erase(id);
    } else {
      hinted_.erase(id);  // hinted before: its place is its new one
    }
    where_[id] = Section::kHinted;
    hinted_.push_back(id);
  }
  *out = static_cast<int64_t>(picked.size());
  return true;
}

}  // namespace prefixcache
