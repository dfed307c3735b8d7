// prefixcache.engine._native: the CPython binding of the native engine.
//
// Raw CPython C API with METH_FASTCALL (DESIGN.md, "The native engine": one
// vectorcall per operation, no binding library, no build dependency beyond
// the compiler and the Python headers, and setuptools can make the build
// optional). Arrays cross the boundary through the buffer protocol, so numpy
// arrays, memoryviews and this module's BlockIds objects are read and written
// in place; nothing here needs numpy's headers. Every argument is checked
// (module_args.cpp) before the engine runs, and bad input raises the library's own
// exceptions (prefixcache.errors): wrong dtype, bools, non-contiguous or
// read-only buffers, out-of-range IDs, negative or huge counts, hashes outside
// 64 bits.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "binding.h"
#include "block_hashing.h"
#include "engine.h"
#include "xxh3.h"

namespace prefixcache {
namespace {

// ------------------------------------------------------------------ errors

PyObject* g_errors[10] = {};  // by ErrorKind

PyObject* raise(ErrorKind kind, const std::string& message) {
  if (kind == ErrorKind::kPolicyRaised) return nullptr;  // the policy's exception is set
  PyErr_SetString(g_errors[static_cast<int>(kind)], message.c_str());
  return nullptr;
}

// Whether the pending error is a refused re-entry (CallGuard): a conversion's Python code
// called back into the object. It is kept as the call's error rather than replaced by the
// conversion's own "bad argument" message, which would hide the cause.
bool reentry_pending() {
  return PyErr_ExceptionMatches(g_errors[static_cast<int>(ErrorKind::kReentrantCall)]) != 0;
}

bool load_errors() {
  PyObject* module = PyImport_ImportModule("prefixcache.errors");
  if (!module) return false;
  const char* names[10] = {"InvalidArgumentError", "InvalidBlockIdError", "InvalidTensorError",
                           "BlockStateError",      "ReferenceCountError", "HashConflictError",
                           "CapacityError",        "BudgetExceededError", "InvariantError",
                           "ReentrantCallError"};
  for (int i = 0; i < 10; ++i) {
    g_errors[i] = PyObject_GetAttrString(module, names[i]);
    if (!g_errors[i]) {
      Py_DECREF(module);
      return false;
    }
  }
  Py_DECREF(module);
  return true;
}

#define ENGINE_GUARD(...)                                     \
  try {                                                       \
    __VA_ARGS__                                               \
  } catch (const EngineError& error) {                        \
    return raise(error.kind, error.message);                  \
  } catch (const std::bad_alloc&) {                           \
    return PyErr_NoMemory();                                  \
  }

// ------------------------------------------------------------------ BlockIds

// A compact int32 array object: what the engine hands out. It exports the
// buffer protocol (format "i", writable), so np.frombuffer, torch.frombuffer
// and memoryview wrap it without a copy, and every method here takes it back.
struct BlockIdsObject {
  PyObject_VAR_HEAD
  int32_t data[1];
};

Py_ssize_t g_int32_stride = 4;
char g_int32_format[] = "i";

int block_ids_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  auto* ids = reinterpret_cast<BlockIdsObject*>(self);
  view->obj = Py_NewRef(self);
  view->buf = ids->data;
  view->len = Py_SIZE(self) * 4;
  view->readonly = 0;
  view->itemsize = 4;
  view->format = (flags & PyBUF_FORMAT) ? g_int32_format : nullptr;
  view->ndim = 1;
  view->shape = (flags & PyBUF_ND) == PyBUF_ND ? &reinterpret_cast<PyVarObject*>(self)->ob_size
                                               : nullptr;
  view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? &g_int32_stride : nullptr;
  view->suboffsets = nullptr;
  view->internal = nullptr;
  return 0;
}

PyBufferProcs g_block_ids_buffer = {block_ids_getbuffer, nullptr};

Py_ssize_t block_ids_length(PyObject* self) { return Py_SIZE(self); }

PyObject* block_ids_item(PyObject* self, Py_ssize_t i) {
  if (i < 0 || i >= Py_SIZE(self)) {
    PyErr_SetString(PyExc_IndexError, "BlockIds index out of range");
    return nullptr;
  }
  return PyLong_FromLong(reinterpret_cast<BlockIdsObject*>(self)->data[i]);
}

PyObject* block_ids_tolist(PyObject* self, PyObject*) {
  const Py_ssize_t size = Py_SIZE(self);
  PyObject* list = PyList_New(size);
  if (!list) return nullptr;
  for (Py_ssize_t i = 0; i < size; ++i) {
    PyObject* item = PyLong_FromLong(reinterpret_cast<BlockIdsObject*>(self)->data[i]);
    if (!item) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, i, item);
  }
  return list;
}

PyObject* block_ids_repr(PyObject* self) {
  PyObject* list = block_ids_tolist(self, nullptr);
  if (!list) return nullptr;
  PyObject* text = PyUnicode_FromFormat("BlockIds(%R)", list);
  Py_DECREF(list);
  return text;
}

PySequenceMethods g_block_ids_sequence = {block_ids_length, nullptr, nullptr, block_ids_item};

PyMethodDef g_block_ids_methods[] = {
    {"tolist", block_ids_tolist, METH_NOARGS, "The IDs as a list of ints."},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject g_block_ids_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* new_block_ids(Py_ssize_t size, int32_t** data) {
  auto* ids = PyObject_NewVar(BlockIdsObject, &g_block_ids_type, size);
  if (!ids) return nullptr;
  *data = ids->data;
  return reinterpret_cast<PyObject*>(ids);
}

PyObject* block_ids_from(const int32_t* values, size_t size) {
  int32_t* data = nullptr;
  PyObject* ids = new_block_ids(static_cast<Py_ssize_t>(size), &data);
  if (ids && size) std::memcpy(data, values, size * sizeof(int32_t));
  return ids;
}

bool is_int(PyObject* item) { return PyLong_Check(item) && !PyBool_Check(item); }

}  // namespace

// Shared with the other binding files (binding.h).
PyObject* native_raise(ErrorKind kind, const std::string& message) { return raise(kind, message); }
bool native_reentry_pending() { return reentry_pending(); }
PyObject* native_block_ids(const int32_t* values, size_t size) { return block_ids_from(values, size); }
PyObject* native_new_block_ids(Py_ssize_t size, int32_t** data) { return new_block_ids(size, data); }

namespace {

// ------------------------------------------------------------------ module functions

PyObject* module_xxh3_64(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  static const char* const names[] = {"data", "seed"};
  PyObject* bound[2];
  if (!native_bind_args("xxh3_64", args, nargs, kwnames, names, 1, 2, bound)) return nullptr;
  uint64_t seed = 0;
  if (bound[1]) {
    if (!is_int(bound[1])) return raise(ErrorKind::kInvalidArgument, "seed must be an int");
    seed = PyLong_AsUnsignedLongLong(bound[1]);
    if (seed == static_cast<uint64_t>(-1) && PyErr_Occurred()) {
      PyErr_Clear();
      return raise(ErrorKind::kInvalidArgument, "seed must be an int in [0, 2**64)");
    }
  }
  Py_buffer view;
  if (PyObject_GetBuffer(bound[0], &view, PyBUF_C_CONTIGUOUS) != 0) {
    PyErr_Clear();
    return raise(ErrorKind::kInvalidTensor, "data must be a C-contiguous bytes-like object");
  }
  uint64_t digest;
  Py_BEGIN_ALLOW_THREADS
  digest = xxh3_64(view.buf, static_cast<size_t>(view.len), seed);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&view);
  return PyLong_FromUnsignedLongLong(digest);
}

PyObject* module_default_root(PyObject*, PyObject*) {
  return PyLong_FromUnsignedLongLong(default_root());
}

PyMethodDef g_module_methods[] = {
    {"xxh3_64", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(module_xxh3_64)),
     METH_FASTCALL | METH_KEYWORDS,
     "xxh3_64(data, seed=0) -> int: XXH3-64 of a bytes-like object, as xxhash.xxh3_64_intdigest."},
    {"default_root", module_default_root, METH_NOARGS,
     "default_root() -> int: the chain root without salt or keys (hashing.root_hash())."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef g_module = {
    PyModuleDef_HEAD_INIT, "_native",
    "The native engine of prefixcache (see prefixcache.engine.native_engine).", -1,
    g_module_methods,
};

}  // namespace
}  // namespace prefixcache

PyMODINIT_FUNC PyInit__native(void) {
  using namespace prefixcache;
  if (!load_errors()) return nullptr;
  g_block_ids_type.tp_name = "prefixcache.engine._native.BlockIds";
  g_block_ids_type.tp_basicsize = offsetof(BlockIdsObject, data);
  g_block_ids_type.tp_itemsize = sizeof(int32_t);
  g_block_ids_type.tp_flags = Py_TPFLAGS_DEFAULT;
  g_block_ids_type.tp_doc = "Block IDs handed out by the native engine: an int32 buffer.";
  g_block_ids_type.tp_as_buffer = &g_block_ids_buffer;
  g_block_ids_type.tp_as_sequence = &g_block_ids_sequence;
  g_block_ids_type.tp_methods = g_block_ids_methods;
  g_block_ids_type.tp_repr = block_ids_repr;
  if (PyType_Ready(&g_block_ids_type) < 0) return nullptr;
  PyObject* module = PyModule_Create(&g_module);
  if (!module) return nullptr;
  Py_INCREF(&g_block_ids_type);
  if (PyModule_AddObject(module, "BlockIds", reinterpret_cast<PyObject*>(&g_block_ids_type)) < 0 ||
      !add_engine_type(module) || !add_policy_type(module) ||
      !add_session_type(module) || !add_vllm_queue_type(module)) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
