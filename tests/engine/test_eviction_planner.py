"""The eviction planner's rare paths, and the victims a wrong policy names.

A free block or the same block twice named as victim is refused; a policy
that runs dry after exposing a parent is caught; two pinned subtrees go in
one eviction; the recency tie-break between pinned blocks; the chain
shortcut of ``evicts_first``; evicted blocks are handed out last evicted first.

``tests/MUTATION.md`` lists the mutants these tests kill and the survivors that are equivalent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from prefixcache.policies import LRUPolicy

from prefixcache import InvariantError, KVBlockAllocator

Digest = Callable[[KVBlockAllocator], Any]
Make = Callable[..., KVBlockAllocator]
Chain = Callable[..., list[int]]
Flaky = Callable[..., tuple[Any, KVBlockAllocator]]


class ScriptedLRU(LRUPolicy):
    """LRU whose ``evict`` answers from ``script`` (a list of replies) while it lasts."""

    def __init__(self) -> None:
        super().__init__()
        self.script: list[list[Any]] = []

    def evict(self, num_blocks: int) -> list[int]:
        if self.script:
            return self.script.pop(0)
        return super().evict(num_blocks)


class DryAfterLRU:
    """An LRU that hands out ``budget`` victims, then claims to have none.

    It wraps :class:`LRUPolicy` rather than subclassing it so that it does
    not predict victims (no ``evicts_first``): an exposed parent is inserted.
    """

    retains_unreferenced = True

    def __init__(self, budget: int = 1_000) -> None:
        self.budget = budget
        self._lru = LRUPolicy()

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        self._lru.insert(block_id, block_hash, last_access, num_accesses, depth)

    def discard(self, block_id: int) -> None:
        self._lru.discard(block_id)

    def touch(self, block_id: int, now: int) -> None:
        self._lru.touch(block_id, now)

    def evict(self, num_blocks: int) -> list[int]:
        if self.budget <= 0:
            return []
        victims = self._lru.evict(min(num_blocks, self.budget))
        self.budget -= len(victims)
        return victims

    def clear(self) -> None:
        self._lru.clear()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._lru


# ---------------------------------------------------------------------- victims refused


def test_a_free_block_named_as_victim_is_refused(
    digest: Digest, make_small: Make, chain: Chain
) -> None:
    policy = ScriptedLRU()
    allocator = make_small(policy)
    (cached,) = chain(allocator, [11])
    allocator.release_memory_blocks([cached])
    free_id = int(allocator.pool.free_ids()[0])
    policy.script = [[free_id]]
    before = digest(allocator)
    with pytest.raises(InvariantError, match=rf"^policy ScriptedLRU chose \[{free_id}\], not one"):
        allocator.evict_cached_blocks(1)
    assert digest(allocator) == before


def test_the_same_victim_named_twice_is_refused(
    digest: Digest, make_small: Make, chain: Chain
) -> None:
    policy = ScriptedLRU()
    allocator = make_small(policy)
    first, second = chain(allocator, [11]) + chain(allocator, [21])
    allocator.release_memory_blocks([first, second])
    policy.script = [[first], [first]]
    before = digest(allocator)
    with pytest.raises(InvariantError, match=rf"chose \[{first}\], not one cached leaf"):
        allocator.evict_cached_blocks(2)
    assert digest(allocator) == before
    assert policy.eviction_order() == [first, second]


# ---------------------------------------------------------------------- planner paths


def test_a_parent_exposed_by_its_last_child_is_offered_to_the_policy(
    make_small: Make, chain: Chain
) -> None:
    allocator = make_small(DryAfterLRU())
    parent, left = chain(allocator, [11, 12])
    (right,) = chain(allocator, [13], parent_hash=11)
    allocator.release_memory_blocks([parent, left, right])
    assert allocator.evict_cached_blocks(2) == 2
    assert allocator.is_hash_registered(11)
    assert parent in allocator.policy  # both children gone: a leaf again
    assert allocator.evict_cached_blocks(1) == 1
    assert not allocator.is_hash_registered(11)
    allocator.check_invariants()


def test_a_policy_that_runs_dry_after_exposing_a_parent_is_caught(
    digest: Digest, make_small: Make, chain: Chain
) -> None:
    policy = DryAfterLRU()
    allocator = make_small(policy)
    parent, child = chain(allocator, [11, 12])
    allocator.release_memory_blocks([parent, child])
    policy.budget = 1  # the child goes; the exposed parent is inserted, then never named
    before = digest(allocator)
    with pytest.raises(
        InvariantError,
        match=r"^policy DryAfterLRU has no leaf to evict, yet cached blocks remain$",
    ):
        allocator.evict_cached_blocks(2)
    assert digest(allocator) == before


def test_a_lost_leaf_below_a_pinned_block_is_reported_with_the_policy_name(
    make_small: Make, chain: Chain
) -> None:
    policy = DryAfterLRU()
    allocator = make_small(policy)
    root, _middle, leaf = chain(allocator, [11, 12, 13])
    allocator.release_memory_blocks([root, leaf])
    policy.budget = 0
    with pytest.raises(
        InvariantError,
        match=rf"^policy DryAfterLRU has no leaf to evict, yet the subtree of pinned block "
        rf"{root} holds 1 cached block\(s\) below it$",
    ):
        allocator.evict_cached_blocks(1)


def test_one_eviction_drops_two_pinned_subtrees(make_small: Make, chain: Chain) -> None:
    allocator = make_small(LRUPolicy())
    first_root, first_held = chain(allocator, [11, 12])
    allocator.advance_clock()
    second_root, second_held = chain(allocator, [21, 22])
    allocator.release_memory_blocks([first_root, second_root])  # pinned by their children
    assert allocator.evict_cached_blocks(2) == 2
    assert allocator.pool.free_ids().tolist()[-2:] == [first_root, second_root]  # older first
    for block_hash in (11, 12, 21, 22):
        assert not allocator.is_hash_registered(block_hash)
    assert allocator.get_evictable_block_count() == 0
    assert allocator.stats().num_evicted_blocks == 2
    allocator.release_memory_blocks([first_held, second_held])  # unhashed now: freed
    assert allocator.get_total_used() == 0
    allocator.check_invariants()


@pytest.mark.parametrize("older_first", [True, False])
def test_the_least_recently_used_of_equally_deep_pinned_blocks_goes(
    older_first: bool, make_small: Make
) -> None:
    allocator = make_small(LRUPolicy())
    low_root, low_held = allocator.allocate_memory_blocks(2).tolist()
    high_root, high_held = allocator.allocate_memory_blocks(2).tolist()
    order = [(low_root, low_held, 11), (high_root, high_held, 21)]
    if not older_first:
        order.reverse()
    for root, held, block_hash in order:
        allocator.register_kv_block_hashes([root, held], [block_hash, block_hash + 1])
        allocator.advance_clock()
    allocator.release_memory_blocks([low_root, high_root])
    oldest_root, _, oldest_hash = order[0]
    assert allocator.evict_cached_blocks(1) == 1
    assert allocator.pool.free_ids().tolist()[-1] == oldest_root
    assert not allocator.is_hash_registered(oldest_hash)
    assert allocator.is_hash_registered(order[1][2])


def test_a_chain_is_evicted_from_its_end_without_reinserting_its_inner_blocks(flaky: Flaky) -> None:
    policy, allocator = flaky()
    # One allocation and no clock tick between the registrations: equal last-access times,
    # so the exposed parent's prediction compares block IDs too.
    parent, child, other = allocator.allocate_memory_blocks(3).tolist()
    assert child < other and parent < other  # LRU breaks the tie between equal times by ID
    allocator.register_kv_block_hashes([parent, child], [11, 12])
    allocator.register_kv_block_hashes([other], [21])
    allocator.release_memory_blocks([parent, child, other])
    policy.inserted.clear()
    assert allocator.evict_cached_blocks(2) == 2
    assert policy.inserted == []  # the parent went straight from prediction to eviction
    assert allocator.pool.free_ids().tolist()[-2:] == [child, parent]
    assert allocator.is_hash_registered(21) and not allocator.is_hash_registered(11)
    assert policy.eviction_order() == [other]
    allocator.check_invariants()


# ---------------------------------------------------------------------- counters


def test_an_allocation_hands_out_evicted_blocks_last_evicted_first(
    make_small: Make, chain: Chain
) -> None:
    allocator = make_small(LRUPolicy(), total_count=3)
    (older,) = chain(allocator, [11])
    allocator.advance_clock()
    (newer,) = chain(allocator, [21])
    allocator.release_memory_blocks([older, newer])
    handed_out = allocator.allocate_memory_blocks(2)
    assert handed_out.dtype == torch.int32 and handed_out.tolist() == [newer, older]
