// prefixcache.engine._native.BlockPoolHook: the vLLM plugin's wrappers of BlockPool methods.
//
// The plugin wraps three BlockPool methods that vLLM calls on its serving path to learn what
// the free-block queue cannot see (integrations/vllm.py): ``touch`` (a request's prefix hit:
// the use counts, and the free blocks it took back count as the policy's hits),
// ``cache_full_blocks`` (newly cached blocks: parents, depths, on_register) and
// ``_remove_cached_block_hashes`` (called per block get_new_blocks hands out: a known block
// forgets its hash; a victim held by nobody counts as one eviction). A hook calls vLLM's
// function, then, for a pool whose queue is a ``_native.VllmQueue``, does the wrapper's work
// in C: one C call per vLLM call, the counts kept in the queue until the metrics take them
// (``take_counts``). Any other pool, or an unexpected call shape, gets the Python wrapper.
// A fourth hook, ``get_new_blocks``, runs vLLM 0.33's get_new_blocks in C for such a pool
// (get_new_blocks.cpp's comment: vLLM's steps, its own _remove_cached_block_hashes called
// per block, no Python frame of vLLM's _maybe_evict_cached_block or of a hook per block).
// A method descriptor with vectorcall: calling it costs no Python frame of its own.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <cstddef>
#include <cstring>
#include <new>

#include "binding.h"
#include "vllm_queue.h"

namespace prefixcache {
namespace {

enum class Method : int { kRemoveHashes, kTouch, kCacheFullBlocks, kGetNewBlocks };

struct HookObject {
  PyObject_HEAD
  PyObject* original;  // vLLM's function
  PyObject* fallback;  // the Python wrapper, for pools without a VllmQueue
  vectorcallfunc vectorcall;
  Method method;
};

PyObject* g_free_block_queue = nullptr;

/// Whether nothing holds ``block`` (its ref_cnt is 0).
bool unheld(PyObject* block, bool* out) {
  long long held;
  if (!vllm_block::ref_cnt(block, &held)) return false;
  *out = held == 0;
  return true;
}

/// Runs ``body`` (bool, may throw bad_alloc); false with an error set.
template <typename Body>
bool guarded_call(Body body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
    return false;
  }
}

}  // namespace

bool after_hashes_removed(VllmQueueCore* core, PyObject* block, PyObject* removed) {
  long long id;
  if (!vllm_block::raw_id(block, &id)) return false;
  if (core->knows(id)) return guarded_call([&] { return core->note_hash_removed(block); });
  const int truth = PyObject_IsTrue(removed);
  bool free = false;
  if (truth < 0 || (truth && !unheld(block, &free))) return false;
  if (truth && free) core->count_eviction();  // a victim popleft_n handed out
  return true;
}

namespace {

/// _remove_cached_block_hashes(pool, block): vLLM's, then forget or count the block.
PyObject* remove_hashes(HookObject* hook, PyObject* const* args, VllmQueueCore* core) {
  PyObject* removed = PyObject_Vectorcall(hook->original, args, 2, nullptr);
  if (removed && !after_hashes_removed(core, args[1], removed)) Py_CLEAR(removed);
  return removed;
}

/// touch(pool, blocks): vLLM's, then the use counts; the free blocks it took are hits.
PyObject* touch(HookObject* hook, PyObject* const* args, VllmQueueCore* core) {
  PyObject* blocks = args[1];
  PyObject* owned = nullptr;  // an iterator is read twice: listed once, as the wrapper does
  if (!PyList_Check(blocks) && !PyTuple_Check(blocks)) {
    owned = blocks = PySequence_List(blocks);
    if (!owned) return nullptr;
  }
  PyObject* call[2] = {args[0], blocks};
  const int64_t free_before = core->num_free();
  PyObject* result = PyObject_Vectorcall(hook->original, call, 2, nullptr);
  if (result && !guarded_call([&] { return core->note_hits(blocks); })) Py_CLEAR(result);
  if (result) core->count_hits(free_before - core->num_free());
  Py_XDECREF(owned);
  return result;
}

/// cache_full_blocks(pool, request, blocks, num_cached, num_full, ...): vLLM's, then
/// blocks[num_cached:num_full] registered.
PyObject* cache_full_blocks(HookObject* hook, PyObject* const* args, size_t nargsf,
                            PyObject* kwnames, VllmQueueCore* core) {
  PyObject* result = PyObject_Vectorcall(hook->original, args, nargsf, kwnames);
  if (!result) return nullptr;
  const Py_ssize_t start = PyNumber_AsSsize_t(args[3], PyExc_OverflowError);
  const Py_ssize_t stop = start == -1 && PyErr_Occurred()
                              ? -1
                              : PyNumber_AsSsize_t(args[4], PyExc_OverflowError);
  PyObject* seq = PyErr_Occurred() ? nullptr : PySequence_Fast(args[2], "blocks must be a sequence");
  const bool ok = seq && guarded_call([&] { return core->note_registered(seq, start, stop); });
  Py_XDECREF(seq);
  if (!ok) Py_CLEAR(result);
  return result;
}

PyObject* hook_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* hook = reinterpret_cast<HookObject*>(self);
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  const bool fits = hook->method == Method::kCacheFullBlocks ? nargs >= 5 : nargs == 2 && !kwnames;
  if (!fits) return PyObject_Vectorcall(hook->fallback, args, nargsf, kwnames);
  PyObject* queue = PyObject_GetAttr(args[0], g_free_block_queue);
  if (!queue) return nullptr;
  VllmQueueCore* core = vllm_queue_core(queue);
  PyObject* result;
  if (!core) {  // get_new_blocks has no wrapper: vLLM's own
    PyObject* other = hook->method == Method::kGetNewBlocks ? hook->original : hook->fallback;
    result = PyObject_Vectorcall(other, args, nargsf, kwnames);
  } else if (hook->method == Method::kRemoveHashes) {
    result = remove_hashes(hook, args, core);
  } else if (hook->method == Method::kTouch) {
    result = touch(hook, args, core);
  } else if (hook->method == Method::kGetNewBlocks) {
    result = vllm_get_new_blocks(hook->original, args, core);
  } else {
    result = cache_full_blocks(hook, args, nargsf, kwnames, core);
  }
  Py_DECREF(queue);  // held while vLLM's function ran: the core outlives the call
  return result;
}

PyObject* hook_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  const char* name;
  PyObject *original, *fallback;
  static const char* names[] = {"method", "original", "fallback", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sOO", const_cast<char**>(names), &name,
                                   &original, &fallback)) {
    return nullptr;
  }
  Method method;
  if (std::strcmp(name, "_remove_cached_block_hashes") == 0) {
    method = Method::kRemoveHashes;
  } else if (std::strcmp(name, "touch") == 0) {
    method = Method::kTouch;
  } else if (std::strcmp(name, "cache_full_blocks") == 0) {
    method = Method::kCacheFullBlocks;
  } else if (std::strcmp(name, "get_new_blocks") == 0) {
    method = Method::kGetNewBlocks;
  } else {
    return native_raise(ErrorKind::kInvalidArgument,
                        std::string("BlockPoolHook has no method ") + name);
  }
  auto* hook = reinterpret_cast<HookObject*>(type->tp_alloc(type, 0));
  if (!hook) return nullptr;
  hook->original = Py_NewRef(original);
  hook->fallback = Py_NewRef(fallback);
  hook->vectorcall = hook_call;
  hook->method = method;
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

PyObject* hooked_remover(PyTypeObject* type, PyObject* name) {
  PyObject* found = _PyType_Lookup(type, name);  // borrowed
  if (!found || Py_TYPE(found) != &g_hook_type) return nullptr;
  auto* hook = reinterpret_cast<HookObject*>(found);
  return hook->method == Method::kRemoveHashes ? hook->original : nullptr;
}

bool add_vllm_hook_type(PyObject* module) {
  g_hook_type.tp_name = "prefixcache.engine._native.BlockPoolHook";
  g_hook_type.tp_basicsize = sizeof(HookObject);
  g_hook_type.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_METHOD_DESCRIPTOR |
                         Py_TPFLAGS_HAVE_VECTORCALL;
  g_hook_type.tp_doc =
      "BlockPoolHook(method, original, fallback): BlockPool.<method> (touch, "
      "cache_full_blocks, _remove_cached_block_hashes or get_new_blocks) for the vLLM plugin, "
      "its work in C for a pool with a VllmQueue (vllm_queue_hooks.cpp).";
  g_hook_type.tp_new = hook_new;
  g_hook_type.tp_dealloc = hook_dealloc;
  g_hook_type.tp_traverse = hook_traverse;
  g_hook_type.tp_call = PyVectorcall_Call;
  g_hook_type.tp_vectorcall_offset = offsetof(HookObject, vectorcall);
  g_hook_type.tp_descr_get = hook_get;
  g_hook_type.tp_members = g_hook_members;
  if (PyType_Ready(&g_hook_type) < 0) return false;
  g_free_block_queue = PyUnicode_InternFromString("free_block_queue");
  if (!g_free_block_queue || !vllm_block::ready() || !get_new_blocks_ready()) {
    return false;
  }
  Py_INCREF(&g_hook_type);
  return PyModule_AddObject(module, "BlockPoolHook", reinterpret_cast<PyObject*>(&g_hook_type)) >= 0;
}

}  // namespace prefixcache
