// What the vLLM plugin's native code reads and writes of a vLLM block (vllm_queue.h's
// vllm_block namespace).
//
// vLLM 0.33's KVCacheBlock is a ``@dataclass(slots=True)``: ``block_id``, ``ref_cnt``,
// ``is_null`` and ``_block_hash`` are ``__slots__`` member descriptors (``block_hash`` a
// property returning ``_block_hash``). Reading them through the generic C API (a type lookup,
// the descriptor's get, a new reference) costs a few tens of ns per read, and the queue reads
// several per block on vLLM's serving path, where vLLM's own queue reads none. So for that
// type, recognised once (exactly vLLM's class, generic attribute access, each name a
// writable object member of this very type), the slots are read and written at their
// offsets: the same objects the descriptors would return and store, with the same reference
// counts. A value the fast path does not cover (an empty slot, a ref_cnt or block_id that
// is not an exact int, an is_null that is not a bool) and any other type (a subclass, a
// stand-in) take the generic path, whose result and errors are vLLM's.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <cstring>
#include <initializer_list>
#include <utility>

#include "vllm_queue.h"
#include "xxh3.h"

namespace prefixcache {
namespace {

constexpr uint64_t kMask63 = (uint64_t{1} << 63) - 1;
PyObject* g_block_id = nullptr;  // interned attribute names
PyObject* g_block_hash = nullptr;
PyObject* g_is_null = nullptr;
PyObject* g_ref_cnt = nullptr;
PyObject* g_unpinned = nullptr;
PyObject* g_block_hash_slot = nullptr;
PyObject* g_vllm_prefix = nullptr;

/// Whether ``type``'s version tag is valid (assigning to the type invalidates it).
bool tagged(PyTypeObject* type) {
#ifdef Py_TPFLAGS_VALID_VERSION_TAG
  return (type->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) != 0;
#else
  return type->tp_version_tag != 0;
#endif
}

/// Where vLLM's KVCacheBlock keeps each attribute read here (-1: read it generically).
struct Layout {
  PyTypeObject* type = nullptr;  // the type these offsets are of (a strong reference)
  unsigned int version = 0;      // its version tag then (a change to the type changes it)
  Py_ssize_t block_id = -1, ref_cnt = -1, is_null = -1, block_hash = -1;
};
Layout g_layout;

/// The offset of ``name``'s slot in instances of ``type``: a writable object member
/// (``__slots__``) defined by ``type`` itself and found first in its MRO; -1 otherwise.
Py_ssize_t slot_offset(PyTypeObject* type, PyObject* name) {
  PyObject* found = _PyType_Lookup(type, name);  // borrowed
  if (!found || Py_TYPE(found) != &PyMemberDescr_Type) return -1;
  auto* member = reinterpret_cast<PyMemberDescrObject*>(found);
  const PyMemberDef* def = member->d_member;
  if (member->d_common.d_type != type || def->type != T_OBJECT_EX || (def->flags & READONLY) ||
      def->offset < static_cast<Py_ssize_t>(sizeof(PyObject)) ||
      def->offset + static_cast<Py_ssize_t>(sizeof(PyObject*)) > type->tp_basicsize) {
    return -1;
  }
  return def->offset;
}

/// Whether ``found`` is vLLM's ``block_hash`` property: a plain property whose getter is a
/// Python function of one argument that reads the one name ``_block_hash``.
bool returns_hash_slot(PyObject* found) {
  if (!found || Py_TYPE(found) != &PyProperty_Type) return false;
  PyObject* getter = PyObject_GetAttrString(found, "fget");
  const bool plain = getter && PyFunction_Check(getter);
  const auto* code = plain ? reinterpret_cast<PyCodeObject*>(PyFunction_GET_CODE(getter)) : nullptr;
  const bool reads = code && code->co_argcount == 1 && PyTuple_GET_SIZE(code->co_names) == 1 &&
                     PyUnicode_Compare(PyTuple_GET_ITEM(code->co_names, 0), g_block_hash_slot) == 0;
  Py_XDECREF(getter);
  PyErr_Clear();
  return reads;
}

/// Whether ``type`` is vLLM's KVCacheBlock with generic attribute access (no
/// ``__getattribute__``/``__setattr__`` of its own, no instance dict to shadow a slot).
bool vllm_block_type(PyTypeObject* type) {
  if (std::strcmp(type->tp_name, "KVCacheBlock") != 0 ||
      type->tp_getattro != PyObject_GenericGetAttr ||
      type->tp_setattro != PyObject_GenericSetAttr || type->tp_dictoffset != 0) {
    return false;
  }
  PyObject* module = PyDict_GetItemString(type->tp_dict, "__module__");  // borrowed
  return module && PyUnicode_Check(module) &&
         PyUnicode_Tailmatch(module, g_vllm_prefix, 0, PY_SSIZE_T_MAX, -1) == 1;
}

/// The slot layout for ``type``: vLLM's KVCacheBlock's offsets, or nullptr (generic reads).
/// The last type found is kept (a reloaded vLLM: the newest) while its version tag stands:
/// assigning to one of its attributes (or a base's) invalidates the tag, and the type is
/// looked at again.
const Layout* layout_of(PyTypeObject* type) {
  if (type == g_layout.type && g_layout.version != 0 && tagged(type) &&
      type->tp_version_tag == g_layout.version) {
    return &g_layout;
  }
  if (!vllm_block_type(type)) return nullptr;
  Layout layout;
  layout.block_id = slot_offset(type, g_block_id);
  layout.ref_cnt = slot_offset(type, g_ref_cnt);
  layout.is_null = slot_offset(type, g_is_null);
  if (returns_hash_slot(_PyType_Lookup(type, g_block_hash))) {
    layout.block_hash = slot_offset(type, g_block_hash_slot);
  }
  Py_INCREF(type);
  layout.type = type;  // the lookups above gave it a version tag, unless none was left
  layout.version = tagged(type) ? type->tp_version_tag : 0;
  PyTypeObject* old = g_layout.type;
  g_layout = layout;
  Py_XDECREF(old);
  return &g_layout;
}

/// The object in ``block``'s slot at ``offset`` (borrowed; nullptr: empty), or nullptr when
/// the type has no such slot (offset -1).
PyObject* slot(PyObject* block, Py_ssize_t offset) {
  if (offset < 0) return nullptr;
  return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(block) + offset);
}

/// ``block.<name>`` as a long long through the generic API (false with an error set).
bool generic_long(PyObject* block, PyObject* name, long long* out) {
  PyObject* value = PyObject_GetAttr(block, name);
  if (!value) return false;
  *out = PyLong_AsLongLong(value);
  Py_DECREF(value);
  return !(*out == -1 && PyErr_Occurred());
}

/// The slot at ``offset`` (-1: none) read as a long long when it holds an exact int, else
/// ``block.<name>`` read generically (false with an error set).
bool read_long(PyObject* block, Py_ssize_t offset, PyObject* name, long long* out) {
  PyObject* value = slot(block, offset);
  if (!value || !PyLong_CheckExact(value)) return generic_long(block, name, out);
  *out = PyLong_AsLongLong(value);  // an exact int: no Python code runs
  return !(*out == -1 && PyErr_Occurred());
}

}  // namespace

namespace vllm_block {

bool intern_names(std::initializer_list<std::pair<PyObject**, const char*>> names) {
  for (const auto& [slot, text] : names) {
    if (!*slot && !(*slot = PyUnicode_InternFromString(text))) return false;
  }
  return true;
}

bool ready() {
  return intern_names({{&g_block_id, "block_id"},
                       {&g_block_hash, "block_hash"},
                       {&g_is_null, "is_null"},
                       {&g_ref_cnt, "ref_cnt"},
                       {&g_unpinned, "unpinned"},
                       {&g_block_hash_slot, "_block_hash"},
                       {&g_vllm_prefix, "vllm."}});
}

bool policy_hash(PyObject* key, int64_t* out) {
  if (PyBytes_Check(key)) {
    const uint64_t h = xxh3_64(PyBytes_AS_STRING(key), static_cast<size_t>(PyBytes_GET_SIZE(key)));
    *out = static_cast<int64_t>(h & kMask63);
    return true;
  }
  const Py_hash_t h = PyObject_Hash(key);
  if (h == -1 && PyErr_Occurred()) return false;
  *out = static_cast<int64_t>(static_cast<uint64_t>(h) & kMask63);
  return true;
}

PyObject* unpinned_key(int32_t id) { return Py_BuildValue("(Oi)", g_unpinned, id); }

bool is_null(PyObject* block, bool* out) {
  const Layout* layout = layout_of(Py_TYPE(block));
  PyObject* value = layout ? slot(block, layout->is_null) : nullptr;
  if (value == Py_True || value == Py_False) {
    *out = value == Py_True;
    return true;
  }
  value = PyObject_GetAttr(block, g_is_null);
  if (!value) return false;
  const int truth = PyObject_IsTrue(value);
  Py_DECREF(value);
  if (truth < 0) return false;
  *out = truth != 0;
  return true;
}

PyObject* hash_key(PyObject* block) {
  const Layout* layout = layout_of(Py_TYPE(block));
  PyObject* value = layout ? slot(block, layout->block_hash) : nullptr;
  return value ? Py_NewRef(value) : PyObject_GetAttr(block, g_block_hash);
}

bool cacheable(PyObject* block, bool* out, PyObject** key) {
  bool null;
  if (!is_null(block, &null)) return false;
  *key = hash_key(block);
  if (!*key) return false;
  *out = !null && *key != Py_None;
  return true;
}

bool raw_id(PyObject* block, long long* out) {
  const Layout* layout = layout_of(Py_TYPE(block));
  return read_long(block, layout ? layout->block_id : -1, g_block_id, out);
}

bool ref_cnt(PyObject* block, long long* out) {
  const Layout* layout = layout_of(Py_TYPE(block));
  return read_long(block, layout ? layout->ref_cnt : -1, g_ref_cnt, out);
}

bool set_ref_cnt(PyObject* block, long value) {
  PyObject* number = PyLong_FromLong(value);
  if (!number) return false;
  const Layout* layout = layout_of(Py_TYPE(block));
  if (!layout || layout->ref_cnt < 0) {
    const int set = PyObject_SetAttr(block, g_ref_cnt, number);
    Py_DECREF(number);
    return set == 0;
  }
  // What the member descriptor's set does: store the new reference, then drop the old one
  // (last: its deallocation may run code that reads the block).
  auto** field = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(block) + layout->ref_cnt);
  PyObject* old = *field;
  *field = number;
  Py_XDECREF(old);
  return true;
}

bool uses_slots(PyTypeObject* type) {
  const Layout* layout = layout_of(type);
  return layout && layout->block_id >= 0 && layout->ref_cnt >= 0 && layout->is_null >= 0 &&
         layout->block_hash >= 0;
}

}  // namespace vllm_block
}  // namespace prefixcache
