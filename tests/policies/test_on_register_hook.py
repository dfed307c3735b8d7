"""The optional ``on_register`` hook: a policy hears of every hash registered, with its depth."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from prefixcache.policies import LRUPolicy, has_hook

from prefixcache import KVBlockAllocator, compute_block_hashes

BLOCK_SIZE = 2


class ObservingLRU(LRUPolicy):
    """LRU that records the registration runs it is told about, or raises on demand."""

    def __init__(self) -> None:
        super().__init__()
        self.runs: list[tuple[list[int], int]] = []
        self.fail = False

    def on_register(self, block_hashes: list[int], first_depth: int) -> None:
        if self.fail:
            raise RuntimeError("hook failed")
        self.runs.append((list(block_hashes), first_depth))


def make(policy: Any) -> KVBlockAllocator:
    return KVBlockAllocator(
        total_count=16, block_size_tokens=BLOCK_SIZE, device="cpu", eviction_policy=policy
    )


def test_the_base_class_tells_an_overridden_hook_from_its_default() -> None:
    assert has_hook(ObservingLRU(), "on_register")
    assert not has_hook(LRUPolicy(), "on_register")
    assert LRUPolicy().on_register([1, 2], 0) is None  # the default does nothing
    with pytest.raises(ValueError, match="not an optional hook"):
        has_hook(LRUPolicy(), "insert")


def test_runs_arrive_with_the_depth_of_their_first_block() -> None:
    policy = ObservingLRU()
    allocator = make(policy)
    hashes = compute_block_hashes(list(range(8)), BLOCK_SIZE)
    allocator.register_kv_block_hashes(allocator.allocate_memory_blocks(4), hashes)
    # A request that shares two blocks and continues with one of its own.
    longer = compute_block_hashes([0, 1, 2, 3, 9, 9], BLOCK_SIZE)
    allocator.match_prefix(longer[:2], acquire=True)
    allocator.register_kv_block_hashes(
        allocator.allocate_memory_blocks(1), longer[2:], parent_hash=longer[1]
    )
    # Slow path: the first hash is held by another block, the chain continues under it.
    allocator.register_kv_block_hashes(allocator.allocate_memory_blocks(2), [hashes[0], 12345])
    assert policy.runs == [(hashes, 0), ([longer[2]], 2), ([12345], 1)]


def test_registering_again_tells_nothing() -> None:
    policy = ObservingLRU()
    allocator = make(policy)
    hashes = compute_block_hashes(list(range(4)), BLOCK_SIZE)
    ids = allocator.allocate_memory_blocks(2)
    allocator.register_kv_block_hashes(ids, hashes)
    allocator.register_kv_block_hashes(ids, hashes)
    assert policy.runs == [(hashes, 0)]


@pytest.mark.parametrize("fresh", [True, False])
def test_a_raising_hook_leaves_the_allocator_unchanged(
    fresh: bool, digest: Callable[[KVBlockAllocator], Any]
) -> None:
    policy = ObservingLRU()
    allocator = make(policy)
    hashes = compute_block_hashes(list(range(4)), BLOCK_SIZE)
    allocator.register_kv_block_hashes(allocator.allocate_memory_blocks(2), hashes)
    ids = allocator.allocate_memory_blocks(2)
    # Fresh: a new chain. Not fresh: its first hash is held, so the slow path plans it.
    chain = [111, 222] if fresh else [hashes[0], 333]
    before = digest(allocator)
    policy.fail = True
    with pytest.raises(RuntimeError, match="hook failed"):
        allocator.register_kv_block_hashes(ids, chain)
    assert digest(allocator) == before
    policy.fail = False
    expected = [True, True] if fresh else [False, True]
    assert allocator.register_kv_block_hashes(ids, chain).tolist() == expected
