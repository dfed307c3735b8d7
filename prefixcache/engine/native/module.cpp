// prefixcache.engine._native: the CPython binding of the native engine.
//
// Raw CPython C API with METH_FASTCALL (DESIGN.md, "The native engine": one
// vectorcall per operation, no binding library, no build dependency beyond
// the compiler and the Python headers, and setuptools can make the build
// optional). Arrays cross the boundary through the buffer protocol, so numpy
// arrays, memoryviews and this module's BlockIds objects are read and written
// in place; nothing here needs numpy's headers. Every argument is checked
// here, before the engine runs, and bad input raises the library's own
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

// ------------------------------------------------------------------ argument parsing

// An integer buffer element type, from a struct-module format string.
struct IntFormat {
  bool ok;
  bool is_signed;
  bool is_bool;
};

IntFormat parse_format(const char* format, Py_ssize_t itemsize) {
  if (!format) return {itemsize == 1, false, false};  // plain bytes
  if (*format == '@' || *format == '=' || *format == '<') ++format;
  if (format[0] == '\0' || format[1] != '\0') return {false, false, false};
  switch (format[0]) {
    case 'b': case 'h': case 'i': case 'l': case 'q': case 'n':
      return {itemsize == 1 || itemsize == 2 || itemsize == 4 || itemsize == 8, true, false};
    case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N':
      return {itemsize == 1 || itemsize == 2 || itemsize == 4 || itemsize == 8, false, false};
    case '?':
      return {false, false, true};
    default:
      return {false, false, false};
  }
}

// Element i of an integer buffer, widened; *too_big when it exceeds int64.
inline int64_t element(const void* buf, Py_ssize_t i, Py_ssize_t itemsize, bool is_signed,
                       bool* too_big) {
  const char* p = static_cast<const char*>(buf) + i * itemsize;
  switch (itemsize) {
    case 1: return is_signed ? *reinterpret_cast<const int8_t*>(p) : *reinterpret_cast<const uint8_t*>(p);
    case 2: {
      int16_t s; uint16_t u;
      if (is_signed) { std::memcpy(&s, p, 2); return s; }
      std::memcpy(&u, p, 2); return u;
    }
    case 4: {
      int32_t s; uint32_t u;
      if (is_signed) { std::memcpy(&s, p, 4); return s; }
      std::memcpy(&u, p, 4); return u;
    }
    default: {
      int64_t s; uint64_t u;
      if (is_signed) { std::memcpy(&s, p, 8); return s; }
      std::memcpy(&u, p, 8);
      if (u > static_cast<uint64_t>(INT64_MAX)) *too_big = true;
      return static_cast<int64_t>(u);
    }
  }
}

// ``obj`` as a C-contiguous native-order numpy copy of the same shape (numpy.array, not
// ascontiguousarray, which would make a 0-d array 1-d); nullptr with an error set.
PyObject* native_order_copy(PyObject* obj) {
  PyObject* numpy = PyImport_ImportModule("numpy");
  if (!numpy) return nullptr;
  PyObject* array = PyObject_CallMethod(numpy, "array", "O", obj);
  Py_DECREF(numpy);
  if (!array) return nullptr;
  PyObject* dtype = PyObject_GetAttrString(array, "dtype");
  PyObject* native = dtype ? PyObject_CallMethod(dtype, "newbyteorder", "s", "=") : nullptr;
  PyObject* copy = native ? PyObject_CallMethod(array, "astype", "O", native) : nullptr;
  Py_XDECREF(native);
  Py_XDECREF(dtype);
  Py_DECREF(array);
  return copy;
}

// A 1-D C-contiguous integer buffer of ``obj`` (``writable`` for outputs; an input that
// is strided or in the other byte order is read through a native-order copy), or
// an InvalidTensorError. The caller releases the view.
bool get_int_buffer(PyObject* obj, Py_buffer* view, bool writable, const char* what,
                    IntFormat* format) {
  int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT;
  if (writable) flags |= PyBUF_WRITABLE;
  bool got = PyObject_GetBuffer(obj, view, flags) == 0;
  const bool swapped = got && view->format && (view->format[0] == '>' || view->format[0] == '!');
  if (!writable && (!got || swapped)) {
    // An input read elsewhere than in place (strided, or in the other byte order): a
    // native-order copy, as the Python engine's np.asarray reads it. Outputs never.
    if (got) PyBuffer_Release(view);
    if (!got && reentry_pending()) return false;
    PyErr_Clear();
    PyObject* copy = native_order_copy(obj);
    got = copy && PyObject_GetBuffer(copy, view, flags) == 0;
    Py_XDECREF(copy);  // the view keeps the copy alive
  }
  if (!got && reentry_pending()) return false;
  if (!got) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject* text = value ? PyObject_Str(value) : nullptr;
    const char* reason = text ? PyUnicode_AsUTF8(text) : nullptr;
    std::string message = std::string(what) + " must be a " +
                          (writable ? "writable " : "") +
                          "C-contiguous 1-D integer array: " + (reason ? reason : "no buffer");
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    PyErr_Clear();
    raise(ErrorKind::kInvalidTensor, message);
    return false;
  }
  *format = parse_format(view->format, view->itemsize);
  std::string problem;
  if (view->ndim != 1) {
    problem = " must be 1-D, got " + std::to_string(view->ndim) + " dimensions";
  } else if (format->is_bool) {
    problem = " must have an integer dtype, got bool";
  } else if (!format->ok) {
    problem = std::string(" must have an integer dtype, got format '") +
              (view->format ? view->format : "B") + "'";
  }
  if (!problem.empty()) {
    PyBuffer_Release(view);
    raise(ErrorKind::kInvalidTensor, what + problem);
    return false;
  }
  return true;
}

bool is_int(PyObject* item) { return PyLong_Check(item) && !PyBool_Check(item); }

// A numpy scalar that may be an integer (numpy's own C code answers __index__, so reading
// it runs no Python code that could call back into the engine).
bool is_numpy_scalar(PyObject* item) {
  const char* name = Py_TYPE(item)->tp_name;
  return std::strncmp(name, "numpy.", 6) == 0 && std::strncmp(name, "numpy.bool", 10) != 0 &&
         !PyFloat_Check(item) && !PyComplex_Check(item);
}

}  // namespace

// ``obj`` itself when it exports a buffer; a CPU torch tensor's ``numpy()`` view (same
// memory) otherwise; nullptr with no error set
// when it is neither (bytes, bytearray and str are text, never IDs or tokens), or with
// InvalidTensorError set when ``numpy()`` refuses (a device tensor).
PyObject* native_buffer_source(PyObject* obj, const char* what) {
  if (PyBytes_Check(obj) || PyByteArray_Check(obj) || PyUnicode_Check(obj)) return nullptr;
  if (PyObject_CheckBuffer(obj)) return Py_NewRef(obj);
  if (PyList_Check(obj) || PyTuple_Check(obj)) return nullptr;
  PyObject* method = PyObject_GetAttrString(obj, "numpy");
  if (!method) {
    if (!reentry_pending()) PyErr_Clear();
    return nullptr;
  }
  PyObject* array = PyObject_CallNoArgs(method);
  Py_DECREF(method);
  if (!array && reentry_pending()) return nullptr;
  if (!array || !PyObject_CheckBuffer(array)) {
    Py_XDECREF(array);  // the only reference: nothing of it is returned
    PyErr_Clear();
    raise(ErrorKind::kInvalidTensor, std::string(what) +
                                         " must be a CPU tensor or array (host memory; a device "
                                         "tensor is never read back)");
    return nullptr;
  }
  return array;
}

namespace {

// IDs in [0, num_usable) from a buffer, a list or a tuple, into ``out``.
bool parse_ids(PyObject* obj, int32_t num_usable, std::vector<int32_t>& out,
               const char* what = "block_ids") {
  auto bad_id = [&](int64_t value) {
    if (value == num_usable) {
      raise(ErrorKind::kInvalidBlockId, std::string(what) + " names the dummy block " +
                                            std::to_string(value) + ", which is never handed out");
    } else {
      raise(ErrorKind::kInvalidBlockId, std::string(what) + " holds block " +
                                            std::to_string(value) + ", outside [0, " +
                                            std::to_string(num_usable) + ")");
    }
    return false;
  };
  if (PyList_Check(obj) || PyTuple_Check(obj)) {
    const Py_ssize_t size = PySequence_Fast_GET_SIZE(obj);
    PyObject** items = PySequence_Fast_ITEMS(obj);
    out.resize(static_cast<size_t>(size));
    for (Py_ssize_t i = 0; i < size; ++i) {
      int overflow = 0;
      long long value = 0;
      if (!native_list_int(items[i], &value, &overflow)) {
        raise(ErrorKind::kInvalidTensor, std::string(what) + " must contain only ints");
        return false;
      }
      if (overflow) {  // past int64: as the Python engine's np.asarray says
        raise(ErrorKind::kInvalidTensor, std::string(what) + " holds an integer out of range");
        return false;
      }
      if (value < 0 || value >= num_usable) return bad_id(value);
      out[i] = static_cast<int32_t>(value);
    }
    return true;
  }
  PyObject* source = native_buffer_source(obj, what);
  if (!source) {
    if (!PyErr_Occurred()) {
      raise(ErrorKind::kInvalidTensor, std::string(what) + " must be an integer array, a "
                                           "list or a tuple of ints, got " + Py_TYPE(obj)->tp_name);
    }
    return false;
  }
  Py_buffer view;
  IntFormat format;
  const bool got = get_int_buffer(source, &view, false, what, &format);
  Py_DECREF(source);  // the view keeps its exporter alive
  if (!got) return false;
  const Py_ssize_t size = view.shape ? view.shape[0] : view.len / view.itemsize;
  out.resize(static_cast<size_t>(size));
  bool ok = true;
  if (view.itemsize == 4 && format.is_signed) {  // int32: the common dtype
    const int32_t* values = static_cast<const int32_t*>(view.buf);
    for (Py_ssize_t i = 0; i < size; ++i) {
      const int32_t value = values[i];
      if (static_cast<uint32_t>(value) >= static_cast<uint32_t>(num_usable)) {
        ok = bad_id(value);
        break;
      }
      out[i] = value;
    }
  } else {
    for (Py_ssize_t i = 0; i < size; ++i) {
      bool too_big = false;
      const int64_t value = element(view.buf, i, view.itemsize, format.is_signed, &too_big);
      if (too_big || value < 0 || value >= num_usable) {
        ok = bad_id(too_big ? INT64_MAX : value);
        break;
      }
      out[i] = static_cast<int32_t>(value);
    }
  }
  PyBuffer_Release(&view);
  return ok;
}

// Signed 64-bit hashes from a list, a tuple or an integer buffer.
bool parse_hashes(PyObject* obj, std::vector<int64_t>& out, const char* what, bool sentinels) {
  auto outside = [&]() {
    raise(ErrorKind::kInvalidArgument,
          std::string(what) + " holds a hash outside the signed 64-bit range (the native "
                                "engine keeps int64 hashes; use engine='python' for wider ones)");
    return false;
  };
  if (PyList_Check(obj) || PyTuple_Check(obj)) {
    const Py_ssize_t size = PySequence_Fast_GET_SIZE(obj);
    PyObject** items = PySequence_Fast_ITEMS(obj);
    out.resize(static_cast<size_t>(size));
    for (Py_ssize_t i = 0; i < size; ++i) {
      int overflow = 0;
      long long value = 0;
      if (!native_list_int(items[i], &value, &overflow)) {
        raise(ErrorKind::kInvalidTensor, std::string(what) + " must contain only ints");
        return false;
      }
      if (overflow) return outside();
      out[i] = value;
    }
  } else if (PyObject_CheckBuffer(obj)) {
    Py_buffer view;
    IntFormat format;
    if (!get_int_buffer(obj, &view, false, what, &format)) return false;
    const Py_ssize_t size = view.shape[0];
    out.resize(static_cast<size_t>(size));
    bool too_big = false;
    for (Py_ssize_t i = 0; i < size; ++i) {
      out[i] = element(view.buf, i, view.itemsize, format.is_signed, &too_big);
    }
    PyBuffer_Release(&view);
    if (too_big) return outside();
  } else {
    raise(ErrorKind::kInvalidTensor, std::string(what) + " must be a sequence of ints or a 1-D "
                                         "integer array, got " + Py_TYPE(obj)->tp_name);
    return false;
  }
  if (sentinels) {
    for (const int64_t value : out) {
      if (value == 0 || value == -1) {
        raise(ErrorKind::kInvalidArgument,
              "hash " + std::to_string(value) + " is a reserved sentinel");
        return false;
      }
    }
  }
  return true;
}

// A non-negative count; *huge when it exceeds int64 (no engine can satisfy it).
bool parse_count(PyObject* obj, const char* what, int64_t* out, bool* huge) {
  *huge = false;
  if (PyBool_Check(obj) || !(PyLong_Check(obj) || PyIndex_Check(obj))) {
    raise(ErrorKind::kInvalidArgument, std::string(what) + " must be an int, got " +
                                           Py_TYPE(obj)->tp_name);
    return false;
  }
  PyObject* number = PyNumber_Index(obj);
  if (!number) {
    if (reentry_pending()) return false;
    PyErr_Clear();
    raise(ErrorKind::kInvalidArgument, std::string(what) + " must be an int");
    return false;
  }
  int overflow = 0;
  const long long value = PyLong_AsLongLongAndOverflow(number, &overflow);
  Py_DECREF(number);
  if (overflow < 0 || (!overflow && value < 0)) {
    raise(ErrorKind::kInvalidArgument, std::string(what) + " must be >= 0");
    return false;
  }
  *huge = overflow > 0;
  *out = overflow > 0 ? INT64_MAX : value;
  return true;
}

// A flag: Python's bool or numpy's (whose type is named "numpy.bool" or "numpy.bool_").
bool parse_flag(PyObject* obj, const char* what, bool* out) {
  if (obj == Py_True || obj == Py_False) {
    *out = obj == Py_True;
    return true;
  }
  const char* name = Py_TYPE(obj)->tp_name;
  if (std::strcmp(name, "numpy.bool") == 0 || std::strcmp(name, "numpy.bool_") == 0) {
    *out = PyObject_IsTrue(obj) == 1;
    return true;
  }
  raise(ErrorKind::kInvalidArgument, std::string(what) + " must be a bool, got " + name);
  return false;
}

// Positional-or-keyword arguments of a METH_FASTCALL | METH_KEYWORDS call.
bool bind_args(const char* function, PyObject* const* args, Py_ssize_t nargs,
               PyObject* kwnames, const char* const* names, Py_ssize_t required,
               Py_ssize_t total, PyObject** out) {
  for (Py_ssize_t i = 0; i < total; ++i) out[i] = nullptr;
  if (nargs > total) {
    PyErr_Format(PyExc_TypeError, "%s() takes at most %zd arguments", function, total);
    return false;
  }
  for (Py_ssize_t i = 0; i < nargs; ++i) out[i] = args[i];
  if (kwnames) {
    const Py_ssize_t num_keywords = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < num_keywords; ++k) {
      const char* key = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, k));
      Py_ssize_t i = 0;
      while (i < total && (!key || std::strcmp(key, names[i]) != 0)) ++i;
      if (i == total || out[i]) {
        PyErr_Format(PyExc_TypeError, "%s() got an unexpected or repeated argument %s",
                     function, key ? key : "?");
        return false;
      }
      out[i] = args[nargs + k];
    }
  }
  for (Py_ssize_t i = 0; i < required; ++i) {
    if (!out[i]) {
      PyErr_Format(PyExc_TypeError, "%s() missing argument %s", function, names[i]);
      return false;
    }
  }
  return true;
}

}  // namespace

// Shared with module_engine.cpp.
PyObject* native_raise(ErrorKind kind, const std::string& message) { return raise(kind, message); }

bool native_list_int(PyObject* item, long long* value, int* overflow) {
  *overflow = 0;
  if (PyLong_CheckExact(item) || is_int(item)) {
    *value = PyLong_AsLongLongAndOverflow(item, overflow);
    return true;
  }
  if (!is_numpy_scalar(item)) return false;
  PyObject* number = PyNumber_Index(item);  // TypeError for a numpy float: not an int
  if (!number) {
    PyErr_Clear();
    return false;
  }
  *value = PyLong_AsLongLongAndOverflow(number, overflow);
  Py_DECREF(number);
  return true;
}
PyObject* native_block_ids(const int32_t* values, size_t size) { return block_ids_from(values, size); }
PyObject* native_new_block_ids(Py_ssize_t size, int32_t** data) { return new_block_ids(size, data); }
bool native_parse_ids(PyObject* obj, int32_t num_usable, std::vector<int32_t>& out,
                      const char* what) {
  return parse_ids(obj, num_usable, out, what);
}
bool native_parse_hashes(PyObject* obj, std::vector<int64_t>& out, const char* what,
                         bool sentinels) {
  return parse_hashes(obj, out, what, sentinels);
}
bool native_parse_count(PyObject* obj, const char* what, int64_t* out, bool* huge) {
  return parse_count(obj, what, out, huge);
}
bool native_parse_flag(PyObject* obj, const char* what, bool* out) {
  return parse_flag(obj, what, out);
}
bool native_bind_args(const char* function, PyObject* const* args, Py_ssize_t nargs,
                      PyObject* kwnames, const char* const* names, Py_ssize_t required,
                      Py_ssize_t total, PyObject** out) {
  return bind_args(function, args, nargs, kwnames, names, required, total, out);
}
bool native_int_buffer(PyObject* obj, Py_buffer* view, bool writable, const char* what,
                       bool* is_signed) {
  IntFormat format;
  if (!get_int_buffer(obj, view, writable, what, &format)) return false;
  *is_signed = format.is_signed;
  return true;
}
int64_t native_element(const void* buf, Py_ssize_t i, Py_ssize_t itemsize, bool is_signed,
                       bool* too_big) {
  return element(buf, i, itemsize, is_signed, too_big);
}

namespace {

// ------------------------------------------------------------------ module functions

PyObject* module_xxh3_64(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  static const char* const names[] = {"data", "seed"};
  PyObject* bound[2];
  if (!bind_args("xxh3_64", args, nargs, kwnames, names, 1, 2, bound)) return nullptr;
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
      !add_session_type(module)) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
