// Prefix reuse on prefixcache.engine._native.Engine: lookup, take_hit, acquire, register,
// and reading the registry (block_of, hash_of, registrations, registered_chains).

#include <cstdint>
#include <vector>

#include "module_engine.h"

namespace prefixcache {

PyObject* engine_lookup(PyObject* py_self, PyObject* arg) {
  EngineObject* self = self_of(py_self);
  if (!ready(self) || !native_parse_hashes(arg, *self->hashes, "block_hashes", false)) {
    return nullptr;
  }
  std::vector<int32_t>& found = *self->ids;
  found.resize(self->hashes->size());
  const size_t matched = self->engine->lookup(self->hashes->data(), self->hashes->size(),
                                              found.data());
  return native_block_ids(found.data(), matched);
}

FASTCALL(engine_take_hit) {
  static const char* const names[] = {"block_ids", "num_queried", "acquire"};
  EngineObject* self = self_of(py_self);
  PyObject* bound[3];
  if (!ready(self) || !native_bind_args("take_hit", args, nargs, kwnames, names, 3, 3, bound)) {
    return nullptr;
  }
  int64_t num_queried;
  bool huge, acquire;
  if (!native_parse_count(bound[1], "num_queried", &num_queried, &huge) ||
      !native_parse_flag(bound[2], "acquire", &acquire) ||
      !native_parse_ids(bound[0], self->engine->num_usable(), *self->ids, "block_ids")) {
    return nullptr;
  }
  if (huge) return native_raise(ErrorKind::kInvalidArgument, "num_queried is too large");
  GUARD(self->engine->take_hit(self->ids->data(), self->ids->size(), num_queried, acquire);)
  Py_RETURN_NONE;
}

PyObject* engine_acquire(PyObject* py_self, PyObject* arg) {
  EngineObject* self = self_of(py_self);
  if (!ready(self) || !native_parse_ids(arg, self->engine->num_usable(), *self->ids, "block_ids")) {
    return nullptr;
  }
  GUARD(self->engine->acquire(self->ids->data(), self->ids->size());)
  Py_RETURN_NONE;
}

FASTCALL(engine_register) {
  static const char* const names[] = {"block_ids", "block_hashes", "parent_hash"};
  EngineObject* self = self_of(py_self);
  PyObject* bound[3];
  if (!ready(self) || !native_bind_args("register", args, nargs, kwnames, names, 2, 3, bound)) {
    return nullptr;
  }
  if (!native_parse_ids(bound[0], self->engine->num_usable(), *self->ids, "block_ids") ||
      !native_parse_hashes(bound[1], *self->hashes, "block_hashes", true)) {
    return nullptr;
  }
  const size_t count = self->ids->size();
  if (self->hashes->size() != count) {
    return native_raise(ErrorKind::kInvalidArgument,
                        std::to_string(count) + " block IDs but " +
                            std::to_string(self->hashes->size()) + " hashes");
  }
  bool has_parent = bound[2] && bound[2] != Py_None;
  int64_t parent_hash = 0;
  if (has_parent) {
    int overflow = 0;
    if (PyBool_Check(bound[2]) || !PyLong_Check(bound[2])) {
      return native_raise(ErrorKind::kInvalidArgument, "parent_hash must be an int or None");
    }
    parent_hash = PyLong_AsLongLongAndOverflow(bound[2], &overflow);
    if (overflow) {
      return native_raise(ErrorKind::kInvalidArgument,
                          "parent_hash is outside the signed 64-bit range");
    }
  }
  PyObject* holds = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(count));
  PyObject* fresh = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(count));
  if (!holds || !fresh) {
    Py_XDECREF(holds);
    Py_XDECREF(fresh);
    return nullptr;
  }
  try {
    PolicyTransaction transaction(self->engine, self->checkpoint);
    self->engine->register_chain(self->ids->data(), self->hashes->data(), count, has_parent,
                                 parent_hash,
                                 reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(holds)),
                                 reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(fresh)));
    transaction.commit();
  } catch (const EngineError& error) {
    Py_DECREF(holds);
    Py_DECREF(fresh);
    return native_raise(error.kind, error.message);
  } catch (const std::bad_alloc&) {
    Py_DECREF(holds);
    Py_DECREF(fresh);
    return PyErr_NoMemory();
  }
  return Py_BuildValue("(NN)", holds, fresh);
}


PyObject* engine_block_of(PyObject* py_self, PyObject* arg) {
  EngineObject* self = self_of(py_self);
  if (!ready(self)) return nullptr;
  if (PyBool_Check(arg) || !PyLong_Check(arg)) {
    return native_raise(ErrorKind::kInvalidArgument, "block_hash must be an int");
  }
  int overflow = 0;
  const long long value = PyLong_AsLongLongAndOverflow(arg, &overflow);
  const int32_t block_id = overflow || value == 0 ? -1 : self->engine->block_of(value);
  if (block_id < 0) Py_RETURN_NONE;
  return PyLong_FromLong(block_id);
}

PyObject* engine_hash_of(PyObject* py_self, PyObject* arg) {
  EngineObject* self = self_of(py_self);
  int32_t block_id;
  if (!ready(self) || !parse_one_id(self, arg, &block_id)) return nullptr;
  const int64_t block_hash = self->engine->hash_of(block_id);
  if (block_hash == 0) Py_RETURN_NONE;
  return PyLong_FromLongLong(block_hash);
}

PyObject* engine_registrations(PyObject* py_self, PyObject* arg) {
  // int64 generations as bytes (the wrapper views them with numpy): 0 where unregistered.
  EngineObject* self = self_of(py_self);
  if (!ready(self) || !native_parse_ids(arg, self->engine->num_usable(), *self->ids, "block_ids")) {
    return nullptr;
  }
  const std::vector<int32_t>& ids = *self->ids;
  PyObject* out = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(8 * ids.size()));
  if (!out) return nullptr;
  int64_t* generations = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(out));
  for (size_t i = 0; i < ids.size(); ++i) generations[i] = self->engine->registration_of(ids[i]);
  return out;
}

PyObject* engine_registered_chains(PyObject* py_self, PyObject*) {
  EngineObject* self = self_of(py_self);
  if (!ready(self)) return nullptr;
  const Engine& engine = *self->engine;
  std::vector<int32_t> blocks;
  GUARD(blocks = engine.registered_in_order();)
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(blocks.size()));
  if (!list) return nullptr;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int32_t parent_id = engine.parent_of(blocks[i]);
    PyObject* pair =
        parent_id == kRoot
            ? Py_BuildValue("(LO)", static_cast<long long>(engine.hash_of(blocks[i])), Py_None)
            : Py_BuildValue("(LL)", static_cast<long long>(engine.hash_of(blocks[i])),
                            static_cast<long long>(engine.hash_of(parent_id)));
    if (!pair) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), pair);
  }
  return list;
}

}  // namespace prefixcache
