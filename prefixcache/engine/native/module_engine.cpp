// prefixcache.engine._native.Engine: the Python type over one native Engine.
//
// One method per EngineCore operation (prefixcache/engine/core.py): here the type, its life
// cycle, allocation and the checks; partitions, relocation and the clock in
// module_partitions.cpp, prefix reuse in module_prefix.cpp, the fused request path
// (admit_request, hash_tokens) in module_request.cpp. Arguments are parsed and checked by
// binding.h's helpers before the engine runs; results go out as BlockIds buffers, bytes of
// 0/1 flags, ints and lists.

#include <algorithm>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "block_hashing.h"
#include "module_engine.h"
#include "python_policy.h"

namespace prefixcache {
namespace {

// ------------------------------------------------------------------ life cycle

void engine_dealloc(PyObject* py_self) {
  EngineObject* self = self_of(py_self);
  delete self->engine;
  delete self->ids;
  delete self->hashes;
  delete self->tokens;
  delete self->checkpoint;
  Py_TYPE(py_self)->tp_free(py_self);
}

int engine_init(PyObject* py_self, PyObject* args, PyObject* kwargs) {
  CallGuard guard(&self_of(py_self)->busy);  // no re-initialising from inside a call
  if (!guard.admitted()) return -1;
  static const char* keywords[] = {"total_count", "paused_count", "policy", "track_changes",
                                   "block_size", "root_hash", "lowest_first", "page_size",
                                   "policy_options", "policy_object", "policy_hooks", nullptr};
  long long total_count = 0, paused_count = 0, block_size = 16;
  const char* policy = nullptr;
  int track_changes = 0;
  PyObject* root = nullptr;
  int lowest_first = 0;
  long long page_size = 1;
  PyObject* policy_options = nullptr;
  PyObject* policy_object = nullptr;  // a Python policy object (python_policy.h), or None
  PyObject* policy_hooks = nullptr;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "LLsp|LOpLOOO", const_cast<char**>(keywords),
                                   &total_count, &paused_count, &policy, &track_changes,
                                   &block_size, &root, &lowest_first, &page_size,
                                   &policy_options, &policy_object, &policy_hooks)) {
    return -1;
  }
  if (page_size < 1 || page_size > INT32_MAX || (page_size > 1 && !lowest_first)) {
    native_raise(ErrorKind::kInvalidArgument,
                 "page_size must be >= 1, and above 1 only with lowest_first");
    return -1;
  }
  if (total_count < 2 || total_count > INT32_MAX || paused_count < 0 ||
      paused_count > total_count - 2 || block_size < 1 || block_size > INT32_MAX / 4) {
    native_raise(ErrorKind::kInvalidArgument,
                 "total_count must be in [2, 2**31), paused_count in [0, total_count - 2], "
                 "block_size >= 1");
    return -1;
  }
  // ref_zero is a mode (nothing unreferenced is cached), not a policy.
  std::unique_ptr<Policy> built;
  if (policy_object && policy_object != Py_None) {
    built = make_python_policy(policy_object, static_cast<int32_t>(total_count),
                               policy_hooks ? policy_hooks : Py_None);
    if (!built) return -1;
  } else if (std::strcmp(policy, "ref_zero") != 0 &&
      !native_build_policy(policy, static_cast<int32_t>(total_count), policy_options, &built)) {
    return -1;
  }
  uint64_t root_hash = default_root();
  if (root && root != Py_None) {
    root_hash = PyLong_Check(root) ? PyLong_AsUnsignedLongLong(root) : 0;
    if (PyErr_Occurred() || root_hash == 0 || root_hash > kMaxBlockHash) {
      PyErr_Clear();
      native_raise(ErrorKind::kInvalidArgument, "root_hash must be an int in [1, 2**63 - 1]");
      return -1;
    }
  }
  EngineObject* self = self_of(py_self);
  try {
    Engine* engine = new Engine(static_cast<int32_t>(total_count),
                                static_cast<int32_t>(paused_count), std::move(built),
                                track_changes != 0,
                                lowest_first != 0, static_cast<int32_t>(page_size));
    const bool transactional = engine->policy() && engine->policy()->transactional();
    delete self->engine;
    self->engine = engine;
    delete self->checkpoint;
    self->checkpoint = transactional ? new EngineCheckpoint() : nullptr;
    if (!self->ids) self->ids = new std::vector<int32_t>();
    if (!self->hashes) self->hashes = new std::vector<int64_t>();
    if (!self->tokens) self->tokens = new std::vector<int32_t>();
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
    return -1;
  }
  self->block_size = block_size;
  self->root = root_hash;
  ++self->num_inits;  // a native session opened on the engine before refuses to run
  return 0;
}

// ------------------------------------------------------------------ allocation

PyObject* engine_allocate(PyObject* py_self, PyObject* arg) {
  EngineObject* self = self_of(py_self);
  if (!ready(self)) return nullptr;
  int64_t count;
  bool huge;
  if (!native_parse_count(arg, "num_blocks", &count, &huge)) return nullptr;
  Engine& engine = *self->engine;
  if (huge) {  // the input rule: an int is within signed 64 bits (as the facade says)
    return native_raise(ErrorKind::kInvalidArgument,
                        "num_blocks must be an int >= 0 within signed 64 bits");
  }
  const int64_t shortfall = count - engine.num_free();  // pinned chains keep their blocks
  if (shortfall > 0 && shortfall > engine.num_evictable(shortfall)) Py_RETURN_NONE;
  int32_t* data = nullptr;
  PyObject* ids = native_new_block_ids(static_cast<Py_ssize_t>(count), &data);
  if (!ids) return nullptr;
  try {
    PolicyTransaction transaction(self->engine, self->checkpoint);
    engine.allocate(count, data);
    transaction.commit();
  } catch (const EngineError& error) {
    Py_DECREF(ids);
    return native_raise(error.kind, error.message);
  } catch (const std::bad_alloc&) {
    Py_DECREF(ids);
    return PyErr_NoMemory();
  }
  return ids;
}

FASTCALL(engine_release) {
  static const char* const names[] = {"block_ids", "paused"};
  EngineObject* self = self_of(py_self);
  PyObject* bound[2];
  if (!ready(self) || !native_bind_args("release", args, nargs, kwnames, names, 1, 2, bound)) {
    return nullptr;
  }
  bool paused = false;
  if (bound[1] && !native_parse_flag(bound[1], "paused", &paused)) return nullptr;
  if (!native_parse_ids(bound[0], self->engine->num_usable(), *self->ids, "block_ids")) {
    return nullptr;
  }
  GUARD(self->engine->release(self->ids->data(), self->ids->size(), paused);)
  Py_RETURN_NONE;
}

PyObject* engine_release_request(PyObject* py_self, PyObject* arg) {
  EngineObject* self = self_of(py_self);
  if (!ready(self) || !native_parse_ids(arg, self->engine->num_usable(), *self->ids, "block_ids")) {
    return nullptr;
  }
  GUARD(self->engine->release(self->ids->data(), self->ids->size(), false);)
  Py_RETURN_NONE;
}

PyObject* engine_open_group(PyObject* py_self, PyObject*) {
  EngineObject* self = self_of(py_self);
  if (!ready(self)) return nullptr;
  self->engine->open_group();
  Py_RETURN_NONE;
}

PyObject* engine_close_group(PyObject* py_self, PyObject*) {
  EngineObject* self = self_of(py_self);
  if (!ready(self)) return nullptr;
  GUARD(self->engine->close_group();)
  Py_RETURN_NONE;
}

// ------------------------------------------------------------------ collaborators, checks

PyObject* engine_take_changes(PyObject* py_self, PyObject*) {
  EngineObject* self = self_of(py_self);
  if (!ready(self)) return nullptr;
  std::vector<int32_t>& freed = self->engine->freed_blocks();
  std::vector<int64_t>& removed = self->engine->removed_hashes();
  PyObject* freed_ids = native_block_ids(freed.data(), freed.size());
  PyObject* hashes = PyList_New(static_cast<Py_ssize_t>(removed.size()));
  if (!freed_ids || !hashes) {
    Py_XDECREF(freed_ids);
    Py_XDECREF(hashes);
    return nullptr;
  }
  for (size_t i = 0; i < removed.size(); ++i) {
    PyObject* item = PyLong_FromLongLong(removed[i]);
    if (!item) {
      Py_DECREF(freed_ids);
      Py_DECREF(hashes);
      return nullptr;
    }
    PyList_SET_ITEM(hashes, static_cast<Py_ssize_t>(i), item);
  }
  freed.clear();
  removed.clear();
  return Py_BuildValue("(NN)", freed_ids, hashes);
}

PyObject* engine_reset(PyObject* py_self, PyObject*) {
  EngineObject* self = self_of(py_self);
  if (!ready(self)) return nullptr;
  GUARD(self->engine->reset();)
  ++self->layout_epoch;  // every block freed: native sessions look their chains up again
  Py_RETURN_NONE;
}

PyObject* engine_find_problems(PyObject* py_self, PyObject*) {
  EngineObject* self = self_of(py_self);
  if (!ready(self)) return nullptr;
  std::vector<std::string> problems;
  GUARD(problems = self->engine->find_problems();)
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(problems.size()));
  if (!list) return nullptr;
  for (size_t i = 0; i < problems.size(); ++i) {
    PyObject* text = PyUnicode_FromString(problems[i].c_str());
    if (!text) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), text);
  }
  return list;
}

PyObject* engine_free_ids(PyObject* py_self, PyObject*) {
  EngineObject* self = self_of(py_self);
  if (!ready(self)) return nullptr;
  std::vector<int32_t> free;
  self->engine->free_ids(free);
  return native_block_ids(free.data(), free.size());
}

PyObject* engine_counters(PyObject* py_self, PyObject*) {
  EngineObject* self = self_of(py_self);
  if (!ready(self)) return nullptr;
  const Counters& c = self->engine->counters();
  return Py_BuildValue("(LLLLLLL)", static_cast<long long>(c.num_allocated),
                       static_cast<long long>(c.num_released),
                       static_cast<long long>(c.num_queried), static_cast<long long>(c.num_hits),
                       static_cast<long long>(c.num_evicted),
                       static_cast<long long>(c.num_dropped), static_cast<long long>(c.clock));
}

PyObject* engine_memory_bytes(PyObject* py_self, PyObject*) {
  EngineObject* self = self_of(py_self);
  if (!ready(self)) return nullptr;
  return PyLong_FromSize_t(self->engine->memory_bytes());
}

// ------------------------------------------------------------------ properties

#define COUNTER_GETTER(name, expr)                          \
  PyObject* get_##name(PyObject* py_self, void*) {          \
    EngineObject* self = self_of(py_self);                  \
    if (!ready(self)) return nullptr;                       \
    return PyLong_FromLongLong(static_cast<long long>(expr)); \
  }

COUNTER_GETTER(num_free, self->engine->num_free())
COUNTER_GETTER(num_active, self->engine->num_active())
COUNTER_GETTER(num_paused, self->engine->num_paused())
COUNTER_GETTER(num_holding_paused, self->engine->num_holding_paused())
COUNTER_GETTER(num_cached, self->engine->num_cached())
COUNTER_GETTER(num_registered, self->engine->num_registered())
COUNTER_GETTER(clock, self->engine->clock())
COUNTER_GETTER(num_usable, self->engine->num_usable())
COUNTER_GETTER(paused_count, self->engine->paused_count())
COUNTER_GETTER(active_count, self->engine->active_count())
COUNTER_GETTER(group_depth, self->engine->group_depth())
COUNTER_GETTER(block_size, self->block_size)

PyObject* get_retains_unreferenced(PyObject* py_self, void*) {
  EngineObject* self = self_of(py_self);
  if (!ready(self)) return nullptr;
  return PyBool_FromLong(self->engine->retains_unreferenced());
}

PyObject* get_root_hash(PyObject* py_self, void*) {
  return PyLong_FromUnsignedLongLong(self_of(py_self)->root);
}

PyGetSetDef g_getset[] = {
    {"num_free", get_num_free, nullptr, "Blocks on the free stack.", nullptr},
    {"num_active", get_num_active, nullptr, "Blocks with an active reference.", nullptr},
    {"num_paused", get_num_paused, nullptr, "Blocks with paused references only.", nullptr},
    {"num_holding_paused", get_num_holding_paused, nullptr,
     "Blocks holding any paused reference (what the paused budget bounds).", nullptr},
    {"num_cached", get_num_cached, nullptr, "Unreferenced registered blocks.", nullptr},
    {"num_registered", get_num_registered, nullptr, "Blocks carrying a hash.", nullptr},
    {"clock", get_clock, nullptr, "The logical clock.", nullptr},
    {"num_usable", get_num_usable, nullptr, "Usable blocks (the dummy block's ID).", nullptr},
    {"paused_count", get_paused_count, nullptr, "Paused budget.", nullptr},
    {"active_count", get_active_count, nullptr, "Active budget.", nullptr},
    {"group_depth", get_group_depth, nullptr, "Open free groups.", nullptr},
    {"block_size", get_block_size, nullptr, "Tokens per block (fused path).", nullptr},
    {"root_hash", get_root_hash, nullptr, "Chain root of the fused path.", nullptr},
    {"retains_unreferenced", get_retains_unreferenced, nullptr, "False in ref-zero mode.",
     nullptr},
    {"can_pin", engine_get_can_pin, nullptr, "Whether a session may pin its chain.", nullptr},
    {"pin_bound", engine_get_pin_bound, nullptr, "Pinned chains' ancestors (a bound).", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

#define FAST(fn) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn))
// Every method runs behind the engine's CallGuard (binding.h): no re-entry.
#define ENTER(fn) guarded<EngineObject, fn>
#define ENTER_FAST(fn) FAST((guarded_fast<EngineObject, fn>))

PyMethodDef g_methods[] = {
    {"allocate", ENTER(engine_allocate), METH_O, "allocate(num_blocks) -> BlockIds | None"},
    {"set_retention", ENTER(engine_set_retention), METH_VARARGS,
     "set_retention(block_hash, priority, expires_at=None): forwarded to the policy"},
    {"has_retention", ENTER(engine_has_retention), METH_NOARGS,
     "has_retention() -> bool: whether the policy keeps retention priorities"},
    {"release", ENTER_FAST(engine_release), METH_FASTCALL | METH_KEYWORDS,
     "release(block_ids, paused=False)"},
    {"release_request", ENTER(engine_release_request), METH_O,
     "release_request(block_ids)"},
    {"open_group", ENTER(engine_open_group), METH_NOARGS, "open_group()"},
    {"close_group", ENTER(engine_close_group), METH_NOARGS, "close_group()"},
    {"lookup", ENTER(engine_lookup), METH_O, "lookup(block_hashes) -> BlockIds"},
    {"take_hit", ENTER_FAST(engine_take_hit), METH_FASTCALL | METH_KEYWORDS,
     "take_hit(block_ids, num_queried, acquire)"},
    {"acquire", ENTER(engine_acquire), METH_O, "acquire(block_ids)"},
    {"pin_chain", ENTER_FAST(engine_pin_chain), METH_FASTCALL | METH_KEYWORDS,
     "pin_chain(tail, chain_length, num_queried): take_hit on a chain, referencing only its "
     "tail"},
    {"release_pinned", ENTER_FAST(engine_release_pinned), METH_FASTCALL | METH_KEYWORDS,
     "release_pinned(block_ids, chain_length): release block_ids and the pin on block_ids[0]"},
    {"reclaimable", ENTER(engine_reclaimable), METH_O,
     "reclaimable(block_ids) -> free + cached less cached block_ids and pinned chains"},
    {"num_evictable", ENTER(engine_num_evictable), METH_O,
     "num_evictable(num_blocks) -> num_blocks less what pinned chains keep"},
    {"pinned_tails", ENTER(engine_pinned_tails), METH_NOARGS,
     "pinned_tails() -> [(tail, pins)] by ID"},
    {"register", ENTER_FAST(engine_register), METH_FASTCALL | METH_KEYWORDS,
     "register(block_ids, block_hashes, parent_hash=None) -> (holds, new) as bytes of 0/1"},
    {"block_of", ENTER(engine_block_of), METH_O, "block_of(block_hash) -> int | None"},
    {"hash_of", ENTER(engine_hash_of), METH_O, "hash_of(block_id) -> int | None"},
    {"registrations", ENTER(engine_registrations), METH_O,
     "registrations(block_ids) -> bytes of int64 generations (0: unregistered)"},
    {"registered_chains", ENTER(engine_registered_chains), METH_NOARGS,
     "registered_chains() -> [(hash, parent hash or None)], parents first"},
    {"admit_request", ENTER_FAST(engine_admit_request), METH_FASTCALL | METH_KEYWORDS,
     "admit_request(tokens, out_row) -> number of blocks served from cache"},
    {"hash_tokens", ENTER_FAST(engine_hash_tokens), METH_FASTCALL | METH_KEYWORDS,
     "hash_tokens(tokens, parent=None) -> list of block hashes (from the root, or parent)"},
    {"move", ENTER_FAST(engine_move), METH_FASTCALL | METH_KEYWORDS,
     "move(block_ids, to_paused)"},
    {"touch", ENTER(engine_touch), METH_O, "touch(block_ids)"},
    {"relocate", ENTER_FAST(engine_relocate), METH_FASTCALL | METH_KEYWORDS,
     "relocate(sources, destinations, check_only=False): move each source's state to its "
     "free destination (check_only: only refuse what relocate would)"},
    {"evict", ENTER(engine_evict), METH_O, "evict(num_blocks) -> number freed"},
    {"evict_blocks", ENTER(engine_evict_blocks), METH_O,
     "evict_blocks(block_ids) -> number of cached leaves freed, tail-first"},
    {"advance_clock", ENTER(engine_advance_clock), METH_O, "advance_clock(ticks) -> clock"},
    {"reference_counts", ENTER(engine_reference_counts), METH_O,
     "reference_counts(block_ids) -> (active, paused)"},
    {"describe_state", ENTER(engine_describe_state), METH_O,
     "describe_state(block_id) -> str"},
    {"take_changes", ENTER(engine_take_changes), METH_NOARGS,
     "take_changes() -> (freed BlockIds, removed hashes)"},
    {"reset", ENTER(engine_reset), METH_NOARGS, "reset()"},
    {"find_problems", ENTER(engine_find_problems), METH_NOARGS,
     "find_problems() -> [str]"},
    {"free_ids", ENTER(engine_free_ids), METH_NOARGS,
     "free_ids() -> BlockIds, bottom of the stack first (lowest-first mode: descending)"},
    {"counters", ENTER(engine_counters), METH_NOARGS,
     "counters() -> (allocated, released, queried, hits, evicted, dropped, clock)"},
    {"memory_bytes", ENTER(engine_memory_bytes), METH_NOARGS,
     "memory_bytes() -> host bytes held"},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject g_engine_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

}  // namespace

PyTypeObject* native_engine_type() { return &g_engine_type; }

bool add_engine_type(PyObject* module) {
  g_engine_type.tp_name = "prefixcache.engine._native.Engine";
  g_engine_type.tp_basicsize = sizeof(EngineObject);
  g_engine_type.tp_flags = Py_TPFLAGS_DEFAULT;
  g_engine_type.tp_doc =
      "Engine(total_count, paused_count, policy, track_changes, block_size=16, root_hash=None, "
      "lowest_first=False, page_size=1)";
  g_engine_type.tp_new = PyType_GenericNew;
  g_engine_type.tp_init = engine_init;
  g_engine_type.tp_dealloc = engine_dealloc;
  g_engine_type.tp_methods = g_methods;
  g_engine_type.tp_getset = g_getset;
  if (PyType_Ready(&g_engine_type) < 0) return false;
  Py_INCREF(&g_engine_type);
  if (PyModule_AddObject(module, "Engine", reinterpret_cast<PyObject*>(&g_engine_type)) < 0) {
    Py_DECREF(&g_engine_type);
    return false;
  }
  return true;
}

}  // namespace prefixcache
