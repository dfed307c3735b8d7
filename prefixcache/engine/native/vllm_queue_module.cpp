// prefixcache.engine._native.VllmQueue: the binding of vllm_queue.h.
//
// The vLLM plugin's queue for a native policy (integrations/vllm_native_queue.py subclasses
// it): vLLM's FreeKVCacheBlockQueue methods that BlockPool calls (popleft, popleft_n,
// remove, append, append_n, prepend_n, num_free_blocks) and the plugin's learning calls,
// each one C call whatever the number of blocks. Holds the blocks it has seen (a GC type).
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <cstddef>
#include <cstring>
#include <memory>
#include <new>

#include "binding.h"
#include "vllm_queue.h"

namespace prefixcache {
namespace {

struct QueueObject {
  PyObject_HEAD
  VllmQueueCore* core;
  bool busy;  // a call is running (CallGuard)
};

VllmQueueCore* core_of(PyObject* self) {
  VllmQueueCore* core = reinterpret_cast<QueueObject*>(self)->core;
  if (!core) PyErr_SetString(PyExc_RuntimeError, "VllmQueue.__init__ was not called");
  return core;
}

/// Runs ``body`` (returning bool) on the core; None on success.
#define QUEUE_CALL(body)                         \
  VllmQueueCore* core = core_of(self);           \
  if (!core) return nullptr;                     \
  try {                                          \
    if (!(body)) return nullptr;                 \
  } catch (const std::bad_alloc&) {              \
    return PyErr_NoMemory();                     \
  }

int queue_init(PyObject* self, PyObject* args, PyObject* kwargs) {
  CallGuard guard(&reinterpret_cast<QueueObject*>(self)->busy);
  if (!guard.admitted()) return -1;
  static const char* names[] = {"num_blocks", "policy", "options", "on_register", nullptr};
  int num_blocks = 0;
  const char* name = nullptr;
  PyObject* options = nullptr;
  int on_register = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "is|Op", const_cast<char**>(names),
                                   &num_blocks, &name, &options, &on_register)) {
    return -1;
  }
  if (num_blocks < 1) {
    native_raise(ErrorKind::kInvalidArgument, "num_blocks must be >= 1");
    return -1;
  }
  std::unique_ptr<Policy> policy;
  if (!native_build_policy(name, num_blocks, options == Py_None ? nullptr : options, &policy)) {
    return -1;
  }
  try {
    const bool leaf_hash = std::strcmp(name, "lru") != 0 && std::strcmp(name, "fifo") != 0;
    auto* core = new VllmQueueCore(num_blocks, std::move(policy), on_register != 0, leaf_hash);
    auto* object = reinterpret_cast<QueueObject*>(self);
    delete object->core;
    object->core = core;
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
    return -1;
  }
  return 0;
}

int queue_traverse(PyObject* self, visitproc visit, void* arg) {
  VllmQueueCore* core = reinterpret_cast<QueueObject*>(self)->core;
  return core ? core->traverse(visit, arg) : 0;
}

int queue_clear(PyObject* self) {
  VllmQueueCore* core = reinterpret_cast<QueueObject*>(self)->core;
  if (core) core->clear_blocks();
  return 0;
}

void queue_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  delete reinterpret_cast<QueueObject*>(self)->core;
  reinterpret_cast<QueueObject*>(self)->core = nullptr;
  Py_TYPE(self)->tp_free(self);
}

PyObject* queue_popleft_n(PyObject* self, PyObject* arg) {
  const long long n = PyLong_AsLongLong(arg);
  if (n == -1 && PyErr_Occurred()) return nullptr;
  PyObject* taken = nullptr;
  QUEUE_CALL(core->popleft_n(n, &taken))
  return taken;
}

PyObject* queue_popleft(PyObject* self, PyObject*) {
  VllmQueueCore* core = core_of(self);
  if (!core) return nullptr;
  if (core->num_free() == 0) {
    PyErr_SetString(PyExc_ValueError, "No free blocks available");
    return nullptr;
  }
  PyObject* one = nullptr;
  try {
    if (!core->popleft_n(1, &one)) return nullptr;
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  PyObject* block = Py_NewRef(PyList_GET_ITEM(one, 0));
  Py_DECREF(one);
  return block;
}

PyObject* queue_remove(PyObject* self, PyObject* block) {
  QUEUE_CALL(core->remove(block))
  Py_RETURN_NONE;
}

PyObject* with_sequence(PyObject* self, PyObject* blocks, bool prepend) {
  PyObject* seq = PySequence_Fast(blocks, "blocks must be a sequence");
  if (!seq) return nullptr;
  VllmQueueCore* core = core_of(self);
  bool ok = false;
  if (core) {
    try {
      ok = prepend ? core->prepend_n(seq) : core->append_n(seq);
    } catch (const std::bad_alloc&) {
      PyErr_NoMemory();
    }
  }
  Py_DECREF(seq);
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

PyObject* queue_append_n(PyObject* self, PyObject* blocks) { return with_sequence(self, blocks, false); }
PyObject* queue_prepend_n(PyObject* self, PyObject* blocks) { return with_sequence(self, blocks, true); }

PyObject* queue_append(PyObject* self, PyObject* block) {
  PyObject* one = PyTuple_Pack(1, block);
  if (!one) return nullptr;
  PyObject* result = with_sequence(self, one, false);
  Py_DECREF(one);
  return result;
}

PyObject* queue_note_registered(PyObject* self, PyObject* args) {
  PyObject* blocks;
  Py_ssize_t start, stop;
  if (!PyArg_ParseTuple(args, "Onn", &blocks, &start, &stop)) return nullptr;
  PyObject* seq = PySequence_Fast(blocks, "blocks must be a sequence");
  if (!seq) return nullptr;
  VllmQueueCore* core = core_of(self);
  bool ok = false;
  if (core) {
    try {
      ok = core->note_registered(seq, start, stop);
    } catch (const std::bad_alloc&) {
      PyErr_NoMemory();
    }
  }
  Py_DECREF(seq);
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

PyObject* queue_note_hits(PyObject* self, PyObject* blocks) {
  QUEUE_CALL(core->note_hits(blocks))
  Py_RETURN_NONE;
}

PyObject* queue_set_hinted(PyObject* self, PyObject* args) {
  PyObject* blocks;
  long long limit;
  if (!PyArg_ParseTuple(args, "OL", &blocks, &limit)) return nullptr;
  PyObject* seq = PySequence_Fast(blocks, "blocks must be iterable");
  if (!seq) return nullptr;
  VllmQueueCore* core = core_of(self);
  int64_t count = 0;
  bool ok = false;
  if (core) {
    try {
      ok = core->set_hinted(seq, limit, &count);
    } catch (const std::bad_alloc&) {
      PyErr_NoMemory();
    }
  }
  Py_DECREF(seq);
  if (!ok) return nullptr;
  return PyLong_FromLongLong(count);
}

PyObject* queue_note_hash_removed(PyObject* self, PyObject* block) {
  QUEUE_CALL(core->note_hash_removed(block))
  Py_RETURN_NONE;
}

// A yes/no question about one block ID (an int; out of range or too large: false).
template <bool (VllmQueueCore::*Query)(int64_t) const noexcept>
PyObject* queue_ask(PyObject* self, PyObject* arg) {
  VllmQueueCore* core = core_of(self);
  if (!core) return nullptr;
  int overflow = 0;
  const long long id = PyLong_AsLongLongAndOverflow(arg, &overflow);
  if (id == -1 && PyErr_Occurred()) return nullptr;
  return PyBool_FromLong(!overflow && (core->*Query)(id));
}

/// read_block(block): what the native code reads of a block, as it reads it (the tests
/// compare it with vLLM's attributes; the slot reads are vllm_block.cpp's).
PyObject* queue_read_block(PyObject*, PyObject* block) {
  if (!vllm_block::ready()) return nullptr;
  long long id, refs;
  bool null;
  if (!vllm_block::raw_id(block, &id) || !vllm_block::ref_cnt(block, &refs) ||
      !vllm_block::is_null(block, &null)) {
    return nullptr;
  }
  PyObject* key = vllm_block::hash_key(block);
  if (!key) return nullptr;
  return Py_BuildValue("(LLNNN)", id, refs, PyBool_FromLong(null), key,
                       PyBool_FromLong(vllm_block::uses_slots(Py_TYPE(block))));
}

PyObject* queue_note_moved(PyObject* self, PyObject* args) {
  PyObject *source, *target;
  if (!PyArg_ParseTuple(args, "OO", &source, &target)) return nullptr;
  QUEUE_CALL(core->note_moved(source, target))
  Py_RETURN_NONE;
}

PyObject* queue_note_reset(PyObject* self, PyObject*) {
  QUEUE_CALL(core->note_reset())
  Py_RETURN_NONE;
}

PyObject* queue_eviction_order(PyObject* self, PyObject*) {
  PyObject* order = nullptr;
  QUEUE_CALL(core->eviction_order(&order))
  return order;
}

PyObject* queue_check_invariants(PyObject* self, PyObject*) {
  QUEUE_CALL(core->check_invariants())
  Py_RETURN_NONE;
}

PyObject* queue_take_evictions(PyObject* self, PyObject*) {
  VllmQueueCore* core = core_of(self);
  return core ? PyLong_FromLongLong(core->take_evictions()) : nullptr;
}

PyObject* queue_take_counts(PyObject* self, PyObject*) {
  VllmQueueCore* core = core_of(self);
  if (!core) return nullptr;
  const int64_t hits = core->take_hits();
  return Py_BuildValue("LL", static_cast<long long>(hits),
                       static_cast<long long>(core->take_evictions()));
}

PyObject* queue_num_hinted(PyObject* self, void*) {
  VllmQueueCore* core = core_of(self);
  return core ? PyLong_FromLongLong(core->num_hinted()) : nullptr;
}

PyObject* queue_num_free(PyObject* self, void*) {
  VllmQueueCore* core = core_of(self);
  return core ? PyLong_FromLongLong(core->num_free()) : nullptr;
}

#define ENTER(fn) guarded<QueueObject, fn>

PyMethodDef g_queue_methods[] = {
    {"popleft", ENTER(queue_popleft), METH_NOARGS, "popleft() -> block; ValueError when none"},
    {"popleft_n", ENTER(queue_popleft_n), METH_O, "popleft_n(n) -> list of n blocks"},
    {"remove", ENTER(queue_remove), METH_O, "remove(block): a prefix hit on a free block"},
    {"append", ENTER(queue_append), METH_O, "append(block): free one block"},
    {"append_n", ENTER(queue_append_n), METH_O, "append_n(blocks): free blocks, in order"},
    {"prepend_n", ENTER(queue_prepend_n), METH_O, "prepend_n(blocks): hash-less, handed out first"},
    {"note_registered", ENTER(queue_note_registered), METH_VARARGS,
     "note_registered(blocks, start, stop): blocks[start:stop] were just cached"},
    {"note_hits", ENTER(queue_note_hits), METH_O, "note_hits(blocks): handed out as a prefix hit"},
    {"set_hinted", ENTER(queue_set_hinted), METH_VARARGS,
     "set_hinted(blocks, limit) -> int: the hinted section, the free cached blocks listed"},
    {"note_hash_removed", ENTER(queue_note_hash_removed), METH_O,
     "note_hash_removed(block): the block lost its hashes"},
    {"knows", ENTER(queue_ask<&VllmQueueCore::knows>), METH_O, "knows(block_id) -> bool: any state for the block"},
    {"is_free_leaf", ENTER(queue_ask<&VllmQueueCore::is_free_leaf>), METH_O,
     "is_free_leaf(block_id) -> bool: free and one of the policy's leaves"},
    {"note_moved", ENTER(queue_note_moved), METH_VARARGS,
     "note_moved(source, target): source's hashes move to target"},
    {"note_reset", ENTER(queue_note_reset), METH_NOARGS, "note_reset(): every hash dropped"},
    {"eviction_order", ENTER(queue_eviction_order), METH_NOARGS,
     "eviction_order() -> list: every free block in hand-out order (replayed on a copy)"},
    {"take_evictions", ENTER(queue_take_evictions), METH_NOARGS,
     "take_evictions() -> int: victims counted by BlockPoolHook since the last call"},
    {"take_counts", ENTER(queue_take_counts), METH_NOARGS,
     "take_counts() -> (hits, evictions): counted by BlockPoolHook since the last call"},
    {"check_invariants", ENTER(queue_check_invariants), METH_NOARGS,
     "check_invariants(): InvariantError naming the first broken invariant"},
    {"read_block", queue_read_block, METH_O | METH_STATIC,
     "read_block(block) -> (block_id, ref_cnt, is_null, block_hash, slots): the reads the "
     "native code makes; slots: the type is vLLM's KVCacheBlock, read at its slots' offsets"},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef g_queue_getset[] = {
    {"num_free_blocks", queue_num_free, nullptr, "free blocks (vLLM's queue attribute)", nullptr},
    {"num_hinted_blocks", queue_num_hinted, nullptr, "free blocks in the hinted section", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyTypeObject g_queue_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

}  // namespace

bool add_vllm_queue_type(PyObject* module) {
  g_queue_type.tp_name = "prefixcache.engine._native.VllmQueue";
  g_queue_type.tp_basicsize = sizeof(QueueObject);
  g_queue_type.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC;
  g_queue_type.tp_doc =
      "VllmQueue(num_blocks, policy, options=None, on_register=False): the vLLM plugin's "
      "free-block queue with its bookkeeping native (vllm_queue.h).";
  g_queue_type.tp_new = PyType_GenericNew;
  g_queue_type.tp_init = queue_init;
  g_queue_type.tp_dealloc = queue_dealloc;
  g_queue_type.tp_traverse = queue_traverse;
  g_queue_type.tp_clear = queue_clear;
  g_queue_type.tp_methods = g_queue_methods;
  g_queue_type.tp_getset = g_queue_getset;
  if (PyType_Ready(&g_queue_type) < 0) return false;
  Py_INCREF(&g_queue_type);
  return PyModule_AddObject(module, "VllmQueue", reinterpret_cast<PyObject*>(&g_queue_type)) >= 0 &&
         add_vllm_hook_type(module);
}

VllmQueueCore* vllm_queue_core(PyObject* object) {
  return PyObject_TypeCheck(object, &g_queue_type) ? reinterpret_cast<QueueObject*>(object)->core
                                                    : nullptr;
}

}  // namespace prefixcache
