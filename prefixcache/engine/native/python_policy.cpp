// PythonPolicy (see python_policy.h): each Policy call is one call of the object's method.
//
// A hook that raises leaves its exception as the pending Python error and throws
// EngineError{kPolicyRaised}; the engine call then fails as one transaction
// (engine_checkpoint.h): the engine's state is restored and the object's abort() called, and
// the binding returns the exception to the caller. The object's transaction opens lazily, on
// the first call of an engine call that reaches it, as the Python engine's journal opens it
// for each operation that calls the policy (DESIGN.md, "The transaction rule").
//
// The adapter keeps the set of tracked blocks itself (what the engine inserted and did not
// discard or take as a victim), so size() and contains() cost no Python call and a victim
// the object returns is checked as the Python planner checks it: one cached leaf, else
// InvariantError. Requires the GIL (every engine call holds it).

#include "python_policy.h"

#include <initializer_list>
#include <string>
#include <vector>

#include "engine.h"

namespace prefixcache {

namespace {

[[noreturn]] void raised() { throw EngineError{ErrorKind::kPolicyRaised, std::string()}; }

class PythonPolicy final : public Policy {
 public:
  PythonPolicy(PyObject* object, int32_t num_blocks)
      : object_(object), tracked_(static_cast<size_t>(num_blocks), 0) {
    Py_INCREF(object_);
  }
  ~PythonPolicy() override {
    Py_DECREF(object_);
    for (PyObject* method : methods_) Py_XDECREF(method);
  }
  PythonPolicy(const PythonPolicy&) = delete;
  PythonPolicy& operator=(const PythonPolicy&) = delete;

  bool bind_methods(PyObject* hooks) {
    static const char* const names[kNumMethods] = {
        "insert", "discard", "touch",  "evict",        "clear",       "relocate",
        "begin",  "commit",  "abort",  "evicts_first", "on_register", "on_end", "on_hit"};
    for (int i = 0; i < kNumMethods; ++i) {
      if (i >= kEvictsFirst) {  // optional: only an overridden hook is called
        PyObject* name = PyUnicode_FromString(names[i]);
        if (!name) return false;
        const int listed = PySequence_Contains(hooks, name);
        Py_DECREF(name);
        if (listed < 0) return false;
        if (!listed) continue;
      }
      methods_[i] = PyObject_GetAttrString(object_, names[i]);
      if (!methods_[i]) return false;
    }
    return true;
  }

  void insert(int32_t block_id, const LeafInfo& leaf) override {
    open();
    call(kInsert, {block_id, leaf.block_hash, leaf.last_access, leaf.num_accesses, leaf.depth});
    track(block_id, 1);
  }
  void discard(int32_t block_id) override {
    open();
    call(kDiscard, {block_id});
    track(block_id, 0);
  }
  void touch(int32_t block_id, int64_t now) override {
    open();
    call(kTouch, {block_id, now});
  }
  int32_t evict_one() override {
    open();
    PyObject* victims = call(kEvict, {1}, true);
    const int32_t victim = checked_victim(victims);
    Py_DECREF(victims);
    if (victim != kNoBlock) track(victim, 0);
    return victim;
  }
  void clear() override {
    if (started_) call(kClear, {});  // not at the engine's construction (Python's neither)
    for (size_t i = 0; i < tracked_.size(); ++i) {
      if (tracked_[i]) track(static_cast<int32_t>(i), 0);
    }
    begun_ = false;  // clear() ends the object's transaction without undo
  }
  size_t size() const noexcept override { return size_; }
  bool contains(int32_t block_id) const noexcept override { return tracked_[block_id] != 0; }
  size_t memory_bytes() const noexcept override { return tracked_.capacity() + sizeof(*this); }

  void on_register(const int64_t* hashes, size_t count, int64_t first_depth) override {
    if (!methods_[kOnRegister]) return;
    open();
    PyObject* list = hash_list(hashes, count);
    PyObject* depth = PyLong_FromLongLong(first_depth);
    if (!depth) {
      Py_DECREF(list);
      raised();
    }
    PyObject* args[2] = {list, depth};
    finish(PyObject_Vectorcall(methods_[kOnRegister], args, 2, nullptr), args, 2, false);
  }
  // Inside evict_blocks' transaction (as the Python engine's PythonEvictionSteps calls it):
  // an on_end that raises fails the end with the engine restored and the object aborted.
  void on_end(const int64_t* hashes, size_t count) override {
    if (!methods_[kOnEnd]) return;
    open();
    PyObject* args[1] = {hash_list(hashes, count)};
    finish(PyObject_Vectorcall(methods_[kOnEnd], args, 1, nullptr), args, 1, false);
  }
  // After the hit's references (the engine's order), inside the call's transaction: an
  // on_hit that raises fails the call with the engine restored and the object aborted.
  void on_hit(const int64_t* hashes, size_t count) override {
    open();
    PyObject* args[1] = {hash_list(hashes, count)};
    finish(PyObject_Vectorcall(methods_[kOnHit], args, 1, nullptr), args, 1, false);
  }
  bool uses_on_hit() const noexcept override { return methods_[kOnHit] != nullptr; }
  bool evicts_first(int32_t block_id, const LeafInfo& leaf) override {
    if (!methods_[kEvictsFirst]) return false;
    open();
    PyObject* answer = call(kEvictsFirst,
                            {block_id, leaf.block_hash, leaf.last_access, leaf.num_accesses,
                             leaf.depth},
                            true);
    const int truth = PyObject_IsTrue(answer);
    Py_DECREF(answer);
    if (truth < 0) raised();
    return truth != 0;
  }
  void relocate(int32_t old_id, int32_t new_id, const LeafInfo& leaf) override {
    open();
    call(kRelocate,
         {old_id, new_id, leaf.block_hash, leaf.last_access, leaf.num_accesses, leaf.depth});
    track(old_id, 0);
    track(new_id, 1);
  }
  std::unique_ptr<Policy> clone() const override {
    throw EngineError{ErrorKind::kInvalidArgument, "a Python policy object cannot be copied"};
  }

  bool transactional() const noexcept override { return true; }
  void begin() override {
    started_ = in_transaction_ = true;
    begun_ = false;
    flips_.clear();
  }
  void commit() override {
    if (begun_) call(kCommit, {});
    in_transaction_ = begun_ = false;
    flips_.clear();
  }
  void abort() noexcept override {
    for (size_t i = flips_.size(); i-- > 0;) {  // the tracked set as it was, newest first
      const int32_t block_id = flips_[i];
      if (tracked_[block_id]) {
        --size_;
      } else {
        ++size_;
      }
      tracked_[block_id] ^= 1;
    }
    flips_.clear();
    in_transaction_ = false;
    if (!begun_) return;
    begun_ = false;
    PyObject *type, *value, *traceback;  // keep the failure's exception for the caller
    PyErr_Fetch(&type, &value, &traceback);
    PyObject* result = PyObject_CallNoArgs(methods_[kAbort]);
    if (result) {
      Py_DECREF(result);
    } else {
      PyErr_WriteUnraisable(methods_[kAbort]);  // abort() must not raise
    }
    PyErr_Restore(type, value, traceback);
  }

 private:
  enum Method {
    kInsert, kDiscard, kTouch, kEvict, kClear, kRelocate, kBegin, kCommit, kAbort,
    kEvictsFirst, kOnRegister, kOnEnd, kOnHit, kNumMethods
  };

  // A new list of ``count`` Python ints (the hashes); throws as raised() when out of memory.
  static PyObject* hash_list(const int64_t* hashes, size_t count) {
    PyObject* list = PyList_New(static_cast<Py_ssize_t>(count));
    if (!list) raised();
    for (size_t i = 0; i < count; ++i) {
      PyObject* value = PyLong_FromLongLong(hashes[i]);
      if (!value) {
        Py_DECREF(list);
        raised();
      }
      PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), value);
    }
    return list;
  }

  // Open the object's transaction on the first call of an engine call that reaches it.
  void open() {
    if (!in_transaction_ || begun_) return;
    call(kBegin, {});
    begun_ = true;
  }

  // method(*ints); the result (a new reference) when ``keep``, else dropped.
  PyObject* call(Method method, std::initializer_list<int64_t> values, bool keep = false) {
    PyObject* args[6] = {};
    size_t count = 0;
    for (const int64_t value : values) {
      args[count] = PyLong_FromLongLong(value);
      if (!args[count]) {
        for (size_t i = 0; i < count; ++i) Py_DECREF(args[i]);
        raised();
      }
      ++count;
    }
    return finish(PyObject_Vectorcall(methods_[method], args, count, nullptr), args, count, keep);
  }

  static PyObject* finish(PyObject* result, PyObject** args, size_t count, bool keep) {
    for (size_t i = 0; i < count; ++i) Py_DECREF(args[i]);
    if (!result) raised();
    if (keep) return result;
    Py_DECREF(result);
    return nullptr;
  }

  // evict(1)'s answer as a victim (kNoBlock for none), as the Python planner checks it.
  int32_t checked_victim(PyObject* victims) {
    const Py_ssize_t count = PyObject_Length(victims);
    if (count == 0) return kNoBlock;
    PyErr_Clear();  // an object without a length is refused below
    long long block_id = -1;
    if (count == 1) {
      PyObject* item = PySequence_GetItem(victims, 0);
      if (item && !PyBool_Check(item) && PyIndex_Check(item)) {
        int overflow = 0;
        PyObject* number = PyNumber_Index(item);
        if (number) block_id = PyLong_AsLongLongAndOverflow(number, &overflow);
        Py_XDECREF(number);
        if (overflow) block_id = -1;
      }
      Py_XDECREF(item);
      PyErr_Clear();
    }
    if (block_id < 0 || block_id >= static_cast<long long>(tracked_.size()) ||
        !tracked_[block_id]) {
      PyObject* repr = PyObject_Repr(victims);
      const char* text = repr ? PyUnicode_AsUTF8(repr) : nullptr;
      std::string message = std::string("policy ") + Py_TYPE(object_)->tp_name + " chose " +
                            (text ? text : "?") + ", not one cached leaf";
      Py_XDECREF(repr);
      PyErr_Clear();
      Py_DECREF(victims);
      throw EngineError{ErrorKind::kInvariant, message};
    }
    return static_cast<int32_t>(block_id);
  }

  void track(int32_t block_id, uint8_t value) {
    if (tracked_[block_id] == value) return;
    tracked_[block_id] = value;
    if (value) {
      ++size_;
    } else {
      --size_;
    }
    if (in_transaction_) flips_.push_back(block_id);
  }

  PyObject* object_;
  PyObject* methods_[kNumMethods] = {};
  std::vector<uint8_t> tracked_;  // what the engine told the object it tracks
  size_t size_ = 0;
  std::vector<int32_t> flips_;  // tracked_ changes in the open transaction
  bool started_ = false;        // the engine has made a call (construction's clear is not one)
  bool in_transaction_ = false;
  bool begun_ = false;  // the object's transaction is open
};

}  // namespace

std::unique_ptr<Policy> make_python_policy(PyObject* object, int32_t num_blocks,
                                           PyObject* hooks) {
  auto policy = std::make_unique<PythonPolicy>(object, num_blocks);
  if (!policy->bind_methods(hooks)) return nullptr;
  return policy;
}

}  // namespace prefixcache
