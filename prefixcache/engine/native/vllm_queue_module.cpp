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
    auto* core = new VllmQueueCore(num_blocks, std::move(policy), on_register != 0);
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

PyObject* queue_note_hash_removed(PyObject* self, PyObject* block) {
  QUEUE_CALL(core->note_hash_removed(block))
  Py_RETURN_NONE;
}

PyObject* queue_knows(PyObject* self, PyObject* arg) {
  VllmQueueCore* core = core_of(self);
  if (!core) return nullptr;
  int overflow = 0;
  const long long id = PyLong_AsLongLongAndOverflow(arg, &overflow);
  if (id == -1 && PyErr_Occurred()) return nullptr;
  return PyBool_FromLong(!overflow && core->knows(id));
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
    {"note_hash_removed", ENTER(queue_note_hash_removed), METH_O,
     "note_hash_removed(block): the block lost its hashes"},
    {"knows", ENTER(queue_knows), METH_O, "knows(block_id) -> bool: any state for the block"},
    {"note_moved", ENTER(queue_note_moved), METH_VARARGS,
     "note_moved(source, target): source's hashes move to target"},
    {"note_reset", ENTER(queue_note_reset), METH_NOARGS, "note_reset(): every hash dropped"},
    {"eviction_order", ENTER(queue_eviction_order), METH_NOARGS,
     "eviction_order() -> list: every free block in hand-out order (replayed on a copy)"},
    {"take_evictions", ENTER(queue_take_evictions), METH_NOARGS,
     "take_evictions() -> int: victims counted by HashRemovalHook since the last call"},
    {"check_invariants", ENTER(queue_check_invariants), METH_NOARGS,
     "check_invariants(): InvariantError naming the first broken invariant"},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef g_queue_getset[] = {
    {"num_free_blocks", queue_num_free, nullptr, "free blocks (vLLM's queue attribute)", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyTypeObject g_queue_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

// ------------------------------------------------------------------ HashRemovalHook
//
// Stands for BlockPool._remove_cached_block_hashes, which vLLM calls per block (every
// block get_new_blocks hands out): vLLM's function, then, for a pool with this queue, the
// wrapper's work in C (a known block: note_hash_removed; a victim that lost hashes and is
// held by nobody: one eviction counted in the queue, which take_evictions() hands to the
// metrics). Another queue: the Python wrapper.
// A method descriptor with vectorcall: calling it costs no Python frame of its own.

struct HookObject {
  PyObject_HEAD
  PyObject* original;  // vLLM's function
  PyObject* fallback;  // the Python wrapper, for pools without a VllmQueue
  vectorcallfunc vectorcall;
};

PyObject* g_free_block_queue = nullptr;
PyObject* g_ref_cnt = nullptr;

/// Whether nothing holds ``block`` (its ref_cnt is 0).
bool unheld(PyObject* block, bool* out) {
  PyObject* refs = PyObject_GetAttr(block, g_ref_cnt);
  if (!refs) return false;
  const long held = PyLong_AsLong(refs);
  Py_DECREF(refs);
  if (held == -1 && PyErr_Occurred()) return false;
  *out = held == 0;
  return true;
}

PyObject* hook_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* hook = reinterpret_cast<HookObject*>(self);
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (nargs != 2 || kwnames) return PyObject_Vectorcall(hook->fallback, args, nargsf, kwnames);
  PyObject* queue = PyObject_GetAttr(args[0], g_free_block_queue);
  if (!queue) return nullptr;
  if (!PyObject_TypeCheck(queue, &g_queue_type) || !reinterpret_cast<QueueObject*>(queue)->core) {
    Py_DECREF(queue);
    return PyObject_Vectorcall(hook->fallback, args, nargsf, kwnames);
  }
  PyObject* removed = PyObject_Vectorcall(hook->original, args, 2, nullptr);
  VllmQueueCore* core = reinterpret_cast<QueueObject*>(queue)->core;
  long long id;
  bool ok = removed && vllm_block::raw_id(args[1], &id);
  if (ok && core->knows(id)) {
    try {
      ok = core->note_hash_removed(args[1]);
    } catch (const std::bad_alloc&) {
      ok = false;
      PyErr_NoMemory();
    }
  } else if (ok) {
    const int truth = PyObject_IsTrue(removed);
    bool free = false;
    ok = truth >= 0 && (truth == 0 || unheld(args[1], &free));
    if (ok && truth && free) core->count_eviction();  // a victim popleft_n handed out
  }
  Py_DECREF(queue);
  if (!ok) Py_CLEAR(removed);
  return removed;
}

PyObject* hook_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject *original, *fallback;
  static const char* names[] = {"original", "fallback", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO", const_cast<char**>(names), &original,
                                   &fallback)) {
    return nullptr;
  }
  auto* hook = reinterpret_cast<HookObject*>(type->tp_alloc(type, 0));
  if (!hook) return nullptr;
  hook->original = Py_NewRef(original);
  hook->fallback = Py_NewRef(fallback);
  hook->vectorcall = hook_call;
  return reinterpret_cast<PyObject*>(hook);
}

void hook_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  Py_CLEAR(reinterpret_cast<HookObject*>(self)->original);
  Py_CLEAR(reinterpret_cast<HookObject*>(self)->fallback);
  Py_TYPE(self)->tp_free(self);
}

int hook_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(reinterpret_cast<HookObject*>(self)->original);
  Py_VISIT(reinterpret_cast<HookObject*>(self)->fallback);
  return 0;
}

PyObject* hook_get(PyObject* self, PyObject* obj, PyObject*) {
  return obj ? PyMethod_New(self, obj) : Py_NewRef(self);
}

PyMemberDef g_hook_members[] = {
    {"__prefixcache_original__", T_OBJECT, offsetof(HookObject, original), READONLY,
     "vLLM's function this hook stands for"},
    {"fallback", T_OBJECT, offsetof(HookObject, fallback), READONLY,
     "the Python wrapper, called for a pool without a VllmQueue"},
    {nullptr, 0, 0, 0, nullptr},
};

PyTypeObject g_hook_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

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
  g_hook_type.tp_name = "prefixcache.engine._native.HashRemovalHook";
  g_hook_type.tp_basicsize = sizeof(HookObject);
  g_hook_type.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_METHOD_DESCRIPTOR |
                         Py_TPFLAGS_HAVE_VECTORCALL;
  g_hook_type.tp_doc =
      "HashRemovalHook(original, fallback): BlockPool._remove_cached_block_hashes for the "
      "vLLM plugin, its work in C for a pool with a VllmQueue (vllm_queue_module.cpp).";
  g_hook_type.tp_new = hook_new;
  g_hook_type.tp_dealloc = hook_dealloc;
  g_hook_type.tp_traverse = hook_traverse;
  g_hook_type.tp_call = PyVectorcall_Call;
  g_hook_type.tp_vectorcall_offset = offsetof(HookObject, vectorcall);
  g_hook_type.tp_descr_get = hook_get;
  g_hook_type.tp_members = g_hook_members;
  if (PyType_Ready(&g_hook_type) < 0) return false;
  g_free_block_queue = PyUnicode_InternFromString("free_block_queue");
  g_ref_cnt = PyUnicode_InternFromString("ref_cnt");
  if (!g_free_block_queue || !g_ref_cnt || !vllm_block::ready()) return false;
  Py_INCREF(&g_queue_type);
  Py_INCREF(&g_hook_type);
  return PyModule_AddObject(module, "VllmQueue", reinterpret_cast<PyObject*>(&g_queue_type)) >= 0 &&
         PyModule_AddObject(module, "HashRemovalHook", reinterpret_cast<PyObject*>(&g_hook_type)) >= 0;
}

}  // namespace prefixcache
