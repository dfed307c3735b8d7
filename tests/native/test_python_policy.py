"""A policy object written in Python on the native engine, against the Python engine.

The native engine calls a policy object's hooks (``native/python_policy.cpp``) and keeps
the transaction rule with a checkpoint of its own state (``native/engine_checkpoint.h``;
DESIGN.md, "Native policies"). A hypothesis state machine drives
``KVBlockAllocator(engine="python")`` and ``engine="native"``, each with its own instance
of the same policy class, through random programs (allocate, serve, release, match,
touch, evict, the fused request path, registration, retention, a conversation's end,
defragment, reset) and
arms a fault at a random later hook call of both policies: the hook raises (after its
change, so the policy's abort must take it back). After every step the return values or
exception types, the engine-agnostic state digest and the policies' eviction orders
(drained from copies) must be equal: a failed call leaves both allocators and both
policies exactly as they were.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from prefixcache.policies import (
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    PriorityPolicy,
    S3FIFOPolicy,
)
from prefixcache.policies.auto import AutoPolicy

from prefixcache import KVBlockAllocator, PrefixCacheError, policies
from prefixcache.engine.native_engine import native_available
from prefixcache.engine.selection import PYTHON_POLICY_MAX_BLOCKS
from prefixcache.engine.sessions import Session
from prefixcache.testing import changed_fields, state_digest
from prefixcache.testing.composed_request import serve_composed

pytestmark = pytest.mark.skipif(
    not native_available(), reason="the native engine (prefixcache.engine._native) is not built"
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_policy.py"
TOTAL_COUNT = 12
BLOCK_SIZE = 2
NUM_USABLE = TOTAL_COUNT - 1


class InjectedFault(RuntimeError):
    """What an armed hook raises."""


def _example_policy() -> type[EvictionPolicy]:
    """examples/custom_policy.py's DeepestFirstPolicy, the policy registry left as it was."""
    saved = dict(policies._registry)
    try:
        spec = importlib.util.spec_from_file_location("custom_policy_example", EXAMPLE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        policies._registry.clear()
        policies._registry.update(saved)
    cls: type[EvictionPolicy] = module.DeepestFirstPolicy
    return cls


_HOOKS = (
    "insert",
    "discard",
    "touch",
    "evict",
    "relocate",
    "on_register",
    "evicts_first",
    "on_end",
    "on_hit",
)
_OPTIONAL = ("on_register", "evicts_first", "on_end", "on_hit")


class RecordingLRU(LRUPolicy):
    """LRU that records what each ``on_end``, ``on_hit`` and ``on_register`` told it (both
    engines must tell the same; a rolled-back call's record is taken back with the
    transaction)."""

    def __init__(self) -> None:
        super().__init__()
        self.heard: list[tuple[str, list[int]]] = []

    def _record(self, hook: str, block_hashes: list[int]) -> None:
        self.heard.append((hook, list(block_hashes)))
        if self._txn_undo is not None:
            self._txn_undo.append((self.heard.pop,))

    def on_end(self, block_hashes: list[int]) -> None:
        self._record("on_end", block_hashes)

    def on_hit(self, block_hashes: list[int]) -> None:
        self._record("on_hit", block_hashes)

    def on_register(self, block_hashes: list[int], first_depth: int) -> None:
        self._record(f"on_register@{first_depth}", block_hashes)


def faulty(base: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """``base`` whose hooks raise InjectedFault at the call ``fault_in`` counts down to.

    The hook raises after ``base``'s method ran: the change is made, and only the policy's
    abort (the engine's transaction) can take it back. Optional hooks ``base`` does not
    override stay unoverridden, so both engines see the same hooks.
    """

    def wrap(name: str) -> Any:
        method = getattr(base, name)

        def hooked(self: Any, *args: Any) -> Any:
            result = method(self, *args)
            self.fault_in -= 1
            if self.fault_in == 0:
                raise InjectedFault(name)
            return result

        return hooked

    def overridden(name: str) -> bool:  # has_hook asks about an instance, not a class
        return getattr(base, name) is not getattr(EvictionPolicy, name)

    names = [n for n in _HOOKS if n not in _OPTIONAL or overridden(n)]
    namespace: dict[str, Any] = {name: wrap(name) for name in names}
    namespace["fault_in"] = -1
    return type(f"Faulty{base.__name__}", (base,), namespace)


POLICY_CLASSES = {
    "deepest_first": _example_policy(),
    "lru": LRUPolicy,
    "s3fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
    "priority": PriorityPolicy,
    "lru_recording": RecordingLRU,
    "auto": AutoPolicy,  # an object with on_register, on_hit and on_end
}

PROFILE = settings(
    max_examples=int(os.environ.get("PREFIXCACHE_PYPOLICY_EXAMPLES", "15")),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

hashes_st = st.lists(st.integers(1, 12), min_size=0, max_size=5)
tokens_st = st.lists(st.integers(0, 1), min_size=0, max_size=9)


def _outcome(call: Any) -> tuple[str, Any]:
    try:
        result = call()
    except (PrefixCacheError, InjectedFault, NotImplementedError) as error:
        return ("raised", type(error).__name__)
    if hasattr(result, "tolist"):  # a tensor or an array
        return ("ok", result.tolist())
    return ("ok", result)


def _order(policy: EvictionPolicy) -> list[int]:
    """The policy's eviction order, drained from a copy (the policy is unchanged)."""
    drained = copy.deepcopy(policy)
    drained.fault_in = -1  # type: ignore[attr-defined]
    return [block_id for _ in range(len(drained)) for block_id in drained.evict(1)]


class PythonPolicyMachine(RuleBasedStateMachine):
    """The same program on both engines, each with its own instance of ``policy_class``."""

    policy_class: type[EvictionPolicy] = LRUPolicy
    events = False

    @initialize()
    def build(self) -> None:
        cls = faulty(self.policy_class)
        config = {
            "total_count": TOTAL_COUNT,
            "paused_count": 2,
            "block_size_tokens": BLOCK_SIZE,
            "device": "cpu",
            "kv_events_capacity": 1_000 if self.events else 0,
        }
        self.policies = [cls(), cls()]
        self.python = KVBlockAllocator(engine="python", eviction_policy=self.policies[0], **config)
        self.native = KVBlockAllocator(engine="native", eviction_policy=self.policies[1], **config)
        assert self.native.engine == "native" and "hooks" in self.native.engine_reason
        self.requests: list[list[int]] = []
        self.fault_in = -1

    def both(self, call: Any) -> tuple[str, Any]:
        """``call(allocator)`` on both, the armed fault (if any) in each; same outcome."""
        outcomes, left = [], []
        for allocator, policy in zip((self.python, self.native), self.policies, strict=True):
            policy.fault_in = self.fault_in  # type: ignore[attr-defined]
            outcomes.append(_outcome(lambda a=allocator: call(a)))
            left.append(policy.fault_in)  # type: ignore[attr-defined]
            policy.fault_in = -1  # type: ignore[attr-defined]
        expected, actual = outcomes
        assert actual == expected, f"python {expected} != native {actual}"
        assert left[0] == left[1], "the engines made different numbers of hook calls"
        self.fault_in = left[0] if left[0] > 0 else -1  # armed until it fires
        return expected

    @rule(calls=st.integers(1, 6))
    def arm_fault(self, calls: int) -> None:
        """The ``calls``-th hook call from now raises, in both policies."""
        self.fault_in = calls

    @rule(count=st.integers(0, TOTAL_COUNT))
    def allocate(self, count: int) -> None:
        kind, ids = self.both(lambda a: a.allocate_memory_blocks(count))
        if kind == "ok" and ids is not None:
            self.requests.append(ids)

    @rule(tokens=tokens_st, keep=st.booleans())
    def serve(self, tokens: list[int], keep: bool) -> None:
        def run(allocator: KVBlockAllocator) -> list[int] | None:
            return serve_composed(allocator, tokens, BLOCK_SIZE, keep=keep)

        kind, ids = self.both(run)
        if kind == "ok" and ids is not None and keep:
            self.requests.append(ids)

    @rule(tokens=tokens_st)
    def admit(self, tokens: list[int]) -> None:
        if not self.events:  # the Python engine composes calls, which a fault splits (below)
            self.fault_in = -1

        def run(allocator: KVBlockAllocator) -> tuple[int, list[int]]:
            row = np.full(6, -7, dtype=np.int32)
            try:
                hit = allocator.admit_request(np.array(tokens, dtype=np.int32), row)
            except BaseException:
                assert (row == -7).all()  # a failed request leaves the row as it was
                raise
            return hit, row.tolist()

        kind, result = self.both(run)
        if kind == "ok":
            self.requests.append(result[1][: -(-len(tokens) // BLOCK_SIZE)])

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), fused=st.booleans())
    def finish(self, data: st.DataObject, fused: bool) -> None:
        index = data.draw(st.integers(0, len(self.requests) - 1))
        ids = self.requests[index]
        array = np.array(ids, dtype=np.int32)
        kind, _ = self.both(
            lambda a: a.release_request(array) if fused else a.release_memory_blocks(ids)
        )
        if kind == "ok":
            self.requests.pop(index)

    @rule(hashes=hashes_st, acquire=st.booleans())
    def match(self, hashes: list[int], acquire: bool) -> None:
        kind, ids = self.both(lambda a: a.match_prefix(hashes, acquire=acquire))
        if kind == "ok" and acquire and ids:
            self.requests.append(ids)

    @rule(ids=st.lists(st.integers(0, NUM_USABLE - 1), max_size=5))
    def touch(self, ids: list[int]) -> None:
        self.both(lambda a: a.update_timestamps(ids))

    @rule(count=st.integers(0, TOTAL_COUNT))
    def evict(self, count: int) -> None:
        self.both(lambda a: a.evict_cached_blocks(count))

    @rule(ids=st.lists(st.integers(0, NUM_USABLE - 1), max_size=6))
    def end(self, ids: list[int]) -> None:
        """A conversation's end: its cached leaves freed tail-first, then ``on_end``."""
        self.both(lambda a: a.evict_blocks(ids))

    @rule(hashes=hashes_st, priority=st.integers(0, 50))
    def retain(self, hashes: list[int], priority: int) -> None:
        self.both(lambda a: a.set_retention_priority(hashes, priority))

    @rule()
    def defragment(self) -> None:
        plan = self.python.plan_defragment()
        assert self.native.plan_defragment().moves == plan.moves
        if self.both(lambda a: a.apply_defragment(plan))[0] == "ok":
            rename = dict(plan.moves)
            self.requests = [[rename.get(b, b) for b in row] for row in self.requests]

    @precondition(lambda self: len(self.requests) > 3)
    @rule()
    def reset(self) -> None:
        if self.both(lambda a: a.reset())[0] == "ok":
            self.requests.clear()

    @invariant()
    def same_state(self) -> None:
        python, native = state_digest(self.python), state_digest(self.native)
        common = (python.keys() & native.keys()) - {"engine"}
        mine, theirs = {k: native[k] for k in common}, {k: python[k] for k in common}
        assert mine == theirs, changed_fields(theirs, mine)
        assert _order(self.policies[1]) == _order(self.policies[0])
        assert len(self.policies[1]) == len(self.policies[0])
        assert getattr(self.policies[1], "heard", None) == getattr(self.policies[0], "heard", None)
        assert self.native._engine.find_problems() == []
        self.python.check_invariants()


@pytest.mark.parametrize("events", [False, True], ids=["fused", "events"])
@pytest.mark.parametrize("name", sorted(POLICY_CLASSES))
def test_a_python_policy_on_the_native_engine_matches_the_python_engine(
    name: str, events: bool
) -> None:
    machine = type(
        f"PythonPolicy_{name}_{'events' if events else 'fused'}",
        (PythonPolicyMachine,),
        {"policy_class": POLICY_CLASSES[name], "events": events},
    )
    machine.TestCase.settings = PROFILE
    machine.TestCase().runTest()


def test_a_policy_object_runs_natively_or_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine reason names the object's class either way."""
    monkeypatch.delenv("PREFIXCACHE_ENGINE", raising=False)  # the suite's default is python
    native = KVBlockAllocator(total_count=8, device="cpu", eviction_policy=LRUPolicy())
    assert native.engine == "native" and "LRUPolicy object's hooks" in native.engine_reason
    wide = KVBlockAllocator(
        total_count=8, device="cpu", eviction_policy=LRUPolicy(), hash_algo="sha256"
    )
    assert wide.engine == "python" and "LRUPolicy" in wide.engine_reason
    large = KVBlockAllocator(
        total_count=PYTHON_POLICY_MAX_BLOCKS + 1, device="cpu", eviction_policy=LRUPolicy()
    )
    assert large.engine == "python" and "copy of the engine's state" in large.engine_reason

    class HitCounting(LRUPolicy):
        def on_hit(self, block_hashes: list[int]) -> None:  # the native engine calls it too
            pass

    counting = KVBlockAllocator(total_count=8, device="cpu", eviction_policy=HitCounting())
    assert counting.engine == "native" and "HitCounting" in counting.engine_reason


def test_a_bad_victim_is_an_invariant_error_and_changes_nothing() -> None:
    """evict(1) returning a block the engine does not track is refused as on Python."""

    class Liar(LRUPolicy):
        def evict(self, num_blocks: int) -> list[int]:
            return [NUM_USABLE + 5]

    outcomes = []
    for engine in ("python", "native"):
        allocator = KVBlockAllocator(
            total_count=TOTAL_COUNT, device="cpu", eviction_policy=Liar(), engine=engine
        )
        ids = allocator.allocate_memory_blocks(3)
        allocator.register_kv_block_hashes(ids, [1, 2, 3])
        allocator.release_memory_blocks(ids)
        before = state_digest(allocator)
        outcomes.append(_outcome(lambda a=allocator: a.allocate_memory_blocks(NUM_USABLE)))
        after = state_digest(allocator)
        assert {k: after[k] for k in after} == before
    assert outcomes[0] == outcomes[1] == ("raised", "InvariantError")


def test_a_fault_inside_the_fused_request_path_changes_nothing() -> None:
    """The fused admit_request is one native transaction: a hook that raises anywhere in it
    (eviction, registration) leaves the allocator, the row and the policy as they were.

    (The Python engine composes the same request from separate calls, so a fault after its
    match keeps the match's counters and pins: the differential machine arms no fault there.)
    """
    cls = faulty(POLICY_CLASSES["deepest_first"])
    for calls in range(1, 12):
        policy = cls()
        allocator = KVBlockAllocator(
            total_count=TOTAL_COUNT,
            block_size_tokens=BLOCK_SIZE,
            device="cpu",
            eviction_policy=policy,
            engine="native",
        )
        for first in range(4):  # cached chains that the next request must evict
            row = np.full(6, -7, dtype=np.int32)
            allocator.admit_request(np.array([first] * 5, dtype=np.int32), row)
            allocator.release_request(row[:3])
        before, order = state_digest(allocator), _order(policy)
        policy.fault_in = calls  # type: ignore[attr-defined]
        row = np.full(6, -7, dtype=np.int32)
        tokens = np.array([0, 0, 9, 9, 9, 9, 9], np.int32)
        outcome = _outcome(lambda a=allocator, r=row, t=tokens: a.admit_request(t, r))
        policy.fault_in = -1  # type: ignore[attr-defined]
        if outcome[0] == "raised":
            assert outcome == ("raised", "InjectedFault")
            assert state_digest(allocator) == before and _order(policy) == order
            assert (row == -7).all()
    assert outcome[0] == "ok"  # the last arming came after the request's last hook call


def test_a_python_policy_keeps_the_python_session() -> None:
    """A native session's steps are not engine transactions, so an engine calling a Python
    policy's hooks opens the Python Session (each of its facade calls is one); a built-in
    policy on the same engine gets the native session."""
    with_object = KVBlockAllocator(
        total_count=TOTAL_COUNT,
        block_size_tokens=BLOCK_SIZE,
        device="cpu",
        eviction_policy=POLICY_CLASSES["deepest_first"](),
        engine="native",
    )
    assert with_object.engine == "native"
    assert isinstance(with_object.open_session(), Session)
    by_name = KVBlockAllocator(
        total_count=TOTAL_COUNT, block_size_tokens=BLOCK_SIZE, device="cpu", engine="native"
    )
    assert not isinstance(by_name.open_session(), Session)


def recording_allocator(engine: str) -> tuple[Any, KVBlockAllocator]:
    """A faulty ``RecordingLRU`` object and an allocator on ``engine`` running it."""
    policy = faulty(RecordingLRU)()
    allocator = KVBlockAllocator(
        total_count=TOTAL_COUNT,
        block_size_tokens=BLOCK_SIZE,
        device="cpu",
        eviction_policy=policy,
        engine=engine,
    )
    return policy, allocator


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_raising_on_hit_fails_the_hit_and_changes_nothing(engine: str) -> None:
    """``on_hit`` runs inside the hit's transaction on both engines: when it raises, the
    references, counters and the policy's discards are all taken back (the Python engine
    had kept the references: it called the hook after writing them)."""
    policy, allocator = recording_allocator(engine)
    tokens = [1, 0, 1, 1, 0]
    assert serve_composed(allocator, tokens, BLOCK_SIZE, keep=False) is not None
    before, order, heard = state_digest(allocator), _order(policy), list(policy.heard)
    hashes = allocator.hash_tokens(tokens)[:2]
    policy.fault_in = 2  # type: ignore[attr-defined]  # the discard of the leaf, then on_hit
    with pytest.raises(InjectedFault, match="on_hit"):
        allocator.match_prefix(hashes, acquire=True)
    assert state_digest(allocator) == before and _order(policy) == order
    assert policy.heard == heard
    policy.fault_in = -1  # type: ignore[attr-defined]
    assert len(allocator.match_prefix(hashes, acquire=True)) == 2
    assert policy.heard == [*heard, ("on_hit", hashes)]


@pytest.mark.parametrize("engine", ["python", "native"])
@pytest.mark.parametrize("fault_in", [1, 2], ids=["on_register", "discard"])
def test_a_raising_on_register_fails_the_registration_and_changes_nothing(
    engine: str, fault_in: int
) -> None:
    """``on_register`` and the discard of the parent that gains a child are one transaction
    on both engines: when either raises, the policy is as it was (the Python engine called
    ``on_register`` outside any transaction, so a raising discard kept what it had told)."""
    policy, allocator = recording_allocator(engine)
    tokens = [1, 0, 1, 1]
    assert serve_composed(allocator, tokens[:BLOCK_SIZE], BLOCK_SIZE, keep=False) is not None
    hashes = allocator.hash_tokens(tokens)
    new = allocator.allocate_memory_blocks(1)
    before, order, heard = state_digest(allocator), _order(policy), list(policy.heard)
    assert len(order) == 1  # the parent is a cached leaf: registering a child discards it
    policy.fault_in = fault_in  # type: ignore[attr-defined]
    with pytest.raises(InjectedFault, match="on_register" if fault_in == 1 else "discard"):
        allocator.register_kv_block_hashes(new, hashes[1:2], parent_hash=hashes[0])
    assert state_digest(allocator) == before and _order(policy) == order
    assert policy.heard == heard
    policy.fault_in = -1  # type: ignore[attr-defined]
    allocator.register_kv_block_hashes(new, hashes[1:2], parent_hash=hashes[0])
    assert policy.heard == [*heard, ("on_register@1", hashes[1:2])]
    assert _order(policy) == []
