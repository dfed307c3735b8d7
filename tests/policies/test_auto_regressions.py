"""``auto`` with several blocks under one hash: the KeyError reported on an earlier version.

Block IDs are recycled and nothing forbids two tracked leaves under one hash
(a policy-level caller, or a prefix computed twice before either was
registered). A duel between two blocks of one hash used to put the hash on
both sides of the duel, and closing it deleted the hash's entry twice.
"""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prefixcache.policies.auto import AutoPolicy

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.reference.trace import TraceRequest
from prefixcache.tools.replay import replay
from prefixcache.tools.workloads import documents_with_hot_prefixes, multi_turn_chats

# The reported sequence; arguments are EvictionPolicy.insert's, in order:
# (block_id, block_hash, last_access, num_accesses, depth), so every block has hash 0.
REPORTED = [
    ("insert", (5, 0, 1, 1, 4)),
    ("insert", (6, 0, 6, 1, 4)),
    ("insert", (9, 0, 11, 1, 2)),
    ("insert", (12, 0, 14, 1, 2)),
    ("evict", (1,)),
    ("evict", (1,)),
    ("insert", (4, 0, 7, 2, 3)),
    ("insert", (6, 0, 17, 1, 2)),
    ("evict", (1,)),
    ("insert", (8, 0, 12, 1, 1)),
    ("evict", (1,)),
    ("insert", (11, 0, 15, 1, 1)),
    ("evict", (1,)),
    ("insert", (3, 0, 8, 2, 2)),
    ("insert", (4, 0, 20, 1, 2)),
    ("discard", (3,)),
]


def _play(policy: AutoPolicy, calls: list[tuple[str, tuple[int, ...]]]) -> set[int]:
    """Make ``calls`` on ``policy``; return the tracked set a correct policy must have."""
    tracked: set[int] = set()
    for name, args in calls:
        result = getattr(policy, name)(*args)
        if name == "insert":
            tracked.add(args[0])
        elif name == "discard":
            tracked.discard(args[0])
        else:
            assert len(result) == min(args[0], len(tracked)) and set(result) <= tracked
            tracked.difference_update(result)
    return tracked


def test_the_reported_sequence_runs_and_tracks_what_it_says() -> None:
    policy = AutoPolicy()
    tracked = _play(policy, REPORTED)
    assert tracked == {4, 6, 8, 11}
    assert {block for block in range(16) if block in policy} == tracked
    assert sorted(policy.evict(10)) == sorted(tracked) and len(policy) == 0


def test_the_reported_sequence_in_a_transaction_is_undone_by_abort() -> None:
    policy = AutoPolicy()
    _play(policy, REPORTED[:13])
    twin = copy.deepcopy(policy)
    policy.begin()
    _play(policy, REPORTED[13:])
    policy.abort()
    assert policy.metadata() == twin.metadata() and policy.charges() == twin.charges()
    assert policy.evict(len(policy)) == twin.evict(len(twin))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_colliding_hashes_never_break_tracking_or_abort(seed: int) -> None:
    rng = random.Random(seed)
    policy = AutoPolicy(duel_ratio=0.1, half_life_ratio=0.05, switch_margin=0, switch_z=0)
    tracked: set[int] = set()
    calls: list[tuple[str, tuple[int, ...]]] = []
    for step in range(120):
        block = rng.randrange(12)
        action = rng.random()
        if block not in tracked and action < 0.45:
            call = ("insert", (block, rng.randrange(3), step, rng.randint(1, 3), rng.randrange(4)))
            tracked.add(block)
        elif block in tracked and action < 0.6:
            call = ("touch", (block, step))
        elif block in tracked and action < 0.8:
            call = ("discard", (block,))
            tracked.discard(block)
        else:
            call = ("evict", (rng.randint(1, 3),))
        if call[0] == "evict":
            before = copy.deepcopy(policy)
            policy.begin()
            victims = policy.evict(*call[1])
            policy.abort()  # the whole eviction, duels and charges included, is taken back
            assert policy.evict(len(policy)) == copy.deepcopy(before).evict(len(before))
            policy = before
            victims = policy.evict(*call[1])
            assert len(victims) == min(call[1][0], len(tracked)) and set(victims) <= tracked
            tracked.difference_update(victims)
        else:
            getattr(policy, call[0])(*call[1])
        calls.append(call)
        assert len(policy) == len(tracked)
        assert all(block in policy for block in tracked)


@pytest.mark.parametrize(
    ("trace", "capacity"),
    [
        (documents_with_hot_prefixes(400, seed=2, num_hot_prefixes=8, hot_prefix_blocks=12), 100),
        (multi_turn_chats(500, seed=3, num_conversations=40), 150),
        (multi_turn_chats(300, seed=4, num_conversations=30), 30),  # a tiny cache
    ],
    ids=["documents", "chats", "chats-tiny"],
)
def test_auto_replays_to_the_same_hits_on_both_engines(
    trace: list[TraceRequest], capacity: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """engine='auto' runs auto natively (the engine reports hits: on_hit), block for block
    as the Python engine runs the Python class: the same hits and evictions. These replays
    open 1,800-16,000 duels, trip the safety net once or twice, move the lead to lru on the
    chats and grow the pool estimate past 64 (checked on the Python class when written)."""
    results = {}
    for engine in ("python", "native"):
        monkeypatch.setenv("PREFIXCACHE_ENGINE", engine)
        allocator = KVBlockAllocator(total_count=64, eviction_policy="auto", device="cpu")
        if engine == "native" and allocator.engine != "native":
            pytest.skip("the native engine is not built")
        result = replay(trace, capacity, "auto")
        results[engine] = (result.hit_blocks, result.evictions)
    assert results["native"] == results["python"]
    assert results["python"][1] > 0  # the cache was under pressure
