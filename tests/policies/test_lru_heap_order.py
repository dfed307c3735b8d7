"""LRU's lazy-deletion heap: the order and the memory bound survive rebuilds and aborts.

Written first to kill mutants that survived the main suite (it never touched
a leaf often enough to rebuild the heap, so a broken rebuild went
unnoticed): these tests drive the policy past the rebuild threshold and check
the eviction order and the memory bound the class docstring promises. An
abort pushes old keys back onto a heap that may still hold them as stale
entries; the duplicates must never yield a victim twice.
"""

from __future__ import annotations

import pytest
from prefixcache.policies import LRUPolicy

SLACK = 64
"""Stale heap entries tolerated beyond twice the live ones before a rebuild."""


def _insert(policy: LRUPolicy, block_id: int, last_access: int) -> None:
    policy.insert(block_id, block_hash=1000 + block_id, last_access=last_access,
                  num_accesses=1, depth=0)  # fmt: skip


def test_touching_an_unknown_leaf_names_it() -> None:
    policy = LRUPolicy()
    _insert(policy, 1, last_access=0)
    with pytest.raises(KeyError) as raised:
        policy.touch(7, now=5)
    assert raised.value.args == (7,)
    assert len(policy) == 1 and 7 not in policy


def test_order_survives_heap_rebuilds() -> None:
    policy = LRUPolicy()
    for block_id in range(4):
        _insert(policy, block_id, last_access=block_id)
    # 400 touches leave ~400 stale entries: the heap is rebuilt several times.
    for now in range(10, 410):
        policy.touch(now % 3, now)
    # Last touches: block 0 at 408, 1 at 409, 2 at 407; block 3 was never touched.
    assert policy.eviction_order() == [3, 2, 0, 1]
    assert policy.evict(4) == [3, 2, 0, 1]
    assert len(policy) == 0 and policy.evict(1) == []


def test_rebuild_after_discards_keeps_the_survivors() -> None:
    policy = LRUPolicy()
    for block_id in range(200):
        _insert(policy, block_id, last_access=block_id)
    for block_id in range(0, 200, 2):
        policy.discard(block_id)
    assert len(policy) == 100
    assert policy.evict(3) == [1, 3, 5]
    policy.touch(7, now=1000)
    assert policy.evict(200) == [*range(9, 200, 2), 7]


def test_stale_entries_are_dropped_lazily_but_stay_bounded() -> None:
    # White-box on purpose: the docstring promises O(n) memory through lazy
    # deletion with a rebuild once stale entries pass 2 * live + 64; only the
    # heap's length shows it.
    policy = LRUPolicy()
    _insert(policy, 0, last_access=0)
    for now in range(1, 2 + SLACK):
        policy.touch(0, now)
        assert len(policy._heap) == now + 1  # lazy: no rebuild yet
    policy.touch(0, 2 + SLACK)
    assert len(policy._heap) == 1  # the entry that made it 2 * 1 + 65 triggered a rebuild
    assert policy.eviction_order() == [0]

    for block_id in range(1, 300):
        _insert(policy, block_id, last_access=block_id)
    for step in range(3000):
        policy.touch(step % 300, 1000 + step)
        assert len(policy._heap) <= 2 * len(policy) + SLACK
    for block_id in range(300):
        policy.discard(block_id)
        assert len(policy._heap) <= 2 * len(policy) + SLACK


def test_evicts_first_compares_with_the_oldest_live_leaf() -> None:
    policy = LRUPolicy()
    assert policy.evicts_first(9, 1009, last_access=100, num_accesses=1, depth=0)
    _insert(policy, 1, last_access=5)
    assert policy.evicts_first(2, 1002, last_access=4, num_accesses=1, depth=0)
    assert not policy.evicts_first(2, 1002, last_access=6, num_accesses=1, depth=0)
    # Ties go to the lower block ID, as in evict().
    assert policy.evicts_first(0, 1000, last_access=5, num_accesses=1, depth=0)
    assert not policy.evicts_first(2, 1002, last_access=5, num_accesses=1, depth=0)
    assert policy.eviction_order() == [1] and len(policy) == 1


def test_evicts_first_skips_stale_entries() -> None:
    policy = LRUPolicy()
    _insert(policy, 1, last_access=1)
    _insert(policy, 2, last_access=5)
    policy.touch(1, now=10)  # (1, 1) is now stale, on top of the heap
    assert policy.evicts_first(3, 1003, last_access=3, num_accesses=1, depth=0)
    assert not policy.evicts_first(3, 1003, last_access=7, num_accesses=1, depth=0)
    policy.discard(2)  # only block 1, last touched at 10, is live
    assert policy.evicts_first(3, 1003, last_access=7, num_accesses=1, depth=0)
    assert policy.evict(2) == [1]


def test_an_abort_across_heap_rebuilds_restores_the_order_without_duplicate_victims() -> None:
    policy = LRUPolicy()
    for block_id in range(4):
        _insert(policy, block_id, last_access=block_id)
    policy.begin()
    for now in range(10, 410):  # rebuilds the heap several times inside the transaction
        policy.touch(now % 3, now)
    assert policy.evict(2) == [3, 2]
    policy.discard(0)
    policy.abort()
    assert policy.eviction_order() == [0, 1, 2, 3]
    assert len(policy._heap) > len(policy)  # old keys pushed back beside stale ones
    assert policy.evict(10) == [0, 1, 2, 3]
    assert len(policy) == 0 and policy.evict(1) == []
