// VllmQueueCore (vllm_queue.h): integrations/vllm_queue.py's PolicyFreeBlockQueue, step for
// step, over arrays. Each method names the Python method it mirrors; keep the two in step.
#include "vllm_queue.h"

#include <algorithm>
#include <string>
#include <utility>

#include "binding.h"

namespace prefixcache {
namespace {

bool invariant(const std::string& message) {
  native_raise(ErrorKind::kInvariant, message);
  return false;
}

}  // namespace

// ------------------------------------------------------------------ IdChain

void IdChain::reset(size_t n) {
  prev_.assign(n, kNoBlock);
  next_.assign(n, kNoBlock);
  head_ = tail_ = kNoBlock;
  size_ = 0;
}

void IdChain::push_back(int32_t id) {
  prev_[id] = tail_;
  next_[id] = kNoBlock;
  (tail_ != kNoBlock ? next_[tail_] : head_) = id;
  tail_ = id;
  ++size_;
}

void IdChain::push_front(int32_t id) {
  next_[id] = head_;
  prev_[id] = kNoBlock;
  (head_ != kNoBlock ? prev_[head_] : tail_) = id;
  head_ = id;
  ++size_;
}

void IdChain::erase(int32_t id) {
  const int32_t before = prev_[id], after = next_[id];
  (before != kNoBlock ? next_[before] : head_) = after;
  (after != kNoBlock ? prev_[after] : tail_) = before;
  --size_;
}

// ------------------------------------------------------------------ construction

VllmQueueCore::VllmQueueCore(int32_t num_blocks, std::unique_ptr<Policy> policy,
                             bool on_register, bool leaf_hash)
    : num_blocks_(num_blocks),
      policy_(std::move(policy)),
      on_register_(on_register),
      leaf_hash_(leaf_hash) {
  const auto n = static_cast<size_t>(num_blocks);
  blocks_.assign(n, nullptr);
  where_.assign(n, Section::kNone);
  first_.reset(n);
  inner_.reset(n);
  hinted_.reset(n);
  picked_.assign(n, 0);
  stamp_.assign(n, 0);
  depth_.assign(n, -1);
  accesses_.assign(n, 0);
  parent_.assign(n, kNoBlock);
  first_child_.assign(n, kNoBlock);
  sibling_prev_.assign(n, kNoBlock);
  sibling_next_.assign(n, kNoBlock);
  num_children_.assign(n, 0);
  vllm_block::ready();
}

VllmQueueCore::~VllmQueueCore() { clear_blocks(); }

void VllmQueueCore::clear_blocks() {
  for (PyObject*& block : blocks_) Py_CLEAR(block);
}

int VllmQueueCore::traverse(visitproc visit, void* arg) {
  for (PyObject* block : blocks_) Py_VISIT(block);
  return 0;
}

// ------------------------------------------------------------------ helpers

bool VllmQueueCore::block_id(PyObject* block, int32_t* out) const {
  long long id;
  if (!vllm_block::raw_id(block, &id)) return false;
  if (id < 0 || id >= num_blocks_) {
    native_raise(ErrorKind::kInvalidBlockId, "block " + std::to_string(id) + " is outside [0, " +
                                                 std::to_string(num_blocks_) + ")");
    return false;
  }
  *out = static_cast<int32_t>(id);
  return true;
}

bool VllmQueueCore::ids_of(PyObject* seq, std::vector<int32_t>& ids,
                           std::vector<PyObject*>& items) const {
  const Py_ssize_t size = PySequence_Fast_GET_SIZE(seq);
  PyObject** objects = PySequence_Fast_ITEMS(seq);
  ids.resize(static_cast<size_t>(size));
  items.assign(objects, objects + size);
  for (Py_ssize_t i = 0; i < size; ++i) {
    if (!block_id(objects[i], &ids[static_cast<size_t>(i)])) return false;
  }
  return true;
}

// _check_not_free: a block already free or listed twice, before any change.
bool VllmQueueCore::check_not_free(const std::vector<int32_t>& ids) {
  constexpr auto kSeen = static_cast<Section>(5);
  size_t i = 0;
  for (; i < ids.size() && where_[ids[i]] == Section::kNone; ++i) where_[ids[i]] = kSeen;
  for (size_t j = 0; j < i; ++j) where_[ids[j]] = Section::kNone;
  if (i == ids.size()) return true;
  PyErr_Format(PyExc_RuntimeError, "block %d is already free", ids[i]);
  return false;
}

void VllmQueueCore::keep(int32_t id, PyObject* block) {
  Py_INCREF(block);
  Py_XSETREF(blocks_[id], block);
}

bool VllmQueueCore::leaf_info(int32_t id, PyObject* key, LeafInfo* out) {
  int64_t hash;
  if (!vllm_block::policy_hash(key, &hash)) return false;
  *out = leaf_of(id, hash);
  return true;
}

LeafInfo VllmQueueCore::leaf_of(int32_t id, int64_t hash) const {
  const int64_t uses = accesses_[id];
  return LeafInfo{hash, stamp_[id], uses ? uses : 1, std::max<int64_t>(depth_[id], 0)};
}

// _insert_leaf: a hash-less block (unpinned) is keyed ("unpinned", block_id).
bool VllmQueueCore::insert_leaf(int32_t id) {
  if (!leaf_hash_) {  // lru, fifo: the key is never read
    where_[id] = Section::kLeaf;
    policy_->insert(id, leaf_of(id, 0));
    return true;
  }
  PyObject* key = vllm_block::hash_key(blocks_[id]);
  if (!key) return false;
  if (key == Py_None) {
    Py_DECREF(key);
    key = vllm_block::unpinned_key(id);
    if (!key) return false;
  }
  LeafInfo leaf;
  const bool ok = leaf_info(id, key, &leaf);
  Py_DECREF(key);
  if (!ok) return false;
  where_[id] = Section::kLeaf;
  policy_->insert(id, leaf);
  return true;
}

void VllmQueueCore::link_child(int32_t parent, int32_t child) {
  if (parent_[child] == parent) return;  // a set: adding twice changes nothing
  if (parent_[child] != kNoBlock) unlink_child(child);
  parent_[child] = parent;
  sibling_prev_[child] = kNoBlock;
  sibling_next_[child] = first_child_[parent];
  if (first_child_[parent] != kNoBlock) sibling_prev_[first_child_[parent]] = child;
  first_child_[parent] = child;
  ++num_children_[parent];
}

void VllmQueueCore::unlink_child(int32_t child) {
  const int32_t parent = parent_[child];
  const int32_t before = sibling_prev_[child], after = sibling_next_[child];
  (before != kNoBlock ? sibling_next_[before] : first_child_[parent]) = after;
  if (after != kNoBlock) sibling_prev_[after] = before;
  parent_[child] = sibling_prev_[child] = sibling_next_[child] = kNoBlock;
  --num_children_[parent];
}

// _cut: forget the links; a free parent left childless becomes a leaf.
bool VllmQueueCore::cut(int32_t id) {
  const int32_t parent = parent_[id];
  if (parent != kNoBlock) {
    unlink_child(id);
    if (num_children_[parent] == 0 && where_[parent] == Section::kInner) {
      inner_.erase(parent);
      if (!insert_leaf(parent)) return false;
    }
  }
  for (int32_t child = first_child_[id]; child != kNoBlock;) {
    const int32_t next = sibling_next_[child];
    parent_[child] = sibling_prev_[child] = sibling_next_[child] = kNoBlock;
    child = next;
  }
  first_child_[id] = kNoBlock;
  num_children_[id] = 0;
  return true;
}

void VllmQueueCore::forget(int32_t id) noexcept {
  depth_[id] = -1;
  accesses_[id] = 0;
  stamp_[id] = 0;
}

bool VllmQueueCore::knows(int64_t id) const noexcept {
  if (id < 0 || id >= num_blocks_) return false;
  return depth_[id] >= 0 || where_[id] != Section::kNone || parent_[id] != kNoBlock ||
         num_children_[id] > 0;
}

// ------------------------------------------------------------------ queue interface

bool VllmQueueCore::take_victim(int32_t* out) {
  int32_t id = policy_->evict_one();
  if (id != kNoBlock) {
    if (where_[id] != Section::kLeaf) {
      return invariant("the policy evicted " + std::to_string(id) + ", which it was not given");
    }
  } else if (inner_.size()) {  // no leaf: the oldest freed block whose children are in use
    id = inner_.front();
    inner_.erase(id);
  } else if (hinted_.size()) {  // only queued prefixes left: the newest hint first
    id = hinted_.back();
    hinted_.erase(id);
  } else {
    return invariant(std::to_string(num_free_) + " blocks counted free, none found");
  }
  *out = id;
  return true;
}

// popleft_n: hash-less blocks first, then one victim at a time (each may expose its parent).
bool VllmQueueCore::popleft_n(int64_t n, PyObject** out) {
  if (n > num_free_) {
    PyErr_Format(PyExc_ValueError, "cannot take %lld free blocks: %lld are free",
                 static_cast<long long>(n), static_cast<long long>(num_free_));
    return false;
  }
  const int64_t count = std::max<int64_t>(n, 0);
  PyObject* taken = PyList_New(static_cast<Py_ssize_t>(count));
  if (!taken) return false;
  int64_t i = 0;
  for (; i < count && first_.size(); ++i) {
    const int32_t id = first_.front();
    first_.erase(id);
    where_[id] = Section::kNone;
    Py_INCREF(blocks_[id]);
    PyList_SET_ITEM(taken, static_cast<Py_ssize_t>(i), blocks_[id]);
  }
  for (; i < count; ++i) {
    int32_t id;
    if (!take_victim(&id)) break;
    where_[id] = Section::kNone;
    if (!cut(id)) break;
    forget(id);
    Py_INCREF(blocks_[id]);
    PyList_SET_ITEM(taken, static_cast<Py_ssize_t>(i), blocks_[id]);
  }
  if (i < count) {  // an invariant broke (the Python queue stops there too)
    for (; i < count; ++i) PyList_SET_ITEM(taken, static_cast<Py_ssize_t>(i), Py_NewRef(Py_None));
    Py_DECREF(taken);
    return false;
  }
  num_free_ -= n;
  *out = taken;
  return true;
}

bool VllmQueueCore::remove(PyObject* block) {
  long long id;
  if (!vllm_block::raw_id(block, &id)) return false;
  if (id < 0 || id >= num_blocks_ || where_[id] == Section::kNone) {
    PyErr_Format(PyExc_RuntimeError, "remove() called on an invalid block: %S", block);
    return false;
  }
  const Section section = where_[id];
  where_[id] = Section::kNone;
  if (section == Section::kLeaf) {
    policy_->discard(static_cast<int32_t>(id));
  } else if (section == Section::kInner) {
    inner_.erase(static_cast<int32_t>(id));
  } else if (section == Section::kHinted) {
    hinted_.erase(static_cast<int32_t>(id));
  } else {
    first_.erase(static_cast<int32_t>(id));
  }
  --num_free_;
  return true;
}

bool VllmQueueCore::append_n(PyObject* blocks) {
  std::vector<int32_t> ids;
  std::vector<PyObject*> items;
  if (!ids_of(blocks, ids, items) || !check_not_free(ids)) return false;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    keep(id, items[i]);
    stamp_[id] = ++clock_;
    if (num_children_[id] > 0) {
      inner_.push_back(id);
      where_[id] = Section::kInner;
    } else if (!insert_leaf(id)) {  // a cached leaf, or a hash-less block unpin_blocks appends
      return false;
    }
    ++num_free_;
  }
  return true;
}

bool VllmQueueCore::prepend_n(PyObject* blocks) {
  std::vector<int32_t> ids;
  std::vector<PyObject*> items;
  if (!ids_of(blocks, ids, items) || !check_not_free(ids)) return false;
  for (size_t i = ids.size(); i-- > 0;) {
    keep(ids[i], items[i]);
    first_.push_front(ids[i]);
    where_[ids[i]] = Section::kFirst;
  }
  num_free_ += static_cast<int64_t>(ids.size());
  return true;
}

}  // namespace prefixcache
