// PythonPolicy: a policy object written in Python (the EvictionPolicy contract) as a native
// Policy unit, so that a third-party policy runs on the native engine (DESIGN.md, "Native
// policies"). The engine keeps its state natively and calls the object's methods where it
// calls a built-in policy, in the same order as the Python engine calls them.

#ifndef PREFIXCACHE_ENGINE_NATIVE_PYTHON_POLICY_H_
#define PREFIXCACHE_ENGINE_NATIVE_PYTHON_POLICY_H_

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <memory>

#include "policy.h"

namespace prefixcache {

/// ``object`` (an EvictionPolicy subclass instance) behind the Policy interface, for block IDs
/// below ``num_blocks``. ``hooks``: the names of the optional hooks it overrides (a tuple
/// of str, from policies.has_hook: "evicts_first", "on_register", "on_end", "on_hit"), the only ones
/// called.
/// Returns null with a Python error set when a method is missing.
std::unique_ptr<Policy> make_python_policy(PyObject* object, int32_t num_blocks,
                                           PyObject* hooks);

}  // namespace prefixcache

#endif  // PREFIXCACHE_ENGINE_NATIVE_PYTHON_POLICY_H_
