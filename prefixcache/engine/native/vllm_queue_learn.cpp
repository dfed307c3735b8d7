// VllmQueueCore's learning calls (what the wrapped BlockPool methods tell the queue), the
// hand-out order replayed on a copy (the views vLLM's tests read) and the invariant check:
// PolicyFreeBlockQueue's methods of the same names in integrations/vllm_queue.py.
#include <string>
#include <vector>

#include "binding.h"
#include "vllm_queue.h"

namespace prefixcache {
namespace {

/// An owned reference, released at scope exit.
struct Ref {
  PyObject* object = nullptr;
  ~Ref() { Py_XDECREF(object); }
};

}  // namespace

// note_registered: blocks[start:stop] of one table were cached; learn depths and parents
// (blocks[i - 1]) and report each run of newly cached blocks to on_register.
bool VllmQueueCore::note_registered(PyObject* blocks, Py_ssize_t start, Py_ssize_t stop) {
  const Py_ssize_t size = PySequence_Fast_GET_SIZE(blocks);
  PyObject** items = PySequence_Fast_ITEMS(blocks);
  if (start < 0 || stop > size) {
    PyErr_SetString(PyExc_IndexError, "note_registered: block range out of the table");
    return false;
  }
  std::vector<int64_t> run;
  auto report = [&](Py_ssize_t end) {
    if (!run.empty()) {
      policy_->on_register(run.data(), run.size(), end - static_cast<Py_ssize_t>(run.size()));
      run.clear();
    }
  };
  PyObject* parent = nullptr;  // borrowed
  if (start > 0) {
    bool ok;
    Ref key;
    if (!vllm_block::cacheable(items[start - 1], &ok, &key.object)) return false;
    parent = ok ? items[start - 1] : nullptr;
  }
  for (Py_ssize_t index = start; index < stop; ++index) {
    PyObject* block = items[index];
    int32_t id;
    bool ok;
    Ref key;
    if (!block_id(block, &id) || !vllm_block::cacheable(block, &ok, &key.object)) return false;
    if (!ok || depth_[id] >= 0) {
      report(index);
      parent = ok ? block : nullptr;
      continue;
    }
    if (on_register_) {
      int64_t hash;
      if (!vllm_block::policy_hash(key.object, &hash)) return false;
      run.push_back(hash);
    }
    depth_[id] = index;
    if (accesses_[id] == 0) accesses_[id] = 1;
    if (parent != nullptr) {
      int32_t parent_id;
      if (!block_id(parent, &parent_id)) return false;
      const bool first_child = num_children_[parent_id] == 0;
      link_child(parent_id, id);
      if (first_child && where_[parent_id] == Section::kLeaf) {  // a free leaf stops being one
        policy_->discard(parent_id);
        inner_.push_back(parent_id);
        where_[parent_id] = Section::kInner;
      }
    }
    parent = block;
  }
  report(stop);
  return true;
}

bool VllmQueueCore::note_hits(PyObject* blocks) {
  Ref iterator{PyObject_GetIter(blocks)};
  if (!iterator.object) return false;
  while (PyObject* block = PyIter_Next(iterator.object)) {
    Ref item{block};
    bool null;
    int32_t id;
    if (!vllm_block::is_null(block, &null)) return false;
    if (null) continue;
    if (!block_id(block, &id)) return false;
    accesses_[id] = (accesses_[id] ? accesses_[id] : 1) + 1;
  }
  return !PyErr_Occurred();
}

// note_hash_removed: cut its links; free, it is now hash-less (handed out first).
bool VllmQueueCore::note_hash_removed(PyObject* block) {
  long long raw;
  if (!vllm_block::raw_id(block, &raw)) return false;
  if (!knows(raw)) return true;  // a victim popleft_n already cut, or a hash-less block
  const auto id = static_cast<int32_t>(raw);
  if (!cut(id)) return false;
  forget(id);
  const Section section = where_[id];
  if (section == Section::kLeaf) {
    policy_->discard(id);
  } else if (section == Section::kInner) {
    inner_.erase(id);
  } else if (section == Section::kHinted) {
    hinted_.erase(id);
  } else {
    return true;
  }
  first_.push_back(id);
  keep(id, block);
  where_[id] = Section::kFirst;
  return true;
}

// note_moved: source's hashes move to target, and so do its links and tables.
bool VllmQueueCore::note_moved(PyObject* source, PyObject* target) {
  int32_t old_id, new_id;
  if (!block_id(source, &old_id) || !block_id(target, &new_id)) return false;
  keep(new_id, target);
  const int32_t parent = parent_[old_id];
  if (parent != kNoBlock) {
    unlink_child(old_id);
    link_child(parent, new_id);
  }
  while (first_child_[old_id] != kNoBlock) link_child(new_id, first_child_[old_id]);
  if (depth_[old_id] >= 0) depth_[new_id] = depth_[old_id];
  if (accesses_[old_id]) accesses_[new_id] = accesses_[old_id];
  if (stamp_[old_id]) stamp_[new_id] = stamp_[old_id];
  forget(old_id);
  return true;
}

// note_reset: vLLM dropped every hash; forget all, keep the hand-out order.
bool VllmQueueCore::note_reset() {
  Ref order;
  if (!eviction_order(&order.object)) return false;
  policy_->clear();
  const auto n = static_cast<size_t>(num_blocks_);
  where_.assign(n, Section::kNone);
  parent_.assign(n, kNoBlock);
  first_child_.assign(n, kNoBlock);
  sibling_prev_.assign(n, kNoBlock);
  sibling_next_.assign(n, kNoBlock);
  num_children_.assign(n, 0);
  depth_.assign(n, -1);
  accesses_.assign(n, 0);
  stamp_.assign(n, 0);
  first_.reset(n);
  inner_.reset(n);
  hinted_.reset(n);
  num_free_ = 0;
  Ref seq{PySequence_Fast(order.object, "eviction order")};
  return seq.object && prepend_n(seq.object);
}

// _eviction_order: the hand-out order, replayed on a copy of the policy and link counts.
bool VllmQueueCore::eviction_order(PyObject** out) {
  Ref order{PyList_New(0)};
  if (!order.object) return false;
  for (int32_t id = first_.front(); id != kNoBlock; id = first_.next(id)) {
    if (PyList_Append(order.object, blocks_[id]) < 0) return false;
  }
  std::unique_ptr<Policy> policy = policy_->clone();
  const auto n = static_cast<size_t>(num_blocks_);
  IdChain inner;
  inner.reset(n);
  std::vector<char> in_inner(n, 0);
  for (int32_t id = inner_.front(); id != kNoBlock; id = inner_.next(id)) {
    inner.push_back(id);
    in_inner[id] = 1;
  }
  std::vector<int32_t> hinted;  // oldest hint first: handed out from the back
  for (int32_t id = hinted_.front(); id != kNoBlock; id = hinted_.next(id)) hinted.push_back(id);
  std::vector<int32_t> num_children = num_children_;
  while (true) {
    int32_t id = policy->evict_one();
    if (id == kNoBlock && inner.size()) {
      id = inner.front();
      inner.erase(id);
      in_inner[id] = 0;
    } else if (id == kNoBlock) {
      if (hinted.empty()) break;
      id = hinted.back();
      hinted.pop_back();
    }
    if (PyList_Append(order.object, blocks_[id]) < 0) return false;
    const int32_t parent = parent_[id];
    if (parent != kNoBlock && --num_children[parent] == 0 && in_inner[parent]) {
      inner.erase(parent);
      in_inner[parent] = 0;
      Ref key{vllm_block::hash_key(blocks_[parent])};
      LeafInfo leaf;
      if (!key.object || !leaf_info(parent, key.object, &leaf)) return false;
      policy->insert(parent, leaf);
    }
  }
  *out = order.object;
  order.object = nullptr;
  return true;
}

bool VllmQueueCore::check_invariants() {
  int64_t sections[5] = {0, 0, 0, 0, 0};
  for (int32_t id = 0; id < num_blocks_; ++id) {
    const Section section = where_[id];
    sections[static_cast<int>(section)] += 1;
    if (section == Section::kLeaf && (num_children_[id] > 0 || !policy_->contains(id))) {
      native_raise(ErrorKind::kInvariant,
                   "free leaf " + std::to_string(id) + " has children or is not tracked");
      return false;
    }
    if (section == Section::kInner && num_children_[id] == 0) {
      native_raise(ErrorKind::kInvariant,
                   "free inner block " + std::to_string(id) + " has no cached child");
      return false;
    }
    if (section == Section::kHinted && depth_[id] < 0) {
      native_raise(ErrorKind::kInvariant, "hinted block " + std::to_string(id) + " is not cached");
      return false;
    }
  }
  const std::pair<const IdChain*, Section> chains[] = {
      {&first_, Section::kFirst}, {&inner_, Section::kInner}, {&hinted_, Section::kHinted}};
  for (const auto& [chain, section] : chains) {
    size_t length = 0;
    for (int32_t id = chain->front(); id != kNoBlock; id = chain->next(id), ++length) {
      if (where_[id] != section || length > chain->size()) {
        native_raise(ErrorKind::kInvariant, "chain " + std::to_string(static_cast<int>(section)) +
                                                " disagrees with the section map");
        return false;
      }
    }
    if (length != chain->size() || static_cast<int64_t>(length) != sections[static_cast<int>(section)]) {
      native_raise(ErrorKind::kInvariant, "a section's chain has the wrong length");
      return false;
    }
  }
  const int64_t num_free = sections[1] + sections[2] + sections[3] + sections[4];
  if (sections[2] != static_cast<int64_t>(policy_->size()) || num_free != num_free_) {
    native_raise(ErrorKind::kInvariant, "sections vs " + std::to_string(num_free_) + " free");
    return false;
  }
  int64_t linked = 0, counted = 0;
  for (int32_t id = 0; id < num_blocks_; ++id) {
    counted += num_children_[id];
    int64_t listed = 0;
    for (int32_t child = first_child_[id]; child != kNoBlock; child = sibling_next_[child]) {
      if (parent_[child] != id || ++listed > num_children_[id]) {
        native_raise(ErrorKind::kInvariant,
                     "block " + std::to_string(child) + "'s parent does not list it");
        return false;
      }
    }
    if (listed != num_children_[id]) {
      native_raise(ErrorKind::kInvariant, "block " + std::to_string(id) + "'s child count is off");
      return false;
    }
    linked += parent_[id] != kNoBlock;
  }
  if (linked != counted) {
    native_raise(ErrorKind::kInvariant, "a child is listed under a parent it does not name");
    return false;
  }
  return true;
}

}  // namespace prefixcache
