"""A policy that breaks its contract is caught: InvariantError, and the allocator unchanged.

The engine aborts the policy's transaction on the way out, so the policy is
as it was too (its victims put back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from prefixcache.policies import LRUPolicy

from prefixcache import InvariantError, KVBlockAllocator, compute_block_hashes

BLOCK_SIZE = 2


class ForgetfulLRU(LRUPolicy):
    """Tracks leaves like LRU but, once ``forget`` is set, claims to have none to evict."""

    forget = False

    def evict(self, num_blocks: int) -> list[int]:
        return [] if self.forget else super().evict(num_blocks)


class WrongVictimLRU(LRUPolicy):
    """Returns ``victim`` instead of what LRU would choose."""

    victim: Any = None

    def evict(self, num_blocks: int) -> list[int]:
        return [self.victim] if self.victim is not None else super().evict(num_blocks)


def full_allocator(policy: LRUPolicy, total_count: int) -> KVBlockAllocator:
    return KVBlockAllocator(
        total_count=total_count,
        block_size_tokens=BLOCK_SIZE,
        device="cpu",
        eviction_policy=policy,
    )


def register_chain(allocator: KVBlockAllocator, prompt: list[int]) -> list[int]:
    hashes = compute_block_hashes(prompt, BLOCK_SIZE)
    ids = allocator.allocate_memory_blocks(len(hashes))
    allocator.register_kv_block_hashes(ids, hashes)
    return ids.tolist()


def test_a_policy_claiming_no_leaves_while_one_is_cached(
    digest: Callable[[KVBlockAllocator], Any],
) -> None:
    policy = ForgetfulLRU()
    allocator = full_allocator(policy, total_count=3)  # two usable blocks
    allocator.release_memory_blocks(register_chain(allocator, [1, 2]))
    allocator.allocate_memory_blocks(1)  # no block is free now; one is cached
    policy.forget = True
    before = digest(allocator)
    with pytest.raises(InvariantError, match="has no leaf to evict"):
        allocator.allocate_memory_blocks(1)
    assert digest(allocator) == before
    assert not policy.in_transaction  # the engine aborted the policy's transaction


def test_a_policy_that_lost_a_leaf_below_a_pinned_block(
    digest: Callable[[KVBlockAllocator], Any],
) -> None:
    policy = ForgetfulLRU()
    allocator = full_allocator(policy, total_count=4)  # three usable blocks
    root, _middle, leaf = register_chain(allocator, [1, 2, 3, 4, 5, 6])
    allocator.release_memory_blocks([root, leaf])  # the middle block stays held: root is pinned
    policy.forget = True
    before = digest(allocator)
    with pytest.raises(InvariantError, match="holds 1 cached block"):
        allocator.allocate_memory_blocks(1)
    assert digest(allocator) == before
    assert not policy.in_transaction  # the engine aborted the policy's transaction
    policy.forget = False  # the same state with an honest policy evicts the leaf
    assert allocator.allocate_memory_blocks(1).tolist() == [leaf]


@pytest.mark.parametrize("victim", ["held", "parent", -1, 99, "x"])
def test_a_victim_that_is_not_a_cached_leaf_is_refused(
    victim: Any, digest: Callable[[KVBlockAllocator], Any]
) -> None:
    policy = WrongVictimLRU()
    allocator = full_allocator(policy, total_count=5)
    parent, child = register_chain(allocator, [1, 2, 3, 4])
    allocator.release_memory_blocks([parent, child])
    (held,) = register_chain(allocator, [7, 8])
    allocator.allocate_memory_blocks(1)
    policy.victim = {"held": held, "parent": parent}.get(victim, victim)
    before = digest(allocator)
    with pytest.raises(InvariantError, match="not one cached leaf"):
        allocator.allocate_memory_blocks(1)
    assert digest(allocator) == before
    assert not policy.in_transaction  # the engine aborted the policy's transaction
