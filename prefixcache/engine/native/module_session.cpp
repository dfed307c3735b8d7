// prefixcache.engine._native.Session: a SessionState (session.h) bound to one Engine object.
//
// Session(engine) opens a conversation on ``engine``; admit(tokens), append(tokens) and
// release() are one native call each (the facade's open_session returns this object on the
// fused path; DESIGN.md, "Sessions"). Every call runs behind the engine's CallGuard: it
// uses the engine's scratch buffers and state, so Python code run while the tokens are read
// cannot call back into the engine (ReentrantCallError, nothing changed). The session keeps
// its engine alive; an engine re-initialised after the session opened is refused.

#include <cstdint>
#include <new>
#include <string>
#include <vector>

#include "module_engine.h"
#include "session.h"

namespace prefixcache {
namespace {

struct SessionObject {
  PyObject_HEAD
  EngineObject* engine;  // a strong reference
  SessionState* state;
  int64_t num_inits;  // the engine's __init__ count when the session opened
};

SessionObject* session_of(PyObject* py_self) { return reinterpret_cast<SessionObject*>(py_self); }

PyObject* not_initialised() {
  PyErr_SetString(PyExc_RuntimeError, "native Session not initialised");
  return nullptr;
}

// The session's engine when it may run: initialised, the one it opened on, not busy (the
// guard, held by the caller, says so).
Engine* engine_of(SessionObject* self) {
  if (!self->state) {
    not_initialised();
    return nullptr;
  }
  if (!ready(self->engine)) return nullptr;
  if (self->engine->num_inits != self->num_inits) {
    native_raise(ErrorKind::kBlockState,
                 "the engine was re-initialised after this session opened; open a new one");
    return nullptr;
  }
  return self->engine->engine;
}

int session_init(PyObject* py_self, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"engine", nullptr};
  PyObject* engine = nullptr;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!:Session", const_cast<char**>(names),
                                   native_engine_type(), &engine)) {
    return -1;
  }
  EngineObject* owner = reinterpret_cast<EngineObject*>(engine);
  if (!ready(owner)) return -1;
  SessionObject* self = session_of(py_self);
  if (self->state && self->state->running()) {  // its blocks would stay referenced
    native_raise(ErrorKind::kBlockState, "a turn of this session is running; release() it first");
    return -1;
  }
  SessionState* state;
  try {
    state = new SessionState(static_cast<size_t>(owner->block_size), owner->root);
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
    return -1;
  }
  delete self->state;
  self->state = state;
  Py_INCREF(engine);
  Py_XSETREF(self->engine, owner);
  self->num_inits = owner->num_inits;
  return 0;
}

void session_dealloc(PyObject* py_self) {
  SessionObject* self = session_of(py_self);
  delete self->state;
  Py_XDECREF(self->engine);
  Py_TYPE(py_self)->tp_free(py_self);
}

// Runs ``body(self, engine)`` as every call that uses the engine must: the session
// initialised, the engine's CallGuard held for the whole call (no re-entry), the engine
// the one it opened on (engine_of). ``body`` returns a new reference, or nullptr with an
// error set; an EngineError or bad_alloc it throws becomes the library's Python error.
template <typename Body>
PyObject* with_engine(PyObject* py_self, Body body) {
  SessionObject* self = session_of(py_self);
  if (!self->engine) return not_initialised();
  CallGuard guard(&self->engine->busy);
  if (!guard.admitted()) return nullptr;
  Engine* engine = engine_of(self);
  if (!engine) return nullptr;
  try {
    return body(self, *engine);
  } catch (const EngineError& error) {
    return native_raise(error.kind, error.message);
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
}

// An int argument in [minimum, maximum] (maximum < 0: none), refused as the Python
// Session's require_int words it (the differential tests compare messages).
bool index_arg(PyObject* arg, const char* name, long long minimum, long long maximum,
               long long* out) {
  int overflow = 0;
  const long long value = PyLong_Check(arg) && !PyBool_Check(arg)
                              ? PyLong_AsLongLongAndOverflow(arg, &overflow)
                              : minimum - 1;
  if (value == -1 && PyErr_Occurred()) return false;
  if (!overflow && value >= minimum && (maximum < 0 || value <= maximum)) {
    *out = value;
    return true;
  }
  PyObject* repr = PyObject_Repr(arg);
  if (!repr) return false;
  const char* shown = PyUnicode_AsUTF8(repr);
  std::string bounds = maximum < 0 ? "an int >= " + std::to_string(minimum)
                                   : "an int in [" + std::to_string(minimum) + ", " +
                                         std::to_string(maximum) + "]";
  std::string message = std::string(name) + " must be " + bounds + ", got " + (shown ? shown : "?");
  Py_DECREF(repr);
  native_raise(ErrorKind::kInvalidArgument, message);
  return false;
}

// admit(tokens, reserve=0) and append(tokens): the running check, then the tokens, then the
// step (reserve: tokens more admit's capacity check covers, checked before the tokens).
PyObject* session_step(PyObject* py_self, PyObject* arg, PyObject* reserve_arg, bool admit) {
  return with_engine(py_self, [arg, reserve_arg, admit](SessionObject* self,
                                                       Engine& engine) -> PyObject* {
    self->state->expect_running(!admit);
    long long reserve = 0;
    if (reserve_arg && !index_arg(reserve_arg, "reserve", 0, -1, &reserve)) return nullptr;
    Tokens tokens;
    if (!native_parse_tokens(self->engine, arg, &tokens)) return nullptr;
    if (!tokens.count) {
      return native_raise(ErrorKind::kInvalidArgument,
                          "a turn or an append needs at least one token");
    }
    if (admit) {
      return PyLong_FromLongLong(self->state->admit_reserving(
          engine, self->engine->layout_epoch, tokens.data, tokens.count,
          static_cast<size_t>(reserve)));
    }
    self->state->append(engine, tokens.data, tokens.count);
    Py_RETURN_NONE;
  });
}

PyObject* session_admit(PyObject* py_self, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"tokens", "reserve", nullptr};
  PyObject* tokens = nullptr;
  PyObject* reserve = nullptr;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|$O:admit", const_cast<char**>(names),
                                   &tokens, &reserve)) {
    return nullptr;
  }
  return session_step(py_self, tokens, reserve, true);
}

PyObject* session_append(PyObject* py_self, PyObject* arg) {
  return session_step(py_self, arg, nullptr, false);
}

// block_ids_from(first): the running turn's row from block ``first`` on (a BlockIds copy of
// that part only). chain_hashes(first=0, stop=None): the conversation's full blocks' chained
// hashes first..stop-1. What a tiered session reads after each step (O(what it asks for)).
PyObject* session_block_ids_from(PyObject* py_self, PyObject* arg) {
  SessionObject* self = session_of(py_self);
  if (!self->state) return not_initialised();
  const SessionState& state = *self->state;
  long long first = 0;
  if (!index_arg(arg, "first", 0, static_cast<long long>(state.num_held()), &first)) {
    return nullptr;
  }
  return native_block_ids(state.ids() + first, state.num_held() - static_cast<size_t>(first));
}

PyObject* session_chain_hashes(PyObject* py_self, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"first", "stop", nullptr};
  PyObject* first_arg = nullptr;
  PyObject* stop_arg = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|OO:chain_hashes", const_cast<char**>(names),
                                   &first_arg, &stop_arg)) {
    return nullptr;
  }
  SessionObject* self = session_of(py_self);
  if (!self->state) return not_initialised();
  const std::vector<int64_t>& hashes = self->state->hashes();
  long long stop = static_cast<long long>(hashes.size());
  if (stop_arg != Py_None && !index_arg(stop_arg, "stop", 0, stop, &stop)) return nullptr;
  long long first = 0;
  if (first_arg && !index_arg(first_arg, "first", 0, stop, &first)) return nullptr;
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(stop - first));
  if (!list) return nullptr;
  for (long long i = first; i < stop; ++i) {
    PyObject* value = PyLong_FromLongLong(hashes[static_cast<size_t>(i)]);
    if (!value) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i - first), value);
  }
  return list;
}

// turn(tokens, response, start=0): admit(tokens[start:]), append(response) and release() in
// one call (one crossing, one guard, no slice object). The response is read first and
// copied (a list's tokens share the engine's scratch with the prompt's), then the prompt;
// every check precedes the first engine write.
PyObject* session_turn(PyObject* py_self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 && nargs != 3) {
    PyErr_Format(PyExc_TypeError, "turn() takes 2 or 3 arguments (tokens, response, start), "
                 "%zd given", nargs);
    return nullptr;
  }
  long long start = 0;
  if (nargs == 3) {
    start = PyLong_AsLongLong(args[2]);
    if (start == -1 && PyErr_Occurred()) return nullptr;
  }
  return with_engine(py_self, [args, start](SessionObject* self, Engine& engine) -> PyObject* {
    self->state->expect_running(false);
    std::vector<int32_t>& reply = self->state->reply();
    {
      Tokens response;
      if (!native_parse_tokens(self->engine, args[1], &response)) return nullptr;
      reply.assign(response.data, response.data + response.count);
    }
    if (reply.empty()) {
      return native_raise(ErrorKind::kInvalidArgument,
                          "a turn or an append needs at least one token");
    }
    Tokens tokens;
    if (!native_parse_tokens(self->engine, args[0], &tokens)) return nullptr;
    if (start < 0 || static_cast<unsigned long long>(start) > tokens.count) {
      return native_raise(ErrorKind::kInvalidArgument,
                          "start " + std::to_string(start) + " is outside the " +
                              std::to_string(tokens.count) + " tokens");
    }
    const size_t first = static_cast<size_t>(start);
    if (first == tokens.count) {
      return native_raise(ErrorKind::kInvalidArgument,
                          "a turn or an append needs at least one token");
    }
    return PyLong_FromLongLong(self->state->turn(engine, self->engine->layout_epoch,
                                                 tokens.data + first, tokens.count - first,
                                                 reply.data(), reply.size()));
  });
}

PyObject* session_release(PyObject* py_self, PyObject*) {
  return with_engine(py_self, [](SessionObject* self, Engine& engine) -> PyObject* {
    self->state->release(engine, self->engine->layout_epoch);
    Py_RETURN_NONE;
  });
}

PyObject* session_end(PyObject* py_self, PyObject*) {
  return with_engine(py_self, [](SessionObject* self, Engine& engine) -> PyObject* {
    return PyLong_FromLongLong(self->state->end(engine));
  });
}

// Getters read the state only (no engine call): no guard needed.
PyObject* session_read(PyObject* py_self, int which) {
  SessionObject* self = session_of(py_self);
  if (!self->state) return not_initialised();
  const SessionState& state = *self->state;
  switch (which) {
    case 0:
      return PyLong_FromLongLong(state.num_tokens());
    case 1:
      return PyBool_FromLong(state.running());
    case 2:
      return native_block_ids(state.ids(), state.num_held());
    case 3:
      return PyLong_FromLongLong(state.num_hashed_tokens());
    default:
      return PyLong_FromLongLong(state.num_looked_up());
  }
}

PyObject* get_num_tokens(PyObject* self, void*) { return session_read(self, 0); }
PyObject* get_running(PyObject* self, void*) { return session_read(self, 1); }
PyObject* get_block_ids(PyObject* self, void*) { return session_read(self, 2); }
PyObject* get_num_hashed_tokens(PyObject* self, void*) { return session_read(self, 3); }
PyObject* get_num_looked_up(PyObject* self, void*) { return session_read(self, 4); }

PyGetSetDef g_session_getset[] = {
    {"num_tokens", get_num_tokens, nullptr, "Tokens of the conversation so far.", nullptr},
    {"running", get_running, nullptr, "Whether a turn holds blocks.", nullptr},
    {"block_ids", get_block_ids, nullptr,
     "The running turn's block table row (a BlockIds copy of the session's row).", nullptr},
    {"num_hashed_tokens", get_num_hashed_tokens, nullptr,
     "Tokens hashed so far (each turn's new tokens and its partial block's).", nullptr},
    {"num_looked_up", get_num_looked_up, nullptr, "Hashes looked up so far.", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyMethodDef g_session_methods[] = {
    {"admit", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(session_admit)),
     METH_VARARGS | METH_KEYWORDS,
     "admit(tokens, *, reserve=0) -> blocks served from the cache (reserve: tokens more the "
     "capacity check covers)"},
    {"block_ids_from", session_block_ids_from, METH_O,
     "block_ids_from(first) -> the running turn's row from block first on"},
    {"chain_hashes",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(session_chain_hashes)),
     METH_VARARGS | METH_KEYWORDS,
     "chain_hashes(first=0, stop=None) -> the full blocks' chained hashes first..stop-1"},
    {"append", session_append, METH_O, "append(tokens): decoded tokens of the running turn"},
    {"release", session_release, METH_NOARGS, "release(): end the running turn"},
    {"turn", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(session_turn)),
     METH_FASTCALL,
     "turn(tokens, response, start=0) -> blocks served from the cache: admit(tokens[start:]), "
     "append(response), release() in one call"},
    {"end", session_end, METH_NOARGS,
     "end() -> blocks freed: the conversation ended; free its own cached blocks, start over"},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject g_session_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

}  // namespace

bool add_session_type(PyObject* module) {
  g_session_type.tp_name = "prefixcache.engine._native.Session";
  g_session_type.tp_basicsize = sizeof(SessionObject);
  g_session_type.tp_flags = Py_TPFLAGS_DEFAULT;
  g_session_type.tp_doc =
      "Session(engine): a conversation's chain between turns on the fused path "
      "(prefixcache.engine.sessions.Session is the reference).";
  g_session_type.tp_new = PyType_GenericNew;
  g_session_type.tp_init = session_init;
  g_session_type.tp_dealloc = session_dealloc;
  g_session_type.tp_methods = g_session_methods;
  g_session_type.tp_getset = g_session_getset;
  if (PyType_Ready(&g_session_type) < 0) return false;
  Py_INCREF(&g_session_type);
  if (PyModule_AddObject(module, "Session", reinterpret_cast<PyObject*>(&g_session_type)) < 0) {
    Py_DECREF(&g_session_type);
    return false;
  }
  return true;
}

}  // namespace prefixcache
