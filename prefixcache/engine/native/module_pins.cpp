// Chain pins on prefixcache.engine._native.Engine (engine_pins.cpp): pin_chain,
// release_pinned, reclaimable, num_evictable, pinned_tails, and the can_pin and pin_bound
// properties; the Python engine's are in prefixcache/engine/pins.py.

#include <cstdint>
#include <string>
#include <vector>

#include "module_engine.h"

namespace prefixcache {

// O(1): only the tail is read (the caller found the chain cached), whatever its length.
FASTCALL(engine_pin_chain) {
  static const char* const names[] = {"tail", "chain_length", "num_queried"};
  EngineObject* self = self_of(py_self);
  PyObject* bound[3];
  if (!ready(self) || !native_bind_args("pin_chain", args, nargs, kwnames, names, 3, 3, bound)) {
    return nullptr;
  }
  int64_t tail, chain_length, num_queried;
  bool huge_tail, huge_length, huge_queried;
  if (!native_parse_count(bound[0], "tail", &tail, &huge_tail) ||
      !native_parse_count(bound[1], "chain_length", &chain_length, &huge_length) ||
      !native_parse_count(bound[2], "num_queried", &num_queried, &huge_queried)) {
    return nullptr;
  }
  const int32_t num_usable = self->engine->num_usable();
  if (huge_tail || tail >= num_usable) {
    return native_raise(ErrorKind::kInvalidBlockId,
                        "tail is outside [0, " + std::to_string(num_usable) + ")");
  }
  if (huge_length || huge_queried || chain_length < 2) {
    return native_raise(ErrorKind::kInvalidArgument,
                        "a pinned chain has two blocks or more (and counts that fit)");
  }
  GUARD(self->engine->pin_chain(static_cast<int32_t>(tail), chain_length, num_queried);)
  Py_RETURN_NONE;
}

FASTCALL(engine_release_pinned) {
  static const char* const names[] = {"block_ids", "chain_length"};
  EngineObject* self = self_of(py_self);
  PyObject* bound[2];
  if (!ready(self) ||
      !native_bind_args("release_pinned", args, nargs, kwnames, names, 2, 2, bound)) {
    return nullptr;
  }
  int64_t chain_length;
  bool huge;
  if (!native_parse_count(bound[1], "chain_length", &chain_length, &huge) ||
      !native_parse_ids(bound[0], self->engine->num_usable(), *self->ids, "block_ids")) {
    return nullptr;
  }
  if (huge || chain_length < 2 || self->ids->empty()) {
    return native_raise(ErrorKind::kInvalidArgument,
                        "release_pinned needs the tail and a chain of two blocks or more");
  }
  GUARD(self->engine->release_pinned(self->ids->data(), self->ids->size(), chain_length);)
  Py_RETURN_NONE;
}

PyObject* engine_reclaimable(PyObject* py_self, PyObject* arg) {
  EngineObject* self = self_of(py_self);
  if (!ready(self) || !native_parse_ids(arg, self->engine->num_usable(), *self->ids, "block_ids")) {
    return nullptr;
  }
  return PyLong_FromLongLong(self->engine->reclaimable(self->ids->data(), self->ids->size()));
}

PyObject* engine_num_evictable(PyObject* py_self, PyObject* arg) {
  EngineObject* self = self_of(py_self);
  int64_t count;
  bool huge;
  if (!ready(self) || !native_parse_count(arg, "num_blocks", &count, &huge)) return nullptr;
  return PyLong_FromLongLong(self->engine->num_evictable(count));
}

PyObject* engine_pinned_tails(PyObject* py_self, PyObject*) {
  EngineObject* self = self_of(py_self);
  if (!ready(self)) return nullptr;
  const auto tails = self->engine->pinned_tails();
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(tails.size()));
  if (!out) return nullptr;
  for (size_t i = 0; i < tails.size(); ++i) {
    PyObject* pair = Py_BuildValue("(ii)", tails[i].first, tails[i].second);
    if (!pair) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), pair);
  }
  return out;
}

PyObject* engine_get_can_pin(PyObject* py_self, void*) {
  EngineObject* self = self_of(py_self);
  if (!ready(self)) return nullptr;
  return PyBool_FromLong(self->engine->can_pin());
}

PyObject* engine_get_pin_bound(PyObject* py_self, void*) {
  EngineObject* self = self_of(py_self);
  if (!ready(self)) return nullptr;
  return PyLong_FromLongLong(self->engine->pin_bound());
}

}  // namespace prefixcache
