"""``evict_blocks`` and ``end_conversation``: a conversation's end frees its cached tail.

Both engines, every policy the engine runs by name: the given blocks that are
cached leaves go tail-first (a chain given in order is eaten from its end),
referenced, unregistered and non-leaf blocks are skipped, a shared prefix that
another chain hangs off stays, the policy afterwards tracks exactly the cached
leaves (the invariants check, and evicting everything takes exactly the rest),
and bad input raises the library's error with nothing changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from prefixcache import KVBlockAllocator, policies
from prefixcache.engine.native_engine import native_available
from prefixcache.errors import InvalidArgumentError, InvalidBlockIdError, PrefixCacheError
from prefixcache.testing.engine_setup import CACHING_POLICIES, cache_chain, small_allocator

ENGINES = ["python", "native"]


def _free(allocator: KVBlockAllocator) -> set[int]:
    """The free block IDs (the engine's free list)."""
    return set(allocator._engine.free_ids().tolist())


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("policy", CACHING_POLICIES)
def test_a_chain_given_in_order_is_freed_tail_first(engine: str, policy: str) -> None:
    allocator = small_allocator(engine, policy)
    chain = cache_chain(allocator, [11, 12, 13, 14])
    other = cache_chain(allocator, [21, 22])
    before = allocator.stats().num_evicted_blocks
    assert allocator.evict_blocks(chain) == 4
    assert allocator.stats().num_evicted_blocks == before + 4
    assert len(allocator.match_prefix([11])) == 0
    assert allocator.get_evictable_block_count() == 2
    allocator.check_invariants()
    # The policy tracks exactly the other chain's leaf: evicting everything frees it.
    assert allocator.evict_cached_blocks(10) == 2
    assert set(chain) | set(other) <= _free(allocator)
    allocator.check_invariants()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("policy", CACHING_POLICIES)
def test_a_freed_tail_exposes_its_parent_to_the_policy(engine: str, policy: str) -> None:
    allocator = small_allocator(engine, policy)
    chain = cache_chain(allocator, [11, 12, 13])
    assert allocator.evict_blocks([chain[2]]) == 1
    allocator.check_invariants()  # the parent is now a leaf the policy tracks
    assert allocator.evict_blocks([chain[0]]) == 0  # still has a child: skipped
    assert allocator.evict_cached_blocks(10) == 2
    allocator.check_invariants()


@pytest.mark.parametrize("engine", ENGINES)
def test_referenced_unregistered_and_inner_blocks_are_skipped(engine: str) -> None:
    allocator = small_allocator(engine)
    chain = cache_chain(allocator, [11, 12, 13])
    allocator.acquire_blocks([chain[1]])  # the middle block is referenced again
    unregistered = allocator.allocate_memory_blocks(1).tolist()  # active, no hash
    free = [min(_free(allocator))]
    assert allocator.evict_blocks(chain + unregistered + free) == 1  # the tail only
    assert len(allocator.match_prefix([11, 12, 13])) == 2
    allocator.check_invariants()
    allocator.release_memory_blocks([chain[1]])
    assert allocator.evict_blocks(chain + chain) == 2  # repeats are skipped too
    assert allocator.get_evictable_block_count() == 0
    allocator.check_invariants()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("policy", ["lru", "fifo", "s3fifo"])
def test_end_conversation_keeps_a_shared_prefix_another_chain_hangs_off(
    engine: str, policy: str
) -> None:
    allocator = small_allocator(engine, policy)
    prefix = cache_chain(allocator, [11, 12])
    mine = cache_chain(allocator, [13, 14], parent=12)
    theirs = cache_chain(allocator, [15], parent=12)
    hits_before = allocator.stats().num_hit_blocks
    assert allocator.end_conversation([11, 12, 13, 14]) == 2
    assert allocator.stats().num_hit_blocks == hits_before  # the lookup is no hit
    assert len(allocator.match_prefix([11, 12, 15])) == 3
    assert len(allocator.match_prefix([11, 12, 13])) == 2
    allocator.check_invariants()
    # Once the other chain ends too, the prefix goes with it.
    assert allocator.end_conversation([11, 12, 15]) == 3
    assert allocator.get_evictable_block_count() == 0
    assert set(prefix + mine + theirs) <= _free(allocator)
    allocator.check_invariants()


@pytest.mark.parametrize("engine", ENGINES)
def test_unknown_hashes_and_prefix_caching_off_free_nothing(engine: str) -> None:
    allocator = small_allocator(engine)
    cache_chain(allocator, [11, 12])
    assert allocator.end_conversation([99, 11, 12]) == 0
    assert allocator.end_conversation([]) == 0
    assert allocator.evict_blocks([]) == 0
    off = small_allocator(engine, enable_prefix_caching=False)
    assert off.end_conversation([11]) == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_ref_zero_frees_nothing(engine: str) -> None:
    allocator = small_allocator(engine, "ref_zero")
    ids = allocator.allocate_memory_blocks(2)
    allocator.register_kv_block_hashes(ids, [11, 12])
    assert allocator.evict_blocks(ids) == 0  # referenced
    allocator.release_memory_blocks(ids)  # ref-zero: freed at once
    assert allocator.end_conversation([11, 12]) == 0
    allocator.check_invariants()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ([0, 15], InvalidBlockIdError),  # the dummy block
        ([0, 16], InvalidBlockIdError),
        ([-1], InvalidBlockIdError),
        ([0.5], InvalidArgumentError),
    ],
)
def test_bad_ids_are_refused_with_nothing_changed(
    engine: str, bad: list[Any], error: type[PrefixCacheError], refuses: Callable[..., Any]
) -> None:
    allocator = small_allocator(engine)
    chain = cache_chain(allocator, [11, 12])
    refuses(allocator, error, allocator.evict_blocks, chain + bad)
    assert allocator.get_evictable_block_count() == 2


@pytest.mark.parametrize("engine", ENGINES)
def test_bad_hashes_are_refused_with_nothing_changed(
    engine: str, refuses: Callable[..., Any]
) -> None:
    allocator = small_allocator(engine)
    cache_chain(allocator, [11, 12])
    refuses(allocator, InvalidArgumentError, allocator.end_conversation, [11, "x"])
    refuses(allocator, InvalidArgumentError, allocator.end_conversation, [11, 2**80])


@pytest.mark.parametrize("engine", ENGINES)
def test_removal_events_are_emitted(engine: str) -> None:
    allocator = small_allocator(engine, kv_events_capacity=64)
    cache_chain(allocator, [11, 12])
    allocator.take_events()
    assert allocator.end_conversation([11, 12]) == 2
    removed = [e for e in allocator.take_events() if type(e).__name__ == "BlockRemoved"]
    assert len(removed) == 1
    assert len(removed[0].block_hashes) == 2


class _RaisesOnInsert(policies.LRUPolicy):
    """LRU whose ``insert`` raises once armed (before changing anything)."""

    armed = False

    def insert(self, *args: Any, **kwargs: Any) -> None:
        if self.armed:
            raise RuntimeError("injected")
        super().insert(*args, **kwargs)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_policy_that_raises_midway_leaves_everything_as_it_was(
    engine: str, digest: Callable[[KVBlockAllocator], Any]
) -> None:
    """The exposed parent's insert raises after the tail left the registry (natively: after
    the engine's first writes): the transaction takes every change back."""
    if engine == "native" and not native_available():
        pytest.skip("the native engine is not built")
    policy = _RaisesOnInsert()
    allocator = KVBlockAllocator(
        total_count=10, block_size_tokens=2, device="cpu", engine=engine, eviction_policy=policy
    )
    chain = cache_chain(allocator, [1, 2, 3])
    before = digest(allocator)
    policy.armed = True
    with pytest.raises(RuntimeError, match="injected"):
        allocator.evict_blocks([chain[2]])
    assert digest(allocator) == before
    policy.armed = False
    allocator.check_invariants()
    assert allocator.end_conversation([1, 2, 3]) == 3
