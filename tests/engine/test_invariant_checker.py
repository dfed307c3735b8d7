"""check_invariants() detects each kind of corruption.

Every property test relies on ``check_invariants()``; a checker that never
fired would make them all vacuous. Corruption cannot be produced through the
public API (that is the point), so these tests write private state on purpose.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from prefixcache import (
    InvariantError,
    KVBlockAllocator,
)

Make = Callable[..., KVBlockAllocator]
CachedChain = tuple[KVBlockAllocator, list[int]]


# ---------------------------------------------------------------------- the checker fires


def test_check_invariants_reports_a_negative_count(cached_chain: CachedChain) -> None:
    allocator, _ = cached_chain
    allocator._engine.refs.active[5] = -1
    with pytest.raises(InvariantError, match="negative"):
        allocator.check_invariants()


def test_check_invariants_reports_a_referenced_dummy_block(cached_chain: CachedChain) -> None:
    allocator, _ = cached_chain
    allocator._engine.refs.paused[allocator.dummy_block_id] = 1
    with pytest.raises(InvariantError, match="dummy block 9"):
        allocator.check_invariants()


def test_check_invariants_reports_a_block_on_the_free_stack_twice(make_small: Make) -> None:
    allocator = make_small()
    allocator.allocate_memory_blocks(1)
    pool = allocator.pool
    pool._stack[pool.num_free - 1] = pool._stack[0]  # the top now repeats the bottom
    with pytest.raises(InvariantError, match="free stack twice"):
        allocator.check_invariants()


def test_check_invariants_reports_a_held_block_on_the_free_stack(make_small: Make) -> None:
    allocator = make_small()
    held = int(allocator.allocate_memory_blocks(1)[0])
    allocator.pool.release(np.array([held], dtype=np.int32))  # freed behind the counts' back
    with pytest.raises(InvariantError, match=f"block {held}: on free stack=True"):
        allocator.check_invariants()


def test_check_invariants_reports_a_wrong_counter(cached_chain: CachedChain) -> None:
    allocator, _ = cached_chain
    allocator._engine.ledger.num_cached += 1
    with pytest.raises(InvariantError, match="cached counter 3 but 2 cached blocks"):
        allocator.check_invariants()


def test_check_invariants_reports_a_policy_tracking_the_wrong_blocks(
    cached_chain: CachedChain,
) -> None:
    allocator, chain = cached_chain
    allocator.policy.insert(chain[0], 11, 0, 1, 0)  # a cached block with a child
    with pytest.raises(InvariantError, match="policy tracks 2 blocks, 1 cached leaves"):
        allocator.check_invariants()
    allocator.policy.discard(chain[1])  # and the real leaf is no longer tracked
    with pytest.raises(InvariantError, match=f"cached leaf {chain[1]} is not tracked"):
        allocator.check_invariants()


def test_check_invariants_reports_cached_blocks_under_ref_zero(make_small: Make) -> None:
    allocator = make_small("ref_zero")
    block = allocator.allocate_memory_blocks(1)
    allocator.register_kv_block_hashes(block, [21])
    allocator._engine.refs.active[int(block[0])] = 0  # unreferenced but still registered
    allocator._engine.ledger.num_active, allocator._engine.ledger.num_cached = 0, 1
    with pytest.raises(InvariantError, match="keeps nothing but 1 blocks are cached"):
        allocator.check_invariants()


def test_check_invariants_reports_releases_queued_outside_a_group(make_small: Make) -> None:
    allocator = make_small()
    block = int(allocator.allocate_memory_blocks(1)[0])
    allocator._engine.refs.pending[block] = 1
    with pytest.raises(InvariantError, match="queued outside a free group"):
        allocator.check_invariants()


def test_check_invariants_reports_a_broken_hash_map(cached_chain: CachedChain) -> None:
    allocator, chain = cached_chain
    allocator.registry._block_of_hash[99] = chain[0]  # a second hash for one block
    with pytest.raises(InvariantError, match="hash 99 maps to block"):
        allocator.check_invariants()


def test_check_invariants_reports_an_unregistered_parent(cached_chain: CachedChain) -> None:
    allocator, chain = cached_chain
    allocator.registry._is_registered[chain[0]] = False
    with pytest.raises(InvariantError, match="unregistered parent"):
        allocator.check_invariants()
