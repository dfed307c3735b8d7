// prefixcache.engine._native.Engine's partition, relocation and clock methods: move
// (pause/resume), relocate (defragmentation), touch, evict, retention, the clock, reference
// counts and a block's state. Split from module_engine.cpp (the type, life cycle,
// allocation and checks); each parses its arguments before the engine runs.

#include <string>
#include <vector>

#include "module_engine.h"

namespace prefixcache {

// ------------------------------------------------------------------ partitions and time

FASTCALL(engine_move) {
  static const char* const names[] = {"block_ids", "to_paused"};
  EngineObject* self = self_of(py_self);
  PyObject* bound[2];
  if (!ready(self) || !native_bind_args("move", args, nargs, kwnames, names, 2, 2, bound)) {
    return nullptr;
  }
  bool to_paused;
  if (!native_parse_flag(bound[1], "to_paused", &to_paused) ||
      !native_parse_ids(bound[0], self->engine->num_usable(), *self->ids, "block_ids")) {
    return nullptr;
  }
  GUARD(self->engine->move(self->ids->data(), self->ids->size(), to_paused);)
  Py_RETURN_NONE;
}

FASTCALL(engine_relocate) {
  static const char* const names[] = {"sources", "destinations", "check_only"};
  EngineObject* self = self_of(py_self);
  PyObject* bound[3] = {nullptr, nullptr, nullptr};
  if (!ready(self) || !native_bind_args("relocate", args, nargs, kwnames, names, 2, 3, bound)) {
    return nullptr;
  }
  bool check_only = false;
  if (bound[2] && !native_parse_flag(bound[2], "check_only", &check_only)) return nullptr;
  std::vector<int32_t> destinations;
  if (!native_parse_ids(bound[0], self->engine->num_usable(), *self->ids, "sources") ||
      !native_parse_ids(bound[1], self->engine->num_usable(), destinations, "destinations")) {
    return nullptr;
  }
  if (destinations.size() != self->ids->size()) {
    native_raise(ErrorKind::kInvalidArgument, "sources and destinations differ in length");
    return nullptr;
  }
  if (check_only) {
    GUARD(self->engine->check_relocation(self->ids->data(), destinations.data(),
                                         destinations.size());)
  } else {
    GUARD(self->engine->relocate(self->ids->data(), destinations.data(), destinations.size());)
    ++self->layout_epoch;  // blocks moved: native sessions look their chains up again
  }
  Py_RETURN_NONE;
}

PyObject* engine_touch(PyObject* py_self, PyObject* arg) {
  EngineObject* self = self_of(py_self);
  if (!ready(self) || !native_parse_ids(arg, self->engine->num_usable(), *self->ids, "block_ids")) {
    return nullptr;
  }
  GUARD(self->engine->touch(self->ids->data(), self->ids->size());)
  Py_RETURN_NONE;
}

PyObject* engine_evict(PyObject* py_self, PyObject* arg) {
  EngineObject* self = self_of(py_self);
  int64_t count;
  bool huge;
  if (!ready(self) || !native_parse_count(arg, "num_blocks", &count, &huge)) return nullptr;
  int64_t freed = 0;
  GUARD(freed = self->engine->evict(count);)
  return PyLong_FromLongLong(freed);
}

PyObject* engine_evict_blocks(PyObject* py_self, PyObject* arg) {
  EngineObject* self = self_of(py_self);
  if (!ready(self) || !native_parse_ids(arg, self->engine->num_usable(), *self->ids, "block_ids")) {
    return nullptr;
  }
  int64_t freed = 0;
  GUARD(freed = self->engine->evict_blocks(self->ids->data(), self->ids->size());)
  return PyLong_FromLongLong(freed);
}

PyObject* engine_set_retention(PyObject* py_self, PyObject* args) {
  EngineObject* self = self_of(py_self);
  long long block_hash, priority;
  PyObject* expires = Py_None;
  if (!ready(self) || !PyArg_ParseTuple(args, "LL|O", &block_hash, &priority, &expires)) {
    return nullptr;
  }
  Policy* policy = self->engine->policy();
  if (!policy || !policy->has_retention()) {
    PyErr_SetString(PyExc_NotImplementedError, "the native policy has no retention priorities");
    return nullptr;
  }
  long long expires_at = kNoExpiry;
  if (expires != Py_None) {
    expires_at = PyLong_AsLongLong(expires);
    if (expires_at == -1 && PyErr_Occurred()) return nullptr;
  }
  GUARD(self->engine->set_retention(block_hash, priority, expires_at);)
  Py_RETURN_NONE;
}

PyObject* engine_has_retention(PyObject* py_self, PyObject*) {
  EngineObject* self = self_of(py_self);
  if (!ready(self)) return nullptr;
  Policy* policy = self->engine->policy();
  return PyBool_FromLong(policy != nullptr && policy->has_retention());
}

PyObject* engine_advance_clock(PyObject* py_self, PyObject* arg) {
  EngineObject* self = self_of(py_self);
  int64_t ticks;
  bool huge;
  if (!ready(self) || !native_parse_count(arg, "ticks", &ticks, &huge)) return nullptr;
  if (huge || ticks > INT64_MAX / 2 - self->engine->clock()) {
    return native_raise(ErrorKind::kInvalidArgument, "ticks would overflow the clock");
  }
  return PyLong_FromLongLong(self->engine->advance_clock(ticks));
}

PyObject* engine_reference_counts(PyObject* py_self, PyObject* arg) {
  EngineObject* self = self_of(py_self);
  if (!ready(self) || !native_parse_ids(arg, self->engine->num_usable(), *self->ids, "block_ids")) {
    return nullptr;
  }
  const std::vector<int32_t>& ids = *self->ids;
  int32_t *active = nullptr, *paused = nullptr;
  PyObject* active_ids = native_new_block_ids(static_cast<Py_ssize_t>(ids.size()), &active);
  PyObject* paused_ids = native_new_block_ids(static_cast<Py_ssize_t>(ids.size()), &paused);
  if (!active_ids || !paused_ids) {
    Py_XDECREF(active_ids);
    Py_XDECREF(paused_ids);
    return nullptr;
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    active[i] = self->engine->active_refs(ids[i]);
    paused[i] = self->engine->paused_refs(ids[i]);
  }
  return Py_BuildValue("(NN)", active_ids, paused_ids);
}

PyObject* engine_describe_state(PyObject* py_self, PyObject* arg) {
  EngineObject* self = self_of(py_self);
  int32_t block_id;
  if (!ready(self) || !parse_one_id(self, arg, &block_id)) return nullptr;
  return PyUnicode_FromString(self->engine->describe_state(block_id));
}

}  // namespace prefixcache
