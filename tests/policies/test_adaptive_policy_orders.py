"""Eviction order of the adaptive policies: ARC and the learned reuse hazard.

The shared laws run over these policies in ``test_policy_orders.py`` and
``test_contract.py``; this file checks what makes each one different.
"""

from __future__ import annotations

import pytest
from prefixcache.policies import ARCPolicy, HazardPolicy


def insert(policy, block_id: int, last_access: int, num_accesses: int = 1, depth: int = 0) -> None:
    """Insert with the block ID times 1000 as its hash."""
    policy.insert(block_id, block_id * 1000, last_access, num_accesses, depth)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (ARCPolicy, {"ghost_capacity": -1}),
        (ARCPolicy, {"initial_recency_share": 1.5}),
        (HazardPolicy, {"history_capacity": -1}),
        (HazardPolicy, {"half_life": 0}),
        (HazardPolicy, {"prior_weight": 0}),
        (HazardPolicy, {"age_smoothing": 0}),
        (HazardPolicy, {"window": -1.0}),
    ],
)
def test_bad_arguments_are_refused(cls: type, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        cls(**kwargs)


# ----------------------------------------------------------------------------- arc


def test_arc_evicts_once_used_leaves_before_reused_ones_while_t1_is_over_its_share() -> None:
    policy = ARCPolicy(initial_recency_share=0.0)
    insert(policy, 1, last_access=1, num_accesses=2)  # T2, the oldest
    insert(policy, 2, last_access=2)
    insert(policy, 3, last_access=3)
    assert policy.evict(2) == [2, 3]
    assert policy.evict(1) == [1]


def test_arc_takes_from_t2_when_t1_is_within_its_share() -> None:
    policy = ARCPolicy(initial_recency_share=1.0)
    insert(policy, 1, last_access=1)
    insert(policy, 2, last_access=2, num_accesses=3)
    insert(policy, 3, last_access=3, num_accesses=3)
    assert policy.evict(2) == [2, 3]


def test_arc_ghost_hits_move_the_recency_share_both_ways() -> None:
    policy = ARCPolicy(initial_recency_share=0.0)
    insert(policy, 1, last_access=1)
    insert(policy, 2, last_access=2, num_accesses=2)
    assert policy.evict(1) == [1]  # hash 1000 goes to B1
    insert(policy, 1, last_access=5)  # the hash comes back: recency was too short
    assert policy.recency_share > 0.0
    assert policy.evict(1) == [2]  # block 1 came back into T2, where block 2 is older
    raised = policy.recency_share
    insert(policy, 2, last_access=6)  # back from B2: frequency was too short
    assert policy.recency_share < raised


def test_arc_a_hit_and_return_or_a_touch_moves_the_leaf_to_t2() -> None:
    policy = ARCPolicy(initial_recency_share=0.0)
    insert(policy, 1, last_access=1)
    insert(policy, 2, last_access=2)
    insert(policy, 3, last_access=3)
    policy.discard(1)
    insert(policy, 1, last_access=4, num_accesses=2)  # hit, then released
    policy.touch(2, now=5)
    assert policy.evict(1) == [3]  # the only leaf left in T1
    assert policy.evict(2) == [1, 2]  # T2, oldest first


def test_arc_ghost_lists_are_bounded() -> None:
    policy = ARCPolicy(ghost_capacity=1, initial_recency_share=0.0)
    for block_id in (1, 2):
        insert(policy, block_id, last_access=block_id)
    assert policy.evict(2) == [1, 2]  # B1 keeps only hash 2000
    insert(policy, 1, last_access=3)  # forgotten: a new once-used leaf
    insert(policy, 2, last_access=4)  # remembered: into T2, and p rises to 1
    insert(policy, 5, last_access=5, num_accesses=2)
    assert policy.evict(3) == [2, 5, 1]  # T2 first; had B1 kept 1000, block 1 would lead


def test_arc_clear_resets_the_recency_share() -> None:
    policy = ARCPolicy(initial_recency_share=0.25)
    insert(policy, 1, last_access=1)
    policy.evict(1)
    insert(policy, 1, last_access=2)
    assert policy.recency_share != 0.25
    policy.clear()
    assert len(policy) == 0 and policy.recency_share == 0.25


# ----------------------------------------------------------------------------- hazard


def test_hazard_without_statistics_is_lru() -> None:
    policy = HazardPolicy()
    insert(policy, 1, last_access=5, depth=3)
    insert(policy, 2, last_access=1, depth=40)
    insert(policy, 3, last_access=3, num_accesses=4)
    assert policy.evict(3) == [2, 3, 1]


def train(policy: HazardPolicy, rounds: int) -> int:
    """Teach ``policy`` that shallow blocks come back 10 ticks after use and deep ones never.

    Returns the clock after training.
    """
    now = 0
    for round_number in range(rounds):
        shallow, deep = 10_000 + round_number, 20_000 + round_number
        now += 1
        insert(policy, shallow, last_access=now, depth=0)
        insert(policy, deep, last_access=now, depth=40)
        policy.discard(shallow)
        insert(policy, shallow, last_access=now + 10, num_accesses=2, depth=0)  # a hit
        now += 10
        victims = policy.evict(2)
        assert set(victims) == {shallow, deep}
    return now


def test_hazard_learns_to_evict_a_never_reused_class_before_an_older_reused_one() -> None:
    policy = HazardPolicy()
    now = train(policy, rounds=200)
    insert(policy, 1, last_access=now + 1, depth=0)  # older, of the class that comes back
    insert(policy, 2, last_access=now + 5, depth=40)  # younger, of the class that never does
    assert policy.evict(1) == [2]


def test_hazard_clear_forgets_what_it_learned() -> None:
    policy = HazardPolicy()
    now = train(policy, rounds=200)
    policy.clear()
    insert(policy, 1, last_access=now + 1, depth=0)
    insert(policy, 2, last_access=now + 5, depth=40)
    assert policy.evict(1) == [1]  # LRU again


def test_hazard_stale_heap_keys_are_compacted() -> None:
    policy = HazardPolicy()
    insert(policy, 1, last_access=0)
    for now in range(1, 1000):
        policy.touch(1, now)
    assert sum(len(heap) for heap in policy._heaps) <= 2 * len(policy) + 64
    assert policy.evict(2) == [1]
