// Argument parsing for the CPython binding (module.cpp, module_engine.cpp and the other
// binding files): IDs, hashes, counts, flags and keyword arguments from Python objects and
// integer buffers, each checked before any engine runs and refused with the library's own
// exception (binding.h declares what is shared). Split from module.cpp, which keeps the
// errors, the BlockIds type and the module itself.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstring>
#include <string>
#include <vector>

#include "binding.h"
#include "engine.h"

namespace prefixcache {
namespace {

PyObject* raise(ErrorKind kind, const std::string& message) { return native_raise(kind, message); }

bool reentry_pending() { return native_reentry_pending(); }

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
}  // namespace prefixcache
