// The Python Engine object and the helpers its method files share
// (module_engine.cpp: the type and most methods; module_request.cpp: the fused
// request path and hash_tokens).

#ifndef PREFIXCACHE_ENGINE_NATIVE_MODULE_ENGINE_H_
#define PREFIXCACHE_ENGINE_NATIVE_MODULE_ENGINE_H_

#include <new>
#include <string>
#include <vector>

#include "binding.h"
#include "engine_checkpoint.h"

namespace prefixcache {

struct EngineObject {
  PyObject_HEAD
  Engine* engine;
  std::vector<int32_t>* ids;       // parsed block IDs
  std::vector<int64_t>* hashes;    // parsed or computed hashes
  std::vector<int32_t>* tokens;    // tokens narrowed to int32
  int64_t block_size;
  uint64_t root;
  int64_t layout_epoch;  // bumped by reset and relocation (what a native session checks)
  int64_t num_inits;     // __init__ calls: a native session belongs to one
  bool busy;  // a call is running (CallGuard)
  EngineCheckpoint* checkpoint;  // a transactional (Python) policy's saved state; else null
};

/// The Engine type (module_engine.cpp), for the types that take an engine.
PyTypeObject* native_engine_type();

// Tokens as int32: the caller's buffer itself when it is int32 (held until
// release()), else narrowed into the engine's scratch ``tokens`` (every token
// must fit in int32, as hashing.py requires).
struct Tokens {
  const int32_t* data = nullptr;
  size_t count = 0;
  Py_buffer view{};
  bool holds_view = false;
  Tokens() = default;
  Tokens(const Tokens&) = delete;
  Tokens& operator=(const Tokens&) = delete;
  ~Tokens() { release(); }
  void release() {
    if (holds_view) PyBuffer_Release(&view);
    holds_view = false;
  }
};

/// ``obj`` (a list, tuple or 1-D integer buffer) as int32 tokens; false with the library's
/// error set otherwise (module_request.cpp).
bool native_parse_tokens(EngineObject* self, PyObject* obj, Tokens* out);

// The engine call in __VA_ARGS__ as a transaction (engine_checkpoint.h); errors raised.
#define GUARD(...)                                             \
  try {                                                        \
    PolicyTransaction transaction(self->engine, self->checkpoint); \
    __VA_ARGS__                                                \
    transaction.commit();                                      \
  } catch (const EngineError& error) {                         \
    return native_raise(error.kind, error.message);            \
  } catch (const std::bad_alloc&) {                            \
    return PyErr_NoMemory();                                   \
  }

#define FASTCALL(name)                                                                  \
  PyObject* name(PyObject* py_self, PyObject* const* args, Py_ssize_t nargs,            \
                 PyObject* kwnames)

inline EngineObject* self_of(PyObject* py_self) { return reinterpret_cast<EngineObject*>(py_self); }

inline bool ready(EngineObject* self) {
  if (self->engine) return true;
  PyErr_SetString(PyExc_RuntimeError, "native Engine not initialised");
  return false;
}

inline bool parse_one_id(EngineObject* self, PyObject* arg, int32_t* out) {
  if (PyBool_Check(arg) || !PyLong_Check(arg)) {
    native_raise(ErrorKind::kInvalidArgument, "block_id must be an int");
    return false;
  }
  int overflow = 0;
  const long long value = PyLong_AsLongLongAndOverflow(arg, &overflow);
  if (overflow || value < 0 || value >= self->engine->num_usable()) {
    native_raise(ErrorKind::kInvalidBlockId, "block_id outside [0, " +
                                                 std::to_string(self->engine->num_usable()) + ")");
    return false;
  }
  *out = static_cast<int32_t>(value);
  return true;
}

// Partitions, relocation and the clock (module_partitions.cpp).
FASTCALL(engine_move);
FASTCALL(engine_relocate);
PyObject* engine_touch(PyObject* py_self, PyObject* arg);
PyObject* engine_evict(PyObject* py_self, PyObject* arg);
PyObject* engine_evict_blocks(PyObject* py_self, PyObject* arg);
PyObject* engine_set_retention(PyObject* py_self, PyObject* args);
PyObject* engine_has_retention(PyObject* py_self, PyObject*);
PyObject* engine_advance_clock(PyObject* py_self, PyObject* arg);
PyObject* engine_reference_counts(PyObject* py_self, PyObject* arg);
PyObject* engine_describe_state(PyObject* py_self, PyObject* arg);

// Prefix reuse (module_prefix.cpp).
PyObject* engine_lookup(PyObject* py_self, PyObject* arg);
FASTCALL(engine_take_hit);
// module_pins.cpp
FASTCALL(engine_pin_chain);
FASTCALL(engine_release_pinned);
PyObject* engine_reclaimable(PyObject* py_self, PyObject* arg);
PyObject* engine_num_evictable(PyObject* py_self, PyObject* arg);
PyObject* engine_pinned_tails(PyObject* py_self, PyObject*);
PyObject* engine_get_can_pin(PyObject* py_self, void*);
PyObject* engine_get_pin_bound(PyObject* py_self, void*);
PyObject* engine_acquire(PyObject* py_self, PyObject* arg);
FASTCALL(engine_register);
PyObject* engine_block_of(PyObject* py_self, PyObject* arg);
PyObject* engine_hash_of(PyObject* py_self, PyObject* arg);
PyObject* engine_registrations(PyObject* py_self, PyObject* arg);
PyObject* engine_registered_chains(PyObject* py_self, PyObject*);

// The fused request path (module_request.cpp).
FASTCALL(engine_admit_request);
FASTCALL(engine_hash_tokens);

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_MODULE_ENGINE_H_
