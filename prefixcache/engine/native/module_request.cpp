// The fused request path of prefixcache.engine._native.Engine: admit_request (hash the
// full blocks, match, pin, evict, allocate, register, write the block-table row in one
// call) and hash_tokens (a chain of block hashes, from the root or from a parent).

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "block_hashing.h"
#include "module_engine.h"

namespace prefixcache {

bool native_parse_tokens(EngineObject* self, PyObject* obj, Tokens* out) {
  std::vector<int32_t>& narrowed = *self->tokens;
  auto outside = [](int64_t value) {
    native_raise(ErrorKind::kInvalidArgument,
                 "token " + std::to_string(value) + " is outside the int32 range");
    return false;
  };
  if (PyList_Check(obj) || PyTuple_Check(obj)) {
    const Py_ssize_t size = PySequence_Fast_GET_SIZE(obj);
    PyObject** items = PySequence_Fast_ITEMS(obj);
    narrowed.resize(static_cast<size_t>(size));
    for (Py_ssize_t i = 0; i < size; ++i) {
      int overflow = 0;
      long long value = 0;
      if (!native_list_int(items[i], &value, &overflow)) {
        native_raise(ErrorKind::kInvalidArgument, "tokens must be ints");
        return false;
      }
      if (overflow || value < INT32_MIN || value > INT32_MAX) {
        return outside(overflow ? INT64_MAX : value);
      }
      narrowed[i] = static_cast<int32_t>(value);
    }
    out->data = narrowed.data();
    out->count = narrowed.size();
    return true;
  }
  PyObject* source = native_buffer_source(obj, "tokens");
  if (!source) {
    if (!PyErr_Occurred()) {
      native_raise(ErrorKind::kInvalidArgument,
                   std::string("tokens must be a 1-D integer array or a list of ints, got ") +
                       Py_TYPE(obj)->tp_name);
    }
    return false;
  }
  bool is_signed;
  const bool got = native_int_buffer(source, &out->view, false, "tokens", &is_signed);
  Py_DECREF(source);  // the view keeps its exporter alive
  if (!got) return false;
  out->holds_view = true;
  const Py_ssize_t size = out->view.shape[0];
  if (out->view.itemsize == 4 && is_signed) {  // int32 tokens: hashed in place
    out->data = static_cast<const int32_t*>(out->view.buf);
    out->count = static_cast<size_t>(size);
    return true;
  }
  bool ok = true;
  narrowed.resize(static_cast<size_t>(size));
  for (Py_ssize_t i = 0; i < size; ++i) {
    bool too_big = false;
    const int64_t value =
        native_element(out->view.buf, i, out->view.itemsize, is_signed, &too_big);
    if (too_big || value < INT32_MIN || value > INT32_MAX) {
      ok = outside(too_big ? INT64_MAX : value);
      break;
    }
    narrowed[i] = static_cast<int32_t>(value);
  }
  out->release();
  out->data = narrowed.data();
  out->count = narrowed.size();
  return ok;
}

FASTCALL(engine_admit_request) {
  static const char* const names[] = {"tokens", "out_row"};
  EngineObject* self = self_of(py_self);
  PyObject* bound[2];
  if (!ready(self) ||
      !native_bind_args("admit_request", args, nargs, kwnames, names, 2, 2, bound)) {
    return nullptr;
  }
  // out_row first, then tokens into the scratch buffer. A conversion may run Python code
  // (a tensor's numpy()); the CallGuard refuses any call back into this engine, so the
  // scratch buffer and the engine stay as this call left them.
  PyObject* source = native_buffer_source(bound[1], "out_row");
  if (!source) {
    if (!PyErr_Occurred()) {
      native_raise(ErrorKind::kInvalidTensor, std::string("out_row must be an int32 array, got ") +
                                                  Py_TYPE(bound[1])->tp_name);
    }
    return nullptr;
  }
  Py_buffer row;
  bool is_signed;
  const bool got = native_int_buffer(source, &row, true, "out_row", &is_signed);
  Py_DECREF(source);
  if (!got) return nullptr;
  Tokens parsed;
  if (!native_parse_tokens(self, bound[0], &parsed)) {
    PyBuffer_Release(&row);
    return nullptr;
  }
  const int32_t* tokens = parsed.data;
  const size_t num_tokens = parsed.count;
  const size_t block_size = static_cast<size_t>(self->block_size);
  const size_t num_full = num_tokens / block_size;
  const size_t num_blocks = (num_tokens + block_size - 1) / block_size;
  const size_t num_matchable = num_tokens ? (num_tokens - 1) / block_size : 0;
  if (row.itemsize != 4 || !is_signed) {
    PyBuffer_Release(&row);
    return native_raise(ErrorKind::kInvalidTensor, "out_row must be an int32 array");
  }
  if (static_cast<size_t>(row.shape[0]) < num_blocks) {
    const Py_ssize_t length = row.shape[0];
    PyBuffer_Release(&row);
    return native_raise(ErrorKind::kInvalidArgument,
                        "out_row holds " + std::to_string(length) + " IDs; the request needs " +
                            std::to_string(num_blocks));
  }
  std::vector<int64_t>& hashes = *self->hashes;
  int64_t num_hit = 0;
  int32_t* out = static_cast<int32_t*>(row.buf);
  std::vector<int32_t> saved;  // a Python policy can fail after the row is written
  try {
    if (self->checkpoint) saved.assign(out, out + num_blocks);
    hashes.resize(num_full);
    chain_block_hashes(tokens, num_tokens, block_size, self->root,
                       reinterpret_cast<uint64_t*>(hashes.data()));
    PolicyTransaction transaction(self->engine, self->checkpoint);
    num_hit = self->engine->admit(hashes.data(), num_full, num_matchable, num_blocks, out);
    transaction.commit();
  } catch (const EngineError& error) {
    std::copy(saved.begin(), saved.end(), out);  // the row as it was
    PyBuffer_Release(&row);
    return native_raise(error.kind, error.message);
  } catch (const std::bad_alloc&) {
    PyBuffer_Release(&row);
    return PyErr_NoMemory();
  }
  PyBuffer_Release(&row);
  return PyLong_FromLongLong(num_hit);
}

// hash_tokens(tokens, parent=None): the chained hashes of the full blocks of ``tokens``,
// from the engine's root, or continuing the chain whose last hash is ``parent`` (a
// session's next turn hashes only its new tokens).
FASTCALL(engine_hash_tokens) {
  static const char* const names[] = {"tokens", "parent"};
  EngineObject* self = self_of(py_self);
  PyObject* bound[2];
  if (!ready(self) ||
      !native_bind_args("hash_tokens", args, nargs, kwnames, names, 1, 2, bound)) {
    return nullptr;
  }
  uint64_t seed = self->root;
  if (bound[1] && bound[1] != Py_None) {
    int overflow = 0;
    long long value = 0;
    if (!native_list_int(bound[1], &value, &overflow) || overflow || value < 1) {
      return native_raise(ErrorKind::kInvalidArgument,
                          "parent must be a block hash, an int in [1, 2**63 - 1]");
    }
    seed = static_cast<uint64_t>(value);
  }
  Tokens parsed;
  if (!native_parse_tokens(self, bound[0], &parsed)) return nullptr;
  const int32_t* tokens = parsed.data;
  const size_t num_tokens = parsed.count;
  const size_t num_full = num_tokens / static_cast<size_t>(self->block_size);
  std::vector<int64_t>& hashes = *self->hashes;
  hashes.resize(num_full);
  chain_block_hashes(tokens, num_tokens, static_cast<size_t>(self->block_size), seed,
                     reinterpret_cast<uint64_t*>(hashes.data()));
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(num_full));
  if (!list) return nullptr;
  for (size_t i = 0; i < num_full; ++i) {
    PyObject* item = PyLong_FromLongLong(hashes[i]);
    if (!item) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
  }
  return list;
}

}  // namespace prefixcache
