// prefixcache.engine._native.NativePolicy: one native policy object on its own.
//
// The binding of policy.h for tests and tools: the same methods as a Python
// EvictionPolicy (insert, discard, touch, evict, evicts_first, on_register,
// on_hit, on_end, set_retention, relocate, clear, len, in, copy), so tests/native/test_native_policies.py
// can drive a native policy and its Python class with the same calls. Calls are
// checked here (a policy assumes valid calls): a block ID outside [0, num_blocks)
// raises InvalidBlockIdError, inserting a tracked block BlockStateError, and
// discarding, touching or relocating an untracked one KeyError, as the Python
// classes do. Not on any hot path: the engine calls policies directly.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "binding.h"
#include "policy.h"

namespace prefixcache {
namespace {

struct PolicyObject {
  PyObject_HEAD
  Policy* policy;
  int32_t num_blocks;
  bool busy;  // a call is running (CallGuard)
};

PyObject* g_config_error = nullptr;

Policy& policy_of(PyObject* self) { return *reinterpret_cast<PolicyObject*>(self)->policy; }

bool check_id(PyObject* self, long long block_id) {
  const int32_t num_blocks = reinterpret_cast<PolicyObject*>(self)->num_blocks;
  if (block_id < 0 || block_id >= num_blocks) {
    native_raise(ErrorKind::kInvalidBlockId, "block " + std::to_string(block_id) +
                                                 " is outside [0, " +
                                                 std::to_string(num_blocks) + ")");
    return false;
  }
  return true;
}

bool check_tracked(PyObject* self, long long block_id, bool tracked) {
  if (!check_id(self, block_id)) return false;
  if (policy_of(self).contains(static_cast<int32_t>(block_id)) == tracked) return true;
  if (tracked) {
    PyObject* key = PyLong_FromLongLong(block_id);
    if (key) PyErr_SetObject(PyExc_KeyError, key);
    Py_XDECREF(key);
  } else {
    native_raise(ErrorKind::kBlockState, "block " + std::to_string(block_id) + " is tracked");
  }
  return false;
}

#define POLICY_GUARD(...)                    \
  try {                                      \
    __VA_ARGS__                              \
  } catch (const std::bad_alloc&) {          \
    return PyErr_NoMemory();                 \
  }

int policy_init(PyObject* self, PyObject* args, PyObject* kwargs) {
  CallGuard guard(&reinterpret_cast<PolicyObject*>(self)->busy);  // no re-init inside a call
  if (!guard.admitted()) return -1;
  static const char* names[] = {"name", "num_blocks", "options", nullptr};
  const char* name = nullptr;
  int num_blocks = 0;
  PyObject* options = nullptr;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "si|O", const_cast<char**>(names), &name,
                                   &num_blocks, &options)) {
    return -1;
  }
  if (num_blocks < 1) {
    PyErr_Format(g_config_error, "num_blocks must be >= 1, got %d", num_blocks);
    return -1;
  }
  std::unique_ptr<Policy> policy;
  if (!native_build_policy(name, num_blocks, options, &policy)) return -1;
  auto* object = reinterpret_cast<PolicyObject*>(self);
  delete object->policy;
  object->policy = policy.release();
  object->num_blocks = num_blocks;
  return 0;
}

void policy_dealloc(PyObject* self) {
  delete reinterpret_cast<PolicyObject*>(self)->policy;
  Py_TYPE(self)->tp_free(self);
}

bool ready(PyObject* self) {
  if (reinterpret_cast<PolicyObject*>(self)->policy) return true;
  PyErr_SetString(PyExc_RuntimeError, "NativePolicy.__init__ was not called");
  return false;
}

bool parse_leaf(PyObject* args, const char* format, long long* block_id, LeafInfo* leaf,
                long long* other = nullptr) {
  long long ids[2] = {0, 0};
  long long values[4];
  const bool two = other != nullptr;
  const bool ok = two ? PyArg_ParseTuple(args, format, &ids[0], &ids[1], &values[0], &values[1],
                                         &values[2], &values[3])
                      : PyArg_ParseTuple(args, format, &ids[0], &values[0], &values[1],
                                         &values[2], &values[3]);
  if (!ok) return false;
  *block_id = ids[0];
  if (two) *other = ids[1];
  *leaf = LeafInfo{values[0], values[1], values[2], values[3]};
  return true;
}

PyObject* policy_insert(PyObject* self, PyObject* args) {
  long long block_id;
  LeafInfo leaf;
  if (!ready(self) || !parse_leaf(args, "LLLLL", &block_id, &leaf)) return nullptr;
  if (!check_tracked(self, block_id, false)) return nullptr;
  POLICY_GUARD(policy_of(self).insert(static_cast<int32_t>(block_id), leaf);)
  Py_RETURN_NONE;
}

PyObject* policy_discard(PyObject* self, PyObject* arg) {
  const long long block_id = PyLong_AsLongLong(arg);
  if (!ready(self) || (block_id == -1 && PyErr_Occurred())) return nullptr;
  if (!check_tracked(self, block_id, true)) return nullptr;
  POLICY_GUARD(policy_of(self).discard(static_cast<int32_t>(block_id));)
  Py_RETURN_NONE;
}

PyObject* policy_touch(PyObject* self, PyObject* args) {
  long long block_id, now;
  if (!ready(self) || !PyArg_ParseTuple(args, "LL", &block_id, &now)) return nullptr;
  if (!check_tracked(self, block_id, true)) return nullptr;
  POLICY_GUARD(policy_of(self).touch(static_cast<int32_t>(block_id), now);)
  Py_RETURN_NONE;
}

PyObject* policy_evict(PyObject* self, PyObject* arg) {
  const long long count = PyLong_AsLongLong(arg);
  if (!ready(self) || (count == -1 && PyErr_Occurred())) return nullptr;
  PyObject* victims = PyList_New(0);
  if (!victims) return nullptr;
  try {
    for (long long i = 0; i < count; ++i) {
      const int32_t block_id = policy_of(self).evict_one();
      if (block_id == kNoBlock) break;
      PyObject* item = PyLong_FromLong(block_id);
      if (!item || PyList_Append(victims, item) < 0) {
        Py_XDECREF(item);
        Py_DECREF(victims);
        return nullptr;
      }
      Py_DECREF(item);
    }
  } catch (const std::bad_alloc&) {
    Py_DECREF(victims);
    return PyErr_NoMemory();
  }
  return victims;
}

PyObject* policy_evicts_first(PyObject* self, PyObject* args) {
  long long block_id;
  LeafInfo leaf;
  if (!ready(self) || !parse_leaf(args, "LLLLL", &block_id, &leaf)) return nullptr;
  if (!check_tracked(self, block_id, false)) return nullptr;
  POLICY_GUARD(return PyBool_FromLong(policy_of(self).evicts_first(
                   static_cast<int32_t>(block_id), leaf));)
}

PyObject* policy_relocate(PyObject* self, PyObject* args) {
  long long old_id, new_id;
  LeafInfo leaf;
  if (!ready(self) || !parse_leaf(args, "LLLLLL", &old_id, &leaf, &new_id)) return nullptr;
  if (!check_tracked(self, old_id, true) || !check_tracked(self, new_id, false)) return nullptr;
  POLICY_GUARD(policy_of(self).relocate(static_cast<int32_t>(old_id),
                                        static_cast<int32_t>(new_id), leaf);)
  Py_RETURN_NONE;
}

PyObject* policy_on_register(PyObject* self, PyObject* args) {
  PyObject* hashes;
  long long first_depth;
  if (!ready(self) || !PyArg_ParseTuple(args, "OL", &hashes, &first_depth)) return nullptr;
  std::vector<int64_t> parsed;
  if (!native_parse_hashes(hashes, parsed, "block_hashes", false)) return nullptr;
  POLICY_GUARD(policy_of(self).on_register(parsed.data(), parsed.size(), first_depth);)
  Py_RETURN_NONE;
}

PyObject* policy_on_hit(PyObject* self, PyObject* arg) {
  if (!ready(self)) return nullptr;
  std::vector<int64_t> parsed;
  if (!native_parse_hashes(arg, parsed, "block_hashes", false)) return nullptr;
  POLICY_GUARD(policy_of(self).on_hit(parsed.data(), parsed.size());)
  Py_RETURN_NONE;
}

PyObject* policy_on_end(PyObject* self, PyObject* arg) {
  if (!ready(self)) return nullptr;
  std::vector<int64_t> parsed;
  if (!native_parse_hashes(arg, parsed, "block_hashes", false)) return nullptr;
  POLICY_GUARD(policy_of(self).on_end(parsed.data(), parsed.size());)
  Py_RETURN_NONE;
}

PyObject* policy_set_retention(PyObject* self, PyObject* args) {
  long long block_hash, priority;
  PyObject* expires = Py_None;
  if (!ready(self) || !PyArg_ParseTuple(args, "LL|O", &block_hash, &priority, &expires)) {
    return nullptr;
  }
  if (!policy_of(self).has_retention()) {
    PyErr_SetString(PyExc_NotImplementedError, "this native policy has no retention priorities");
    return nullptr;
  }
  long long expires_at = kNoExpiry;
  if (expires != Py_None) {
    expires_at = PyLong_AsLongLong(expires);
    if (expires_at == -1 && PyErr_Occurred()) return nullptr;
  }
  POLICY_GUARD(policy_of(self).set_retention(block_hash, priority, expires_at);)
  Py_RETURN_NONE;
}

PyObject* policy_clear(PyObject* self, PyObject*) {
  if (!ready(self)) return nullptr;
  policy_of(self).clear();
  Py_RETURN_NONE;
}

PyObject* policy_memory_bytes(PyObject* self, PyObject*) {
  if (!ready(self)) return nullptr;
  return PyLong_FromSize_t(policy_of(self).memory_bytes());
}

Py_ssize_t policy_length(PyObject* self) {
  if (!ready(self)) return -1;
  return static_cast<Py_ssize_t>(policy_of(self).size());
}

int policy_contains(PyObject* self, PyObject* key) {
  if (!ready(self)) return -1;
  if (!PyLong_Check(key) || PyBool_Check(key)) return 0;
  int overflow = 0;
  const long long block_id = PyLong_AsLongLongAndOverflow(key, &overflow);
  if (block_id == -1 && PyErr_Occurred()) return -1;
  const int32_t num_blocks = reinterpret_cast<PolicyObject*>(self)->num_blocks;
  if (overflow || block_id < 0 || block_id >= num_blocks) return 0;
  return policy_of(self).contains(static_cast<int32_t>(block_id)) ? 1 : 0;
}

// copy.copy / copy.deepcopy: a new NativePolicy with a clone of the whole policy state
// (the vLLM plugin replays the hand-out order on a copy). Both copies are deep: a native
// policy holds no Python objects, so there is nothing a shallow copy could share.
PyObject* policy_copy(PyObject* self, PyObject*) {
  if (!ready(self)) return nullptr;
  std::unique_ptr<Policy> copy;
  POLICY_GUARD(copy = policy_of(self).clone();)
  PyObject* result = Py_TYPE(self)->tp_alloc(Py_TYPE(self), 0);
  if (!result) return nullptr;
  auto* object = reinterpret_cast<PolicyObject*>(result);
  object->policy = copy.release();
  object->num_blocks = reinterpret_cast<PolicyObject*>(self)->num_blocks;
  object->busy = false;
  return result;
}

PyObject* module_policy_names(PyObject*, PyObject*) {
  const std::vector<std::string> names = native_policy_names();
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(names.size()));
  if (!list) return nullptr;
  for (size_t i = 0; i < names.size(); ++i) {
    PyObject* item = PyUnicode_FromString(names[i].c_str());
    if (!item) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
  }
  return list;
}

// Every method runs behind the policy's CallGuard (binding.h): no re-entry.
#define ENTER(fn) guarded<PolicyObject, fn>

PyMethodDef g_policy_methods[] = {
    {"insert", ENTER(policy_insert), METH_VARARGS,
     "insert(block_id, block_hash, last_access, num_accesses, depth)"},
    {"discard", ENTER(policy_discard), METH_O, "discard(block_id); KeyError if untracked"},
    {"touch", ENTER(policy_touch), METH_VARARGS, "touch(block_id, now); KeyError if untracked"},
    {"evict", ENTER(policy_evict), METH_O, "evict(n) -> list: up to n victims, one evict(1) each"},
    {"evicts_first", ENTER(policy_evicts_first), METH_VARARGS,
     "evicts_first(block_id, block_hash, last_access, num_accesses, depth) -> bool"},
    {"relocate", ENTER(policy_relocate), METH_VARARGS,
     "relocate(old_id, new_id, block_hash, last_access, num_accesses, depth)"},
    {"on_register", ENTER(policy_on_register), METH_VARARGS,
     "on_register(block_hashes, first_depth)"},
    {"on_hit", ENTER(policy_on_hit), METH_O, "on_hit(block_hashes): a hit on that prefix"},
    {"on_end", ENTER(policy_on_end), METH_O, "on_end(block_hashes): freed by an end"},
    {"set_retention", ENTER(policy_set_retention), METH_VARARGS,
     "set_retention(block_hash, priority, expires_at=None)"},
    {"clear", ENTER(policy_clear), METH_NOARGS, "clear(): forget everything"},
    {"memory_bytes", ENTER(policy_memory_bytes), METH_NOARGS, "memory_bytes() -> int"},
    {"__copy__", ENTER(policy_copy), METH_NOARGS, "an independent copy of the policy"},
    {"__deepcopy__", ENTER(policy_copy), METH_O, "__deepcopy__(memo): as __copy__"},
    {nullptr, nullptr, 0, nullptr},
};

PySequenceMethods g_policy_sequence = {};
PyTypeObject g_policy_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyMethodDef g_names_method = {"native_policy_names", module_policy_names, METH_NOARGS,
                              "native_policy_names() -> list[str]: the native policies, sorted"};

}  // namespace

bool native_build_policy(const char* name, int32_t num_blocks, PyObject* options,
                         std::unique_ptr<Policy>* out) {
  PolicyOptions parsed;
  if (options && options != Py_None) {
    if (!PyDict_Check(options)) {
      PyErr_Format(g_config_error, "policy options must be a dict, got %R", options);
      return false;
    }
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(options, &pos, &key, &value)) {
      if (!PyUnicode_Check(key) || PyBool_Check(value) ||
          !(PyLong_Check(value) || PyFloat_Check(value))) {
        PyErr_Format(g_config_error, "policy options are str -> number, got %R: %R", key, value);
        return false;
      }
      const double number = PyFloat_AsDouble(value);
      if (number == -1.0 && PyErr_Occurred()) return false;
      const char* text = PyUnicode_AsUTF8(key);
      if (!text) return false;
      parsed.set(text, number);
    }
  }
  try {
    *out = make_policy(name, num_blocks, parsed);
  } catch (const std::invalid_argument& error) {
    PyErr_SetString(g_config_error, error.what());
    return false;
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
    return false;
  }
  return true;
}

bool add_policy_type(PyObject* module) {
  PyObject* errors = PyImport_ImportModule("prefixcache.errors");
  if (!errors) return false;
  g_config_error = PyObject_GetAttrString(errors, "ConfigError");
  Py_DECREF(errors);
  if (!g_config_error) return false;
  g_policy_sequence.sq_length = policy_length;
  g_policy_sequence.sq_contains = policy_contains;
  g_policy_type.tp_name = "prefixcache.engine._native.NativePolicy";
  g_policy_type.tp_basicsize = sizeof(PolicyObject);
  g_policy_type.tp_flags = Py_TPFLAGS_DEFAULT;
  g_policy_type.tp_doc =
      "NativePolicy(name, num_blocks, options=None): a built-in native eviction policy.";
  g_policy_type.tp_new = PyType_GenericNew;
  g_policy_type.tp_init = policy_init;
  g_policy_type.tp_dealloc = policy_dealloc;
  g_policy_type.tp_methods = g_policy_methods;
  g_policy_type.tp_as_sequence = &g_policy_sequence;
  if (PyType_Ready(&g_policy_type) < 0) return false;
  Py_INCREF(&g_policy_type);
  if (PyModule_AddObject(module, "NativePolicy", reinterpret_cast<PyObject*>(&g_policy_type)) <
      0) {
    Py_DECREF(&g_policy_type);
    return false;
  }
  PyObject* function = PyCFunction_New(&g_names_method, nullptr);
  return function && PyModule_AddObject(module, "native_policy_names", function) == 0;
}

}  // namespace prefixcache
