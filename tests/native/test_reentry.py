"""No call re-enters a native engine or policy (issue 28, class 2).

Python code can run inside a native call: an argument's ``__index__`` or
``numpy()`` is called while the call converts it. If that code calls back
into the same object, the outer call would go on with scratch buffers and
state the inner call changed (the inner ``admit_request`` resized the token
buffer the outer one still read). Every method of ``_native.Engine`` and
``_native.NativePolicy`` runs behind a guard: the inner call raises
:class:`ReentrantCallError` before it changes anything. So

* when the argument lets the error through, the outer call raises it too and
  the engine is exactly as before;
* when the argument swallows it, the outer call finishes exactly as the same
  call with a plain argument does on a twin engine.

Each case names an argument whose conversion runs Python code (block hashes
are read only from lists, tuples and buffers, so no hash argument runs any);
the test also checks that the callback ran, so a case that stopped converting
through Python would fail rather than pass vacuously.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from prefixcache import KVBlockAllocator, ReentrantCallError
from prefixcache.engine.native_engine import native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="the native engine is not built")

if native_available():
    from prefixcache.engine import _native


class CallsBack:
    """An argument whose ``__index__`` and ``numpy()`` first call ``call_back``.

    ``value`` is what the conversion then returns (an int; an int64 array for a
    sequence; an array itself). With ``swallow`` the refusal is caught and the conversion goes
    on; without it the :class:`ReentrantCallError` propagates.
    """

    def __init__(self, value: Any, call_back: Callable[[], object], swallow: bool) -> None:
        self.value = value
        self.call_back = call_back
        self.swallow = swallow
        self.refusals: list[ReentrantCallError] = []
        self.inner_calls_that_ran = 0

    def _run_call_back(self) -> None:
        try:
            self.call_back()
        except ReentrantCallError as error:
            self.refusals.append(error)
            if not self.swallow:
                raise
        else:
            self.inner_calls_that_ran += 1

    def __index__(self) -> int:
        self._run_call_back()
        return int(self.value)

    def numpy(self) -> np.ndarray:
        self._run_call_back()
        if isinstance(self.value, np.ndarray):  # an output row: its own memory
            return self.value
        return np.asarray(self.value, dtype=np.int64)


def populated_engine() -> Any:
    """An LRU engine with blocks 0-3 held, 0-1 registered as the chain 11 -> 12."""
    engine = _native.Engine(32, 4, "lru", False, block_size=4)
    engine.allocate(4)
    engine.register([0, 1], [11, 12])
    return engine


def snapshot(engine: Any) -> tuple[object, ...]:
    """Everything observable of ``engine``'s state."""
    active, paused = engine.reference_counts(list(range(engine.num_usable)))
    return (
        engine.num_free,
        engine.num_active,
        engine.num_paused,
        engine.num_cached,
        engine.num_registered,
        engine.clock,
        engine.counters(),
        list(engine.free_ids()),
        engine.registered_chains(),
        list(active),
        list(paused),
        engine.find_problems(),
    )


@dataclass(frozen=True)
class Case:
    """``method(*args)`` with ``args[position]`` replaced by a :class:`CallsBack`."""

    method: str
    args: tuple[Any, ...]
    position: int
    kwargs: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        return f"{self.method}[{self.position}]"


ROW = "out_row"
"""Stands for a fresh writable int32 row of 8 IDs (admit_request's output)."""

CASES = [
    Case("allocate", (2,), 0),
    Case("evict", (1,), 0),
    Case("advance_clock", (3,), 0),
    Case("release", ([2, 3],), 0),
    Case("release_request", ([2, 3],), 0),
    Case("acquire", ([0, 1],), 0),
    Case("touch", ([0, 1],), 0),
    Case("move", ([2],), 0, (("to_paused", True),)),
    Case("take_hit", ([0, 1], 2, True), 0),
    Case("take_hit", ([0, 1], 2, True), 1),
    Case("register", ([2, 3], [13, 14]), 0, (("parent_hash", 12),)),
    Case("reference_counts", ([0, 1, 2],), 0),
    Case("relocate", ([2], [20]), 0),
    Case("relocate", ([2], [20]), 1),
    Case("hash_tokens", (list(range(9)),), 0),
    Case("admit_request", (list(range(9)), ROW), 0),
    Case("admit_request", (list(range(9)), ROW), 1),
]


def call(engine: Any, case: Case, replace: Callable[[Any], Any] | None) -> object:
    """``case`` on ``engine``; ``replace`` turns the argument at ``case.position`` into a hook."""
    args = [np.zeros(8, dtype=np.int32) if arg is ROW else arg for arg in case.args]
    if replace is not None:
        args[case.position] = replace(args[case.position])
    result = getattr(engine, case.method)(*args, **dict(case.kwargs))
    if case.method == "admit_request":
        return result, list(args[1]) if not isinstance(args[1], CallsBack) else None
    return plain(result)


def plain(result: object) -> object:
    """``result`` with every BlockIds buffer as a list, so results compare by value."""
    if isinstance(result, tuple):
        return tuple(plain(item) for item in result)
    if result is None or isinstance(result, int | bytes):
        return result
    return list(result)  # type: ignore[call-overload]


def hook_for(engine: Any, swallow: bool) -> Callable[[Any], CallsBack]:
    """Turns an argument into a :class:`CallsBack` whose callback allocates on ``engine``."""

    def replace(value: Any) -> CallsBack:
        return CallsBack(value, lambda: engine.allocate(1), swallow)

    return replace


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_reentering_conversion_that_raises_leaves_the_engine_as_it_was(case: Case) -> None:
    engine = populated_engine()
    before = snapshot(engine)
    hooks: list[CallsBack] = []

    def replace(value: Any) -> CallsBack:
        hooks.append(hook_for(engine, swallow=False)(value))
        return hooks[-1]

    with pytest.raises(ReentrantCallError, match="called back in"):
        call(engine, case, replace)
    assert len(hooks[0].refusals) == 1
    assert hooks[0].inner_calls_that_ran == 0
    assert snapshot(engine) == before


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_reentering_conversion_that_swallows_changes_nothing_of_the_outer_call(
    case: Case,
) -> None:
    engine, twin = populated_engine(), populated_engine()
    hooks: list[CallsBack] = []

    def replace(value: Any) -> CallsBack:
        hooks.append(hook_for(engine, swallow=True)(value))
        return hooks[-1]

    result = call(engine, case, replace)
    expected = call(twin, case, None)
    assert hooks[0].refusals, "the conversion never called back: the case tests nothing"
    assert hooks[0].inner_calls_that_ran == 0
    if case.method != "admit_request" or case.position == 0:
        assert result == expected
    assert snapshot(engine) == snapshot(twin)


def test_the_engine_cannot_be_reinitialised_from_inside_its_own_call() -> None:
    engine = populated_engine()
    before = snapshot(engine)
    hook = CallsBack([2, 3], lambda: engine.__init__(8, 2, "lru", False), swallow=False)
    with pytest.raises(ReentrantCallError):
        engine.release(hook)
    assert snapshot(engine) == before


def test_a_call_after_a_refused_reentry_runs_normally() -> None:
    engine = populated_engine()
    hook = CallsBack([2], lambda: engine.allocate(1), swallow=False)
    with pytest.raises(ReentrantCallError):
        engine.release(hook)
    engine.release([2])  # the guard was let go when the outer call ended
    assert engine.num_active == 3
    assert engine.find_problems() == []


POLICY_CASES = [
    ("insert", (5, 105, 1, 1, 0), 0),
    ("insert", (5, 105, 1, 1, 0), 2),
    ("touch", (1, 7), 0),
    ("discard", (1,), 0),
    ("evict", (1,), 0),
    ("set_retention", (101, 2), 1),
]


def populated_policy() -> Any:
    """A native priority policy tracking blocks 0-2 (priority keeps retention priorities)."""
    policy = _native.NativePolicy("priority", 16)
    for block_id in range(3):
        policy.insert(block_id, 100 + block_id, block_id, 1, 0)
    return policy


@pytest.mark.parametrize(("method", "args", "position"), POLICY_CASES)
def test_a_native_policy_refuses_reentry(method: str, args: tuple[int, ...], position: int) -> None:
    policy, twin = populated_policy(), populated_policy()
    hook = CallsBack(args[position], lambda: policy.insert(9, 109, 0, 1, 0), swallow=True)
    hooked = list(args)
    hooked[position] = hook
    result = getattr(policy, method)(*hooked)
    assert getattr(twin, method)(*args) == result
    assert hook.refusals and hook.inner_calls_that_ran == 0
    assert 9 not in policy
    assert [block_id in policy for block_id in range(16)] == [
        block_id in twin for block_id in range(16)
    ]
    assert policy.evict(16) == twin.evict(16)


def test_the_public_request_path_refuses_reentry_and_stays_unchanged() -> None:
    allocator = KVBlockAllocator(total_count=64, block_size_tokens=4, device="cpu", engine="native")
    assert allocator.engine == "native"
    allocator.admit_request(list(range(12)), np.zeros(8, dtype=np.int32))
    row = np.zeros(8, dtype=np.int32)
    hook = CallsBack(
        row, lambda: allocator.admit_request(list(range(100, 148)), row), swallow=False
    )
    used = allocator.get_active_used()
    with pytest.raises(ReentrantCallError):
        allocator.admit_request(list(range(9)), hook)
    assert allocator.get_active_used() == used
    allocator.check_invariants()
