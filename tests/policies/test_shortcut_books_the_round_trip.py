"""``arc``, ``reuse_lru``, ``protected_lru``: ``evicts_first`` books what insert-then-evict does.

When a chain eviction exposes a parent, the engine asks the policy whether it would evict
that parent next; on ``True`` it evicts it without inserting it, and the policy must book
the eviction itself (ARC: the ghost hit and ``p``, the stay, the ghost list it joins;
reuse_lru: the clock, the eviction age, the stay, the history; protected_lru: the stay,
the history). Programs of random calls
run the shortcut against the round trip it replaces: the same victims, the same whole
state after every step (Python classes, field by field), the same state under an abort,
the same hidden state of the native policies (probed by what they do afterwards), and the
same hits and evictions on replays through both engines.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prefixcache.policies.linked_map import LinkedMap

from prefixcache import policies
from prefixcache.engine.native_engine import native_available
from prefixcache.reference.trace import TraceRequest
from prefixcache.testing.trace_replay import replay_hits_and_evictions
from prefixcache.tools.workloads import documents_with_hot_prefixes, multi_turn_chats

CASES = [
    ("arc", {}),
    ("arc", {"ghost_capacity": 2}),
    ("arc", {"ghost_capacity": 0}),
    ("arc", {"initial_recency_share": 0.0, "ghost_capacity": 3}),
    ("arc", {"initial_recency_share": 1.0}),
    ("reuse_lru", {}),
    ("reuse_lru", {"history_capacity": 2, "age_smoothing": 1.0}),
    ("reuse_lru", {"history_capacity": 0, "reuse_weight": 0.0}),
    ("reuse_lru", {"reuse_weight": 2.5, "age_smoothing": 0.3}),
    ("protected_lru", {}),
    ("protected_lru", {"history_capacity": 2}),
    ("protected_lru", {"history_capacity": 0}),
]
IDS = [f"{name}-{i}" for i, (name, _) in enumerate(CASES)]
NUM_BLOCKS = 12
HASHES = range(1_000, 1_020)  # few, so ghost lists and histories get hits


def image(policy: Any) -> dict[str, Any]:
    """The whole state of a Python policy here: every field, ordered maps as item lists
    (their order is state), sorted lists as lists; lazy heaps, whose layout is no state,
    by their live entries."""
    fields: dict[str, Any] = {}
    for name, value in vars(policy).items():
        if name == "_txn_undo":
            continue
        if name == "_heaps":  # protected_lru: (last access, block) per class, some stale
            place_of = policy._place_of
            value = [
                sorted({k for k in heap if place_of.get(k[1]) == (c, k[0])})
                for c, heap in enumerate(value)
            ]
        if isinstance(value, LinkedMap):
            value = [(key, value.get(key)) for key in value]
        elif not isinstance(value, (dict, int, float)):
            value = list(value)
        fields[name] = value
    return fields


class Twins:
    """The same calls on two policies, except that an exposed parent goes through
    ``evicts_first`` on ``shortcut`` and through insert then evict(1) on ``round_trip``."""

    def __init__(self, shortcut: Any, round_trip: Any, draw: st.DataObject) -> None:
        self.shortcut, self.round_trip, self.draw = shortcut, round_trip, draw
        self.tracked: dict[int, int] = {}  # block -> hash
        self.out: dict[int, tuple[int, int]] = {}  # hit, out of the policy: block -> (hash, uses)
        self.clock = 0
        self.granted = 0

    def both(self, method: str, *args: Any) -> Any:
        answer = getattr(self.shortcut, method)(*args)
        assert getattr(self.round_trip, method)(*args) == answer, (method, args)
        return answer

    def leaf(self, free: list[int]) -> tuple[int, int, int, int, int]:
        """A block to insert: one back from a hit (its stay), or a free one, often with a hash
        that was evicted (a ghost / history hit)."""
        pick = self.draw.draw
        if self.out and (not free or pick(st.booleans())):
            block_id = pick(st.sampled_from(sorted(self.out)))
            block_hash, uses = self.out.pop(block_id)
            uses += pick(st.integers(0, 1))
        else:
            block_id = pick(st.sampled_from(free))
            used = set(self.tracked.values()) | {h for h, _ in self.out.values()}
            block_hash = pick(st.sampled_from([h for h in HASHES if h not in used]))
            uses = pick(st.integers(1, 3))
        last_access = pick(st.integers(max(0, self.clock - 8), self.clock))
        return block_id, block_hash, last_access, uses, 0

    def step(self) -> None:
        pick = self.draw.draw
        self.clock += pick(st.integers(0, 2))
        busy = set(self.tracked) | set(self.out)
        free = [b for b in range(NUM_BLOCKS) if b not in busy]
        kinds = ["insert", "insert", "expose"] if free or self.out else []
        if self.tracked:
            kinds += ["hit", "touch", "evict"]
            kinds += ["expose", "expose"] if free or self.out else []
        kind = pick(st.sampled_from(kinds))
        if kind == "insert":
            args = self.leaf(free)
            self.both("insert", *args)
            self.tracked[args[0]] = args[1]
        elif kind == "hit":
            block_id = pick(st.sampled_from(sorted(self.tracked)))
            self.both("discard", block_id)
            self.out[block_id] = (self.tracked.pop(block_id), 1)
        elif kind == "touch":
            self.clock += 1
            self.both("touch", pick(st.sampled_from(sorted(self.tracked))), self.clock)
        elif kind == "evict":
            del self.tracked[self.both("evict", 1)[0]]
        else:  # the planner's step: an exposed parent, then the next victim
            args = self.leaf(free)
            if self.shortcut.evicts_first(*args):
                self.granted += 1
                victim = args[0]
            else:
                self.shortcut.insert(*args)
                self.tracked[args[0]] = args[1]
                victim = self.shortcut.evict(1)[0]
            self.round_trip.insert(*args)
            assert self.round_trip.evict(1) == [victim], args
            self.tracked.pop(victim, None)
        assert len(self.shortcut) == len(self.round_trip) == len(self.tracked)

    def probe(self) -> None:
        """Drain both, then bring every hash back once and drain again: which list a
        returning hash joins, ``p``, the ages and histories all show in the victims."""
        while self.tracked:
            del self.tracked[self.both("evict", 1)[0]]
        self.out.clear()
        for block_hash in HASHES:
            self.clock += 1
            block_id = (block_hash - HASHES[0]) % NUM_BLOCKS
            if block_id in self.tracked:
                del self.tracked[self.both("evict", 1)[0]]
            if block_id not in self.tracked:
                self.both("insert", block_id, block_hash, self.clock, 1, 0)
                self.tracked[block_id] = block_hash
        while self.tracked:
            del self.tracked[self.both("evict", 1)[0]]


SETTINGS = settings(
    # Fewer under the sanitizers (.ci/sanitize sets the knob the native policy tests share).
    max_examples=int(os.environ.get("PREFIXCACHE_POLICY_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize(("name", "options"), CASES, ids=IDS)
@SETTINGS
@given(data=st.data(), steps=st.integers(1, 60))
def test_python_shortcut_leaves_the_round_trips_whole_state(
    name: str, options: dict[str, Any], data: st.DataObject, steps: int
) -> None:
    twins = Twins(policies.get(name, **options), policies.get(name, **options), data)
    for _ in range(steps):
        twins.step()
        assert image(twins.shortcut) == image(twins.round_trip)
    twins.probe()


@pytest.mark.parametrize(("name", "options"), CASES, ids=IDS)
@SETTINGS
@given(data=st.data(), steps=st.integers(1, 60))
def test_an_abort_takes_back_what_the_shortcut_booked(
    name: str, options: dict[str, Any], data: st.DataObject, steps: int
) -> None:
    twins = Twins(policies.get(name, **options), policies.get(name, **options), data)
    for _ in range(steps):
        twins.step()
    before = image(twins.shortcut)
    order = copy.deepcopy(twins.shortcut).evict(len(twins.shortcut))
    twins.shortcut.begin()
    free = [b for b in range(NUM_BLOCKS) if b not in twins.tracked and b not in twins.out]
    for _ in range(data.draw(st.integers(1, 4))):
        if free:
            args = twins.leaf(free)
            if args[0] in free:
                free.remove(args[0])
            if not twins.shortcut.evicts_first(*args):
                twins.shortcut.insert(*args)
        if len(twins.shortcut):
            twins.shortcut.evict(1)
    twins.shortcut.abort()
    assert image(twins.shortcut) == before
    assert twins.shortcut.evict(len(twins.shortcut)) == order


@pytest.mark.skipif(not native_available(), reason="the native engine is not built")
@pytest.mark.parametrize(("name", "options"), CASES, ids=IDS)
@SETTINGS
@given(data=st.data(), steps=st.integers(1, 60))
def test_native_shortcut_leaves_the_round_trips_state(
    name: str, options: dict[str, Any], data: st.DataObject, steps: int
) -> None:
    from prefixcache.engine import _native

    def make() -> Any:
        return _native.NativePolicy(name, NUM_BLOCKS, options)

    twins = Twins(make(), make(), data)
    for _ in range(steps):
        twins.step()
    twins.probe()


def _refusing(name: str) -> Any:
    """``name``'s Python class with the shortcut refused: every exposed parent round-trips."""

    class RoundTrip(type(policies.get(name))):  # type: ignore[misc]
        def evicts_first(self, *args: Any) -> bool:
            return False

    return RoundTrip()


class _Counting:
    """Wraps a policy's ``evicts_first`` to count the shortcuts it grants."""

    def __init__(self, policy: Any) -> None:
        self.granted = 0
        answer = policy.evicts_first

        def counted(*args: Any) -> bool:
            granted = answer(*args)
            self.granted += granted
            return bool(granted)

        policy.evicts_first = counted


@pytest.mark.parametrize("name", ["arc", "reuse_lru", "protected_lru"])
@pytest.mark.parametrize(
    ("trace", "capacity"),
    [
        (documents_with_hot_prefixes(300, seed=2, num_hot_prefixes=8, hot_prefix_blocks=12), 120),
        (multi_turn_chats(400, seed=3, num_conversations=40), 200),
    ],
    ids=["documents", "chats"],
)
def test_replays_hit_and_evict_as_the_round_trip(
    name: str, trace: list[TraceRequest], capacity: int
) -> None:
    expected = replay_hits_and_evictions(
        trace, capacity, eviction_policy=_refusing(name), engine="python"
    )
    shortcut = policies.get(name)
    counting = _Counting(shortcut)
    assert (
        replay_hits_and_evictions(trace, capacity, eviction_policy=shortcut, engine="python")
        == expected
    )
    assert counting.granted > 0  # the shortcut was taken
    if native_available():
        assert (
            replay_hits_and_evictions(trace, capacity, eviction_policy=name, engine="native")
            == expected
        )
