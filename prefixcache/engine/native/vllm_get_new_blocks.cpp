// BlockPool.get_new_blocks for a pool with the native queue: vLLM 0.33's steps in C.
//
// vLLM's get_new_blocks (vllm/v1/core/block_pool.py) takes n blocks from the free queue,
// then per block calls _maybe_evict_cached_block (metrics, _remove_cached_block_hashes,
// _emit_block_removed_events when hashes went) and sets ref_cnt from 0 to 1. With the plugin
// each of those blocks also went through the remove-hashes hook: two Python-level calls a
// block around one native check. Here, for vLLM's own BlockPool with caching on, no metrics
// collector and no reuse watchers (the serving path), the queue's popleft_n runs, then per
// block vLLM's own _remove_cached_block_hashes (the function the hook wraps), the hook's work
// (after_hashes_removed), the removed-events call only when vLLM would emit any, and the
// ref_cnt assertion and increment: the same calls to vLLM's code, in the same order, with
// the same results. Any other pool (one whose own attributes shadow one of those methods
// too), or a count out of range, runs vLLM's get_new_blocks.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <initializer_list>
#include <new>

#include "vllm_queue.h"

namespace prefixcache {
namespace {

PyObject* g_remove_hashes = nullptr;  // interned attribute names
PyObject* g_maybe_evict = nullptr;
PyObject* g_emit_removed = nullptr;
PyObject* g_enable_caching = nullptr;
PyObject* g_enable_events = nullptr;
PyObject* g_metrics_collector = nullptr;
PyObject* g_reuse_watchers = nullptr;
PyTypeObject* g_plain_type = nullptr;  // the last type found to be vLLM's BlockPool (a ref)
PyObject* g_plain_original = nullptr;  // and its get_new_blocks (a ref)

/// Whether ``function`` is a Python function whose code reads every name of ``names``.
bool reads_names(PyObject* function, std::initializer_list<const char*> names) {
  if (!function || !PyFunction_Check(function)) return false;
  PyObject* read = reinterpret_cast<PyCodeObject*>(PyFunction_GET_CODE(function))->co_names;
  for (const char* name : names) {
    PyObject* text = PyUnicode_InternFromString(name);
    const int found = text ? PySequence_Contains(read, text) : -1;
    Py_XDECREF(text);
    if (found != 1) {
      PyErr_Clear();
      return false;
    }
  }
  return true;
}

/// Whether ``type`` is vLLM 0.33's BlockPool and ``original`` its get_new_blocks: both
/// methods read what vLLM's read (a stand-in, such as prefixcache.testing.fake_vllm's, or
/// a subclass's override runs ``original``). The last verdict found true is kept.
bool vllm_pool_type(PyTypeObject* type, PyObject* original) {
  if (type == g_plain_type && original == g_plain_original) return true;
  PyObject* evict = PyDict_GetItemWithError(type->tp_dict, g_maybe_evict);  // borrowed
  if (!evict) {
    PyErr_Clear();
    return false;
  }
  if (!reads_names(original, {"popleft_n", "_reuse_watchers", "enable_caching",
                              "_maybe_evict_cached_block", "metrics_collector", "ref_cnt"}) ||
      !reads_names(evict, {"metrics_collector", "_remove_cached_block_hashes",
                           "_emit_block_removed_events"})) {
    return false;
  }
  Py_INCREF(type);
  Py_XSETREF(g_plain_type, type);
  Py_INCREF(original);
  Py_XSETREF(g_plain_original, original);
  return true;
}

/// Whether ``pool``'s own attributes shadow a method get_new_blocks calls (a test or a tool
/// that wraps one per pool): then vLLM's get_new_blocks runs, calling the override. Asked
/// through attribute lookup (a bound method of the type's function, or not), never through
/// ``_PyObject_GetDictPtr``: on Python 3.11 that builds the instance's ``__dict__`` from its
/// inline values, and a pool with a built dict reads each ``self.<attribute>`` of vLLM's
/// methods more slowly for the rest of its life (about 4% of vLLM's own time per request).
bool shadowed(PyObject* pool) {
  for (PyObject* name : {g_maybe_evict, g_remove_hashes, g_emit_removed}) {
    PyObject* own = _PyType_Lookup(Py_TYPE(pool), name);  // borrowed
    PyObject* found = PyObject_GetAttr(pool, name);
    const bool bound = found && PyMethod_Check(found) && PyMethod_GET_SELF(found) == pool &&
                       own && PyMethod_GET_FUNCTION(found) == own;
    Py_XDECREF(found);
    if (!bound) {
      PyErr_Clear();
      return true;
    }
  }
  return false;
}

/// ``pool.<name>`` is truthy; -1 with an error set.
int truthy(PyObject* pool, PyObject* name) {
  PyObject* value = PyObject_GetAttr(pool, name);
  if (!value) return -1;
  const int truth = PyObject_IsTrue(value);
  Py_DECREF(value);
  return truth;
}

/// One handed-out block: vLLM's _maybe_evict_cached_block (metrics collector absent), then
/// ``assert block.ref_cnt == 0; block.ref_cnt += 1``.
bool hand_out(PyObject* pool, PyObject* block, PyObject* remover, bool events,
              VllmQueueCore* core) {
  PyObject* call[2] = {pool, block};
  PyObject* removed = PyObject_Vectorcall(remover, call, 2, nullptr);
  if (!removed) return false;
  bool ok = after_hashes_removed(core, block, removed);
  if (ok && events) {
    const int truth = PyObject_IsTrue(removed);
    PyObject* emitted =
        truth > 0 ? PyObject_CallMethodOneArg(pool, g_emit_removed, removed) : nullptr;
    ok = truth == 0 || emitted;
    Py_XDECREF(emitted);
  }
  Py_DECREF(removed);
  if (!ok) return false;
  long long held;
  if (!vllm_block::ref_cnt(block, &held)) return false;
  if (held != 0) {
    PyErr_SetNone(PyExc_AssertionError);  // vLLM's ``assert block.ref_cnt == 0``
    return false;
  }
  return vllm_block::set_ref_cnt(block, 1);
}

}  // namespace

bool get_new_blocks_ready() {
  return vllm_block::intern_names({{&g_remove_hashes, "_remove_cached_block_hashes"},
                                   {&g_maybe_evict, "_maybe_evict_cached_block"},
                                   {&g_emit_removed, "_emit_block_removed_events"},
                                   {&g_enable_caching, "enable_caching"},
                                   {&g_enable_events, "enable_kv_cache_events"},
                                   {&g_metrics_collector, "metrics_collector"},
                                   {&g_reuse_watchers, "_reuse_watchers"}});
}

PyObject* vllm_get_new_blocks(PyObject* original, PyObject* const* args, VllmQueueCore* core) {
  PyObject* pool = args[0];
  PyTypeObject* type = Py_TYPE(pool);
  // A strong reference: the loop below runs vLLM's Python code, which could replace the
  // hook in the type's dict (uninstall) and so free the function it holds.
  PyObject* remover = vllm_pool_type(type, original) && !shadowed(pool)
                          ? Py_XNewRef(hooked_remover(type, g_remove_hashes))
                          : nullptr;
  const long long n = remover && PyLong_CheckExact(args[1]) ? PyLong_AsLongLong(args[1]) : -1;
  if (n == -1 && PyErr_Occurred()) PyErr_Clear();
  int caching = 0, collector = 1, watchers = 1, events = 0;
  if (n >= 0 && n <= core->num_free()) {
    caching = truthy(pool, g_enable_caching);
    collector = caching > 0 ? truthy(pool, g_metrics_collector) : 1;
    watchers = collector == 0 ? truthy(pool, g_reuse_watchers) : 1;
    events = watchers == 0 ? truthy(pool, g_enable_events) : 0;
    if (caching < 0 || collector < 0 || watchers < 0 || events < 0) {
      PyErr_Clear();  // an attribute vLLM's pool has is missing: vLLM's function says what
      caching = 0;
    }
  }
  if (caching <= 0 || collector != 0 || watchers != 0) {
    Py_XDECREF(remover);
    return PyObject_Vectorcall(original, args, 2, nullptr);
  }
  PyObject* taken = nullptr;
  bool ok;
  try {
    ok = core->popleft_n(n, &taken);
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
    ok = false;
  }
  // ``taken`` is this function's own list until returned: its items stay alive.
  for (Py_ssize_t i = 0; ok && i < PyList_GET_SIZE(taken); ++i) {
    try {
      ok = hand_out(pool, PyList_GET_ITEM(taken, i), remover, events > 0, core);
    } catch (const std::bad_alloc&) {
      PyErr_NoMemory();
      ok = false;
    }
  }
  Py_DECREF(remover);
  if (!ok) Py_CLEAR(taken);
  return taken;
}

}  // namespace prefixcache
