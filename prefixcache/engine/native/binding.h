// Argument parsing (module_args.cpp) and result helpers (module.cpp) shared by the binding files.
// Each parser raises the library's own exception and returns false on bad input.

#ifndef PREFIXCACHE_ENGINE_NATIVE_BINDING_H_
#define PREFIXCACHE_ENGINE_NATIVE_BINDING_H_

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine.h"
#include "policy.h"

namespace prefixcache {

PyObject* native_raise(ErrorKind kind, const std::string& message);
/// Whether the pending error is a refused re-entry (CallGuard's ReentrantCallError).
bool native_reentry_pending();
PyObject* native_block_ids(const int32_t* values, size_t size);
PyObject* native_new_block_ids(Py_ssize_t size, int32_t** data);
bool native_parse_ids(PyObject* obj, int32_t num_usable, std::vector<int32_t>& out,
                      const char* what);
bool native_parse_hashes(PyObject* obj, std::vector<int64_t>& out, const char* what,
                         bool sentinels);
bool native_parse_count(PyObject* obj, const char* what, int64_t* out, bool* huge);
bool native_parse_flag(PyObject* obj, const char* what, bool* out);
bool native_bind_args(const char* function, PyObject* const* args, Py_ssize_t nargs,
                      PyObject* kwnames, const char* const* names, Py_ssize_t required,
                      Py_ssize_t total, PyObject** out);
bool native_int_buffer(PyObject* obj, Py_buffer* view, bool writable, const char* what,
                       bool* is_signed);
int64_t native_element(const void* buf, Py_ssize_t i, Py_ssize_t itemsize, bool is_signed,
                       bool* too_big);
bool add_engine_type(PyObject* module);
bool add_policy_type(PyObject* module);
bool add_session_type(PyObject* module);
bool add_vllm_queue_type(PyObject* module);
/// The native policy ``name`` with ``options`` (a dict of numbers, or None) into ``out``;
/// false with ConfigError set for an unknown name or option or a value out of range.
bool native_build_policy(const char* name, int32_t num_blocks, PyObject* options,
                         std::unique_ptr<Policy>* out);
/// A buffer to read ``obj`` through (see module.cpp).
PyObject* native_buffer_source(PyObject* obj, const char* what);
/// ``item`` as an int if it is one (a Python int or a numpy integer, never a bool); false
/// otherwise. ``*overflow`` is set when it lies outside int64.
bool native_list_int(PyObject* item, long long* value, int* overflow);

/// Refuses a call that begins while another call on the same object is running. Python code
/// can run inside a native call (an argument's __index__, numpy() or __len__, a finaliser run
/// by the garbage collector); if it called back into the same engine or policy, the outer
/// call would go on with scratch buffers and state the inner call changed. The guard holds
/// the object's flag for the outer call's life; an inner call raises ReentrantCallError
/// before it changes anything.
class CallGuard {
 public:
  explicit CallGuard(bool* busy) : busy_(busy), admitted_(!*busy) {
    if (admitted_) {
      *busy_ = true;
    } else {
      native_raise(ErrorKind::kReentrantCall,
                   "a call into this native object began while another call on it was "
                   "running (Python code run during that call called back in); refused, "
                   "nothing changed");
    }
  }
  ~CallGuard() {
    if (admitted_) *busy_ = false;
  }
  CallGuard(const CallGuard&) = delete;
  CallGuard& operator=(const CallGuard&) = delete;
  bool admitted() const { return admitted_; }

 private:
  bool* busy_;
  bool admitted_;
};

/// ``F`` (METH_O, METH_NOARGS or METH_VARARGS) behind ``Object``'s CallGuard.
template <typename Object, PyObject* (*F)(PyObject*, PyObject*)>
PyObject* guarded(PyObject* self, PyObject* arg) {
  CallGuard guard(&reinterpret_cast<Object*>(self)->busy);
  return guard.admitted() ? F(self, arg) : nullptr;
}

/// ``F`` (METH_FASTCALL | METH_KEYWORDS) behind ``Object``'s CallGuard.
template <typename Object,
          PyObject* (*F)(PyObject*, PyObject* const*, Py_ssize_t, PyObject*)>
PyObject* guarded_fast(PyObject* self, PyObject* const* args, Py_ssize_t nargs,
                       PyObject* kwnames) {
  CallGuard guard(&reinterpret_cast<Object*>(self)->busy);
  return guard.admitted() ? F(self, args, nargs, kwnames) : nullptr;
}

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_BINDING_H_
