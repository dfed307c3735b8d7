"""Basic tracking of every registered policy, then each built-in policy's own order.

The tracking checks (what the engine relies on): ``insert`` tracks a block,
``discard`` and ``evict`` stop tracking it, ``evict(n)`` returns
``min(n, len)`` distinct tracked blocks, ``clear`` empties, ``touch`` and
``discard`` work on tracked blocks. They run over every registered policy that
tracks blocks (belady needs an injected future, ref_zero tracks nothing and
has its own test), driven by a seeded random action table checked against a
set model. The full laws, transactions included, are in ``test_contract.py``.
"""

from __future__ import annotations

import random

import pytest
from prefixcache.policies import (
    LFUPolicy,
    PriorityPolicy,
    ReuseLRUPolicy,
    S3FIFOPolicy,
    SLRUPolicy,
    has_hook,
)

from prefixcache import policies

TRACKING_POLICIES = [name for name in policies.available() if name not in {"belady", "ref_zero"}]


def insert(policy, block_id: int, last_access: int, num_accesses: int = 1, depth: int = 0) -> None:
    """Insert with the block ID times 1000 as its hash."""
    policy.insert(block_id, block_id * 1000, last_access, num_accesses, depth)


@pytest.fixture(params=TRACKING_POLICIES)
def policy(request: pytest.FixtureRequest):
    return policies.get(request.param)


# ----------------------------------------------------------------------------- contract


def test_insert_tracks_and_discard_forgets(policy) -> None:
    insert(policy, 3, last_access=1)
    insert(policy, 4, last_access=2)
    assert len(policy) == 2 and 3 in policy and 4 in policy and 5 not in policy
    policy.discard(3)
    assert len(policy) == 1 and 3 not in policy
    assert policy.evict(5) == [4]
    assert len(policy) == 0


def test_evict_returns_min_of_asked_and_tracked(policy) -> None:
    for block_id in range(6):
        insert(policy, block_id, last_access=block_id, num_accesses=1 + block_id % 3)
    first = policy.evict(4)
    assert len(first) == 4 and len(set(first)) == 4 and set(first) <= set(range(6))
    assert not set(first) & {b for b in range(6) if b in policy}
    rest = policy.evict(10)
    assert sorted(first + rest) == list(range(6))
    assert policy.evict(3) == [] and len(policy) == 0
    assert policy.evict(0) == []


def test_touch_keeps_tracking_and_unknown_ids_raise(policy) -> None:
    insert(policy, 1, last_access=1)
    policy.touch(1, now=5)
    assert 1 in policy and len(policy) == 1
    with pytest.raises(KeyError):
        policy.touch(2, now=6)
    with pytest.raises(KeyError):
        policy.discard(2)


def test_clear_empties(policy) -> None:
    for block_id in range(4):
        insert(policy, block_id, last_access=block_id)
    policy.clear()
    assert len(policy) == 0 and 0 not in policy and policy.evict(2) == []
    insert(policy, 0, last_access=9)  # usable again after clear
    assert policy.evict(1) == [0]


def test_random_action_table_matches_a_set_model(policy) -> None:
    """Seeded random inserts/discards/touches/evicts, including hit-and-return of a block."""
    rng = random.Random(7)
    tracked: set[int] = set()
    accesses = dict.fromkeys(range(40), 1)
    for clock in range(1, 2001):
        action = rng.random()
        untracked = [b for b in range(40) if b not in tracked]
        if action < 0.45 and untracked:
            block_id = rng.choice(untracked)
            policy.insert(block_id, block_id * 1000, clock, accesses[block_id], rng.randrange(5))
            tracked.add(block_id)
        elif action < 0.6 and tracked:
            block_id = rng.choice(sorted(tracked))
            policy.discard(block_id)  # a hit: it may come back with one more hand-out
            tracked.remove(block_id)
            accesses[block_id] += 1
        elif action < 0.75 and tracked:
            policy.touch(rng.choice(sorted(tracked)), clock)
        else:
            asked = rng.randrange(4)
            victims = policy.evict(asked)
            assert len(victims) == min(asked, len(tracked))
            assert len(set(victims)) == len(victims) and set(victims) <= tracked
            tracked.difference_update(victims)
            for block_id in victims:
                accesses[block_id] = 1  # freed: a later insert is a fresh allocation
        assert len(policy) == len(tracked)
        assert all(b in policy for b in tracked)


def test_ref_zero_tracks_nothing() -> None:
    policy = policies.get("ref_zero")
    assert not policy.retains_unreferenced  # deprecated: the config's alias reads it
    assert policy.evict(3) == [] and len(policy) == 0 and 1 not in policy


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("lfu", {"frequency_weight": 0}),
        ("slru", {"protected_fraction": 1.5}),
        ("s3fifo", {"small_fraction": 1.0}),
        ("s3fifo", {"ghost_capacity": -1}),
        ("s3fifo", {"promote_after": 0}),
        ("reuse_lru", {"reuse_weight": -1}),
        ("reuse_lru", {"age_smoothing": 0}),
        ("priority", {"max_retained_fraction": 2}),
    ],
)
def test_bad_arguments_are_refused(name: str, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        policies.get(name, **kwargs)


# ----------------------------------------------------------------------------- orders


def test_fifo_ignores_touches_but_lru_does_not() -> None:
    for name, first in (("fifo", 1), ("lru", 2)):
        policy = policies.get(name)
        insert(policy, 1, last_access=1)
        insert(policy, 2, last_access=2)
        policy.touch(1, now=3)
        assert policy.evict(1) == [first], name


def test_lfu_evicts_least_frequent_then_ageing_lets_an_old_burst_go() -> None:
    policy = LFUPolicy()
    insert(policy, 1, last_access=1, num_accesses=4)  # an old burst: score 4
    for block_id in range(2, 5):  # one-hit blocks go first while the burst scores higher
        insert(policy, block_id, last_access=block_id)
        assert policy.evict(1) == [block_id]
    # Each victim raised the age; a new one-hit block now scores above the old burst.
    insert(policy, 6, last_access=6)
    assert policy.evict(1) == [1]


def test_slru_evicts_one_hit_blocks_before_reused_ones() -> None:
    policy = SLRUPolicy()
    insert(policy, 1, last_access=1, num_accesses=2)  # reused, oldest
    insert(policy, 2, last_access=2)
    insert(policy, 3, last_access=3)
    policy.touch(3, now=4)  # a touch is a reuse
    insert(policy, 4, last_access=5)
    assert policy.evict(2) == [2, 4]


def test_slru_protected_gives_victims_when_over_its_share() -> None:
    policy = SLRUPolicy(protected_fraction=0.5)
    for block_id in range(1, 4):
        insert(policy, block_id, last_access=block_id, num_accesses=3)
    insert(policy, 4, last_access=4)
    assert policy.evict(1) == [1]  # 3 of 4 protected > half: protected's LRU goes


def test_s3fifo_one_hit_blocks_leave_from_the_small_queue() -> None:
    policy = S3FIFOPolicy()
    insert(policy, 1, last_access=1, num_accesses=2)  # reused before: promoted, not evicted
    insert(policy, 2, last_access=2)
    assert policy.evict(1) == [2]
    assert policy.evict(1) == [1]


def test_s3fifo_ghost_hit_enters_main() -> None:
    policy = S3FIFOPolicy()
    policy.insert(1, 555, 1, 1, 0)
    assert policy.evict(1) == [1]  # 555 goes to the ghost list
    policy.insert(2, 555, 5, 1, 0)  # same prefix, new block: a ghost hit, into main
    for block_id in (3, 4, 5):
        insert(policy, block_id, last_access=5 + block_id)
    assert policy.evict(3) == [3, 4, 5]  # small is over its share until empty
    assert 2 in policy


def test_s3fifo_ghost_list_is_bounded() -> None:
    policy = S3FIFOPolicy(ghost_capacity=1)
    policy.insert(1, 555, 1, 1, 0)
    policy.insert(2, 666, 2, 1, 0)
    assert policy.evict(2) == [1, 2]  # ghost keeps 666 only
    policy.insert(3, 555, 3, 1, 0)  # no longer a ghost: small queue
    policy.insert(4, 666, 4, 1, 0)  # a ghost: main queue
    assert policy.evict(1) == [3]


def test_s3fifo_a_hit_and_return_keeps_the_place_and_counts_as_reuse() -> None:
    policy = S3FIFOPolicy()
    insert(policy, 1, last_access=1)
    insert(policy, 2, last_access=2)
    policy.discard(1)  # hit
    insert(policy, 1, last_access=3, num_accesses=2)  # released: back with one reuse
    assert policy.evict(1) == [2]  # 1 sat at the head but was promoted to main


def test_reuse_lru_keeps_reused_blocks_a_cache_lifetime_longer() -> None:
    policy = ReuseLRUPolicy(age_smoothing=1.0)
    insert(policy, 1, last_access=0)
    insert(policy, 2, last_access=100)
    assert policy.evict(1) == [1]  # eviction age 100
    insert(policy, 3, last_access=150, num_accesses=2)  # key 250
    insert(policy, 4, last_access=200)
    assert policy.evict(3) == [2, 4, 3]


def test_reuse_lru_remembers_reuse_across_eviction_by_hash() -> None:
    policy = ReuseLRUPolicy(age_smoothing=1.0)
    policy.insert(1, 555, 0, 2, 0)
    policy.insert(2, 666, 100, 1, 0)
    assert policy.evict(1) == [1]  # eviction age 100; 555 was handed out twice
    policy.insert(3, 555, 150, 1, 0)  # fresh block, same prefix: still counts as reused
    policy.insert(4, 777, 200, 1, 0)
    assert policy.evict(2) == [2, 4]
    assert policy.evict(1) == [3]
    zero = ReuseLRUPolicy(history_capacity=0, age_smoothing=1.0)
    zero.insert(1, 555, 0, 2, 0)
    zero.insert(2, 666, 100, 1, 0)
    assert zero.evict(1) == [1]
    zero.insert(3, 555, 150, 1, 0)  # no history kept: plain LRU
    zero.insert(4, 777, 200, 1, 0)
    assert zero.evict(1) == [2] and zero.evict(1) == [3]


class FakeClock:
    """A settable clock for expiry tests."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


def test_priority_is_a_retention_policy() -> None:
    assert has_hook(PriorityPolicy(), "set_retention")
    assert not has_hook(policies.get("lru"), "set_retention")
    with pytest.raises(NotImplementedError, match="no retention priorities"):
        policies.get("lru").set_retention(1000, 90, None)


def test_priority_pinned_blocks_go_last_lru_within_a_priority() -> None:
    policy = PriorityPolicy()
    policy.set_retention(1000, 90, None)
    policy.set_retention(4000, 10, None)
    for block_id in (1, 2, 3, 4):
        insert(policy, block_id, last_access=block_id)
    assert policy.evict(4) == [4, 2, 3, 1]


def test_priority_expiry_falls_back_to_the_default() -> None:
    clock = FakeClock()
    policy = PriorityPolicy(clock=clock)
    policy.set_retention(1000, 90, expires_at=10)  # set before the block is cached
    insert(policy, 1, last_access=1)
    insert(policy, 2, last_access=2)
    assert policy.priority_of(1000) == 90
    clock.now = 10
    assert policy.priority_of(1000) == 35
    assert policy.evict(1) == [1]  # expired: plain LRU again


def test_priority_without_a_clock_expires_by_the_clock_it_has_seen() -> None:
    policy = PriorityPolicy()
    policy.set_retention(1000, 90, expires_at=5)
    insert(policy, 1, last_access=1)
    insert(policy, 2, last_access=3)
    assert policy.evict(1) == [2]
    insert(policy, 3, last_access=6)  # the clock passed 5
    assert policy.evict(1) == [1]


def test_priority_resetting_to_default_and_reranking_tracked_blocks() -> None:
    policy = PriorityPolicy()
    insert(policy, 1, last_access=1)
    insert(policy, 2, last_access=2)
    policy.set_retention(1000, 90, None)  # re-ranks the tracked block now
    assert policy.evict(1) == [2]
    insert(policy, 2, last_access=3)
    policy.set_retention(1000, 35, None)
    assert policy.evict(1) == [1]
    with pytest.raises(TypeError):
        policy.set_retention(1000, "high", None)  # type: ignore[arg-type]


@pytest.mark.parametrize("native", [False, True])
def test_priority_tolerates_two_leaves_with_one_hash(native: bool) -> None:
    """vLLM can cache one hash in two blocks: both are leaves, retention re-ranks the
    latest, and evicting both in either order works (it raised KeyError before)."""
    if native:
        from prefixcache.engine.native_engine import native_available

        if not native_available():
            pytest.skip("the native engine is not built")
        from prefixcache.engine import _native

        policy = _native.NativePolicy("priority", 8)
    else:
        policy = PriorityPolicy()
    policy.insert(1, 7000, 1, 1, 0)
    policy.insert(2, 7000, 2, 1, 0)  # the twin
    policy.insert(3, 3000, 3, 1, 0)
    policy.set_retention(7000, 90, None)  # re-ranks block 2, the latest with the hash
    assert policy.evict(3) == [1, 3, 2]
    policy.insert(1, 7000, 4, 1, 0)
    policy.insert(2, 7000, 5, 1, 0)
    policy.discard(2)
    policy.discard(1)
    assert len(policy) == 0


def test_priority_cap_lets_excess_pinned_blocks_compete_as_default() -> None:
    policy = PriorityPolicy(max_retained_fraction=0.5)
    for block_id in (1, 2, 3):
        policy.set_retention(block_id * 1000, 90, None)
        insert(policy, block_id, last_access=block_id)
    insert(policy, 4, last_access=4)
    # 3 of 4 pinned > half: the lowest pinned (oldest) competes as default and is older.
    assert policy.evict(1) == [1]
    # 2 of 3 pinned > half still: block 2 (last access 2) against block 4 (4).
    assert policy.evict(1) == [2]
    assert policy.evict(1) == [4]  # 1 of 2 pinned is within the cap
    uncapped = PriorityPolicy(max_retained_fraction=1.0)
    uncapped.set_retention(1000, 90, None)
    insert(uncapped, 1, last_access=1)
    insert(uncapped, 2, last_access=2)
    assert uncapped.evict(1) == [2]
