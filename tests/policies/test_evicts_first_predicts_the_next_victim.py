"""``evicts_first`` predicts exactly what insert-then-evict(1) would do, and changes nothing."""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prefixcache.policies import has_hook

from prefixcache import policies

PREDICTING = [
    name
    for name in policies.available()
    if name != "belady"  # needs the future; its order never uses the prediction
    and has_hook(policies.get(name), "evicts_first")
]


def test_lru_and_fifo_predict() -> None:
    assert {"lru", "fifo"} <= set(PREDICTING)


def test_the_default_predicts_nothing() -> None:
    policy = policies.get("slru")
    assert not has_hook(policy, "evicts_first")
    policy.insert(1, 101, 5, 1, 0)
    assert policy.evicts_first(2, 102, 1, 1, 0) is False  # it would be, but no prediction


@pytest.mark.parametrize("name", PREDICTING)
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_prediction_matches_insert_then_evict(name: str, seed: int) -> None:
    rng = random.Random(seed)
    policy = policies.get(name)
    tracked: set[int] = set()
    for _ in range(rng.randint(0, 40)):  # a random history of a cache's calls
        block_id = rng.randrange(30)
        action = rng.random()
        if block_id not in tracked and action < 0.5:
            policy.insert(block_id, block_id + 100, rng.randrange(20), 1, 0)
            tracked.add(block_id)
        elif block_id in tracked and action < 0.7:
            policy.touch(block_id, rng.randrange(20, 40))
        elif block_id in tracked and action < 0.85:
            policy.discard(block_id)
            tracked.discard(block_id)
        elif tracked and action < 0.95:
            tracked.difference_update(policy.evict(1))
    candidate = next(b for b in range(30, 60) if b not in tracked)
    last_access = rng.randrange(45)
    order_before = copy.deepcopy(policy).evict(len(policy))
    probe = copy.deepcopy(policy)  # the round trip, from the state the prediction saw
    predicted = policy.evicts_first(candidate, candidate + 100, last_access, 1, 0)
    assert copy.deepcopy(policy).evict(len(policy)) == order_before  # nothing moved
    probe.insert(candidate, candidate + 100, last_access, 1, 0)
    assert predicted == (probe.evict(1) == [candidate])
