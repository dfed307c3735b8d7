"""Unit tests of KVBlockAllocator, one group per public method.

Every test drives the allocator through its public API only and calls
``check_invariants()`` after each state change. Pools are small (16 blocks,
15 usable, the dummy is 15) and hashes are plain positive ints: the registry
does not care how they were computed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from prefixcache import (
    AllocatorStats,
    InvariantError,
    KVBlockAllocator,
    ReferenceCountError,
)


def hashes(base: int, count: int) -> list[int]:
    """``count`` distinct positive hashes starting at ``base``."""
    return [base + index for index in range(count)]


def cached_chain(allocator: KVBlockAllocator, base: int, count: int) -> list[int]:
    """Allocate, register and release a chain of ``count`` blocks; return its IDs."""
    blocks = allocator.allocate_memory_blocks(count)
    allocator.register_kv_block_hashes(blocks, hashes(base, count))
    allocator.release_memory_blocks(blocks)
    allocator.check_invariants()
    return blocks.tolist()


# ---------------------------------------------------------------- allocate_memory_blocks


def test_allocate_returns_distinct_fresh_int32_cpu_ids(allocator: KVBlockAllocator) -> None:
    first = allocator.allocate_memory_blocks(4)
    second = allocator.allocate_memory_blocks(3)
    allocator.check_invariants()
    for ids in (first, second):
        assert isinstance(ids, torch.Tensor)
        assert ids.dtype == torch.int32
        assert ids.device.type == "cpu"
        assert ids.ndim == 1
    every = first.tolist() + second.tolist()
    assert len(set(every)) == 7
    assert all(0 <= block_id < allocator.dummy_block_id for block_id in every)
    assert allocator.get_active_used() == 7
    assert allocator.pool.num_free == 8
    assert allocator.stats().num_allocated_blocks == 7


def test_allocate_zero_blocks_returns_an_empty_tensor(allocator: KVBlockAllocator) -> None:
    ids = allocator.allocate_memory_blocks(0)
    assert ids is not None
    assert ids.dtype == torch.int32 and ids.numel() == 0
    assert allocator.get_total_used() == 0


def test_allocate_accepts_numpy_integers(allocator: KVBlockAllocator) -> None:
    ids = allocator.allocate_memory_blocks(np.int64(2))
    assert ids is not None and len(ids) == 2


def test_allocate_the_whole_pool_then_none(allocator: KVBlockAllocator) -> None:
    ids = allocator.allocate_memory_blocks(allocator.num_usable)
    assert sorted(ids.tolist()) == list(range(allocator.num_usable))
    assert allocator.allocate_memory_blocks(1) is None
    assert not allocator.is_memory_available(1)
    allocator.check_invariants()


def test_returned_ids_are_not_views_of_internal_state(
    allocator: KVBlockAllocator, digest: Callable[[KVBlockAllocator], dict]
) -> None:
    ids = allocator.allocate_memory_blocks(3)
    assert not np.shares_memory(ids.numpy(), allocator.pool._stack)
    kept = ids.tolist()
    before = digest(allocator)
    ids.fill_(7)
    assert digest(allocator) == before
    # Later calls rewrite the stack slots these IDs came from; the tensor must not follow.
    snapshot = allocator.allocate_memory_blocks(2)
    expected = snapshot.tolist()
    allocator.release_memory_blocks(kept[::-1])
    allocator.release_memory_blocks(snapshot.flip(0).clone())
    assert allocator.allocate_memory_blocks(5) is not None
    assert snapshot.tolist() == expected
    allocator.check_invariants()


def test_match_and_register_results_are_fresh(
    allocator: KVBlockAllocator, digest: Callable[[KVBlockAllocator], dict]
) -> None:
    blocks = allocator.allocate_memory_blocks(2)
    mask = allocator.register_kv_block_hashes(blocks, hashes(10, 2))
    matched = allocator.match_prefix(hashes(10, 2))
    assert matched.dtype == torch.int32 and matched.tolist() == blocks.tolist()
    before = digest(allocator)
    mask.fill_(False)
    matched.fill_(0)
    blocks.fill_(0)
    assert digest(allocator) == before
    assert allocator.match_prefix(hashes(10, 2)).tolist() != [0, 0]


def test_allocate_evicts_cached_blocks_when_the_free_stack_is_short(
    allocator: KVBlockAllocator,
) -> None:
    cached = cached_chain(allocator, 10, 3)
    assert allocator.is_memory_available(allocator.num_usable)
    ids = allocator.allocate_memory_blocks(13)
    assert ids is not None
    assert allocator.stats().num_evicted_blocks == 1
    assert allocator.match_prefix(hashes(10, 3)).tolist() == cached[:2]
    allocator.check_invariants()


def test_a_fresh_block_carries_no_hash(allocator: KVBlockAllocator) -> None:
    """A block recycled through eviction comes back without its old hash."""
    cached_chain(allocator, 10, 1)
    ids = allocator.allocate_memory_blocks(allocator.num_usable)
    assert allocator.match_prefix([10]).numel() == 0
    allocator.release_memory_blocks(ids)
    assert allocator.get_evictable_block_count() == 0
    assert allocator.pool.num_free == allocator.num_usable
    allocator.check_invariants()


# ---------------------------------------------------------------- release_memory_blocks


def test_release_of_an_unhashed_block_frees_it_on_top_of_the_stack(
    allocator: KVBlockAllocator,
) -> None:
    ids = allocator.allocate_memory_blocks(3)
    allocator.release_memory_blocks(ids[1:2])
    allocator.check_invariants()
    assert allocator.get_active_used() == 2
    assert allocator.pool.free_ids()[-1] == ids[1]
    assert allocator.allocate_memory_blocks(1).tolist() == [int(ids[1])]


@pytest.mark.parametrize("form", ["list", "numpy", "int64_tensor", "int32_tensor"])
def test_release_accepts_every_id_form(allocator: KVBlockAllocator, form: str) -> None:
    ids = allocator.allocate_memory_blocks(3)
    values = ids.tolist()
    converted: Any = {
        "list": values,
        "numpy": np.array(values, dtype=np.int64),
        "int64_tensor": torch.tensor(values, dtype=torch.int64),
        "int32_tensor": ids,
    }[form]
    allocator.release_memory_blocks(converted)
    assert allocator.get_total_used() == 0
    allocator.check_invariants()


def test_release_with_a_duplicate_drops_two_references(allocator: KVBlockAllocator) -> None:
    block = allocator.allocate_memory_blocks(1)
    allocator.acquire_blocks(block)  # a second request shares it
    allocator.release_memory_blocks(block)
    assert allocator.get_active_used() == 1, "one reference is left"
    allocator.acquire_blocks(block)
    allocator.release_memory_blocks([int(block[0])] * 2)
    allocator.check_invariants()
    assert allocator.get_active_used() == 0
    assert allocator.pool.num_free == allocator.num_usable
    assert allocator.stats().num_released_references == 3


def test_release_of_a_hashed_block_caches_it_under_lru(allocator: KVBlockAllocator) -> None:
    blocks = allocator.allocate_memory_blocks(2)
    allocator.register_kv_block_hashes(blocks[:1], [10])
    allocator.release_memory_blocks(blocks)
    allocator.check_invariants()
    assert allocator.get_evictable_block_count() == 1
    assert allocator.stats().num_cached == 1
    assert allocator.pool.num_free == allocator.num_usable - 1
    assert int(blocks[0]) not in allocator.pool.free_ids().tolist()
    assert int(blocks[1]) in allocator.pool.free_ids().tolist()
    assert allocator.match_prefix([10]).tolist() == [int(blocks[0])]
    assert int(blocks[0]) in allocator.policy


def test_release_of_a_hashed_block_frees_it_under_ref_zero(
    make: Callable[..., KVBlockAllocator],
) -> None:
    allocator = make("ref_zero")
    blocks = allocator.allocate_memory_blocks(2)
    allocator.register_kv_block_hashes(blocks, [10, 11])
    allocator.acquire_blocks(blocks[:1])  # another request still holds the first block
    allocator.release_memory_blocks(blocks)
    allocator.check_invariants()
    assert allocator.match_prefix([10, 11]).tolist() == [int(blocks[0])]
    assert allocator.get_evictable_block_count() == 0
    allocator.release_memory_blocks(blocks[:1])
    allocator.check_invariants()
    assert allocator.match_prefix([10]).numel() == 0
    assert allocator.pool.num_free == allocator.num_usable
    assert allocator.stats().num_registered == 0


def test_release_of_paused_references(make: Callable[..., KVBlockAllocator]) -> None:
    allocator = make(paused_count=2)
    blocks = allocator.allocate_memory_blocks(2)
    allocator.pause(blocks)
    allocator.release_memory_blocks(blocks, paused=True)
    allocator.check_invariants()
    assert allocator.get_paused_used() == 0
    assert allocator.pool.num_free == allocator.num_usable


def test_release_of_an_empty_batch_changes_nothing(
    allocator: KVBlockAllocator, digest: Callable[[KVBlockAllocator], dict]
) -> None:
    allocator.allocate_memory_blocks(2)
    before = digest(allocator)
    allocator.release_memory_blocks([])
    allocator.release_memory_blocks(torch.empty(0, dtype=torch.int32))
    assert digest(allocator) == before


# ---------------------------------------------------------------- match_prefix / acquire_blocks


def test_match_prefix_returns_the_longest_registered_prefix(allocator: KVBlockAllocator) -> None:
    blocks = allocator.allocate_memory_blocks(3).tolist()
    allocator.register_kv_block_hashes(blocks, hashes(10, 3))
    assert allocator.match_prefix(hashes(10, 3)).tolist() == blocks
    assert allocator.match_prefix([*hashes(10, 3), 99]).tolist() == blocks
    assert allocator.match_prefix(hashes(10, 2)).tolist() == blocks[:2]
    assert allocator.match_prefix([10, 99, 12]).tolist() == blocks[:1], "stops at the first miss"
    assert allocator.match_prefix([99, 11, 12]).tolist() == []
    assert allocator.match_prefix([]).tolist() == []
    assert allocator.match_prefix(torch.tensor(hashes(10, 3))).tolist() == blocks
    assert allocator.match_prefix(np.array(hashes(10, 2))).tolist() == blocks[:2]


def test_match_prefix_counts_hits_and_misses_in_blocks(allocator: KVBlockAllocator) -> None:
    blocks = allocator.allocate_memory_blocks(2)
    allocator.register_kv_block_hashes(blocks, hashes(10, 2))
    allocator.match_prefix([10, 11, 12, 13])
    allocator.match_prefix([99])
    stats = allocator.stats()
    assert stats.num_queried_blocks == 5
    assert stats.num_hit_blocks == 2
    assert stats.hit_rate == pytest.approx(0.4)


def test_match_prefix_without_acquire_takes_no_reference(
    allocator: KVBlockAllocator, digest: Callable[[KVBlockAllocator], dict]
) -> None:
    cached_chain(allocator, 10, 2)
    before = digest(allocator)
    allocator.match_prefix(hashes(10, 2))
    after = digest(allocator)
    assert after["stats"].num_queried_blocks == 2
    counts = ("stats", "str", "clock", "counters")  # the statistics
    assert {k: v for k, v in after.items() if k not in counts} == {
        k: v for k, v in before.items() if k not in counts
    }, "only the hit statistics change"


def test_match_prefix_with_acquire_moves_cached_blocks_to_active(
    allocator: KVBlockAllocator,
) -> None:
    blocks = cached_chain(allocator, 10, 3)
    matched = allocator.match_prefix(hashes(10, 3), acquire=True)
    allocator.check_invariants()
    assert matched.tolist() == blocks
    assert allocator.get_active_used() == 3
    assert allocator.get_evictable_block_count() == 0
    assert len(allocator.policy) == 0
    assert not allocator.is_memory_available(allocator.pool.num_free + 1)
    allocator.release_memory_blocks(matched)
    allocator.check_invariants()
    assert allocator.get_evictable_block_count() == 3


def test_match_prefix_with_acquire_protects_the_prefix_from_eviction(
    allocator: KVBlockAllocator,
) -> None:
    blocks = cached_chain(allocator, 10, 3)
    matched = allocator.match_prefix(hashes(10, 2), acquire=True)
    assert matched.tolist() == blocks[:2]
    # 12 free + 1 evictable leaf: enough for 13, not for 14.
    assert allocator.allocate_memory_blocks(14) is None
    rest = allocator.allocate_memory_blocks(13)
    assert rest is not None and not set(rest.tolist()) & set(blocks[:2])
    allocator.check_invariants()
    assert allocator.match_prefix(hashes(10, 3)).tolist() == blocks[:2]


def test_match_prefix_with_acquire_adds_a_reference_to_an_active_block(
    allocator: KVBlockAllocator,
) -> None:
    blocks = allocator.allocate_memory_blocks(2)
    allocator.register_kv_block_hashes(blocks, hashes(10, 2))
    allocator.match_prefix(hashes(10, 2), acquire=True)
    allocator.release_memory_blocks(blocks)
    allocator.check_invariants()
    assert allocator.get_active_used() == 2, "the second request still holds both"
    allocator.release_memory_blocks(blocks)
    assert allocator.get_evictable_block_count() == 2


def test_match_prefix_with_acquire_and_a_repeated_hash_keeps_invariants(
    allocator: KVBlockAllocator,
) -> None:
    block = allocator.allocate_memory_blocks(1)
    allocator.register_kv_block_hashes(block, [10])
    allocator.release_memory_blocks(block)
    matched = allocator.match_prefix([10, 10], acquire=True)
    allocator.check_invariants()
    allocator.release_memory_blocks(matched)
    allocator.check_invariants()
    assert allocator.get_active_used() == 0


def test_match_prefix_with_prefix_caching_disabled(make: Callable[..., KVBlockAllocator]) -> None:
    allocator = make(enable_prefix_caching=False)
    blocks = allocator.allocate_memory_blocks(2)
    assert allocator.register_kv_block_hashes(blocks, [10, 11]).tolist() == [False, False]
    assert allocator.match_prefix([10, 11], acquire=True).tolist() == []
    allocator.release_memory_blocks(blocks)
    assert allocator.pool.num_free == allocator.num_usable
    allocator.check_invariants()


def test_acquire_blocks_takes_one_reference_per_occurrence(allocator: KVBlockAllocator) -> None:
    blocks = cached_chain(allocator, 10, 2)
    allocator.acquire_blocks([blocks[0], blocks[0], blocks[1]])
    allocator.check_invariants()
    assert allocator.get_active_used() == 2
    assert allocator.get_evictable_block_count() == 0
    allocator.release_memory_blocks(blocks)
    assert allocator.get_active_used() == 1
    with pytest.raises(ReferenceCountError):
        allocator.release_memory_blocks([blocks[1]])
    allocator.release_memory_blocks([blocks[0]])
    allocator.check_invariants()
    assert allocator.get_evictable_block_count() == 2


def test_acquire_blocks_on_a_cached_parent_keeps_its_cached_child_tracked(
    allocator: KVBlockAllocator,
) -> None:
    blocks = cached_chain(allocator, 10, 2)
    allocator.acquire_blocks(blocks[:1])
    allocator.check_invariants()
    assert blocks[1] in allocator.policy
    assert allocator.evict_cached_blocks(5) == 1
    assert allocator.match_prefix(hashes(10, 2)).tolist() == blocks[:1]


# ---------------------------------------------------------------- register_kv_block_hashes


def test_register_records_parent_links(allocator: KVBlockAllocator) -> None:
    blocks = allocator.allocate_memory_blocks(3).tolist()
    mask = allocator.register_kv_block_hashes(blocks, hashes(10, 3))
    allocator.check_invariants()
    assert mask.dtype == torch.bool and mask.tolist() == [True, True, True]
    registry = allocator.registry
    assert [int(registry.parent_of[b]) for b in blocks] == [-1, blocks[0], blocks[1]]
    assert [int(registry.num_children[b]) for b in blocks] == [1, 1, 0]
    assert [registry.hash_of(b) for b in blocks] == hashes(10, 3)
    assert allocator.stats().num_registered == 3


def test_register_is_idempotent(
    allocator: KVBlockAllocator, digest: Callable[[KVBlockAllocator], dict]
) -> None:
    blocks = allocator.allocate_memory_blocks(3)
    allocator.register_kv_block_hashes(blocks, hashes(10, 3))
    before = digest(allocator)
    again = allocator.register_kv_block_hashes(blocks, hashes(10, 3))
    assert again.tolist() == [True, True, True]
    assert allocator.register_kv_block_hashes(blocks[:2], hashes(10, 2)).tolist() == [True] * 2
    assert digest(allocator) == before
    assert allocator.registry.num_children[int(blocks[0])] == 1
    allocator.check_invariants()


def test_register_continues_a_chain_under_parent_hash(allocator: KVBlockAllocator) -> None:
    first = allocator.allocate_memory_blocks(2).tolist()
    allocator.register_kv_block_hashes(first, [10, 11])
    more = allocator.allocate_memory_blocks(1).tolist()
    assert allocator.register_kv_block_hashes(more, [12], parent_hash=11).tolist() == [True]
    allocator.check_invariants()
    assert allocator.match_prefix([10, 11, 12]).tolist() == first + more
    assert allocator.registry.parent_of[more[0]] == first[1]
    assert allocator.registry.depth_of[more[0]] == 2


def test_register_refuses_a_hash_held_by_another_block_and_continues_under_the_holder(
    allocator: KVBlockAllocator,
) -> None:
    first = allocator.allocate_memory_blocks(2).tolist()
    allocator.register_kv_block_hashes(first, [10, 11])
    second = allocator.allocate_memory_blocks(3).tolist()
    mask = allocator.register_kv_block_hashes(second, [10, 11, 12])
    allocator.check_invariants()
    assert mask.tolist() == [False, False, True]
    assert allocator.match_prefix([10, 11, 12]).tolist() == [*first, second[2]]
    assert allocator.registry.parent_of[second[2]] == first[1]
    assert allocator.registry.num_children[first[1]] == 1
    # The refused blocks stay unhashed: releasing them frees them instead of caching.
    allocator.release_memory_blocks(second[:2])
    allocator.check_invariants()
    assert set(second[:2]) <= set(allocator.pool.free_ids().tolist())


def test_register_under_a_cached_holder_takes_it_out_of_the_policy(
    allocator: KVBlockAllocator,
) -> None:
    cached = cached_chain(allocator, 10, 1)
    assert cached[0] in allocator.policy
    fresh = allocator.allocate_memory_blocks(2).tolist()
    assert allocator.register_kv_block_hashes(fresh, [10, 11]).tolist() == [False, True]
    allocator.check_invariants()
    assert cached[0] not in allocator.policy, "a parent is no leaf"


def test_register_a_paused_block(make: Callable[..., KVBlockAllocator]) -> None:
    allocator = make(paused_count=1)
    block = allocator.allocate_memory_blocks(1)
    allocator.pause(block)
    assert allocator.register_kv_block_hashes(block, [10]).tolist() == [True]
    allocator.release_memory_blocks(block, paused=True)
    allocator.check_invariants()
    assert allocator.get_evictable_block_count() == 1


def test_register_accepts_wide_hashes() -> None:
    """sha256 hashes do not fit int64; with that algorithm they are plain ints here."""
    allocator = KVBlockAllocator(total_count=8, device="cpu", hash_algo="sha256", engine="python")
    wide = [(1 << 127) + 5, (1 << 255) + 7]
    blocks = allocator.allocate_memory_blocks(2)
    assert allocator.register_kv_block_hashes(blocks, wide).tolist() == [True, True]
    assert allocator.match_prefix(wide).tolist() == blocks.tolist()


def test_hash_tokens_round_trip_and_salt(make: Callable[..., KVBlockAllocator]) -> None:
    allocator = make()
    tokens = list(range(10))
    chain = allocator.hash_tokens(tokens)
    assert len(chain) == 2, "only full blocks of 4 tokens get a hash"
    blocks = allocator.allocate_memory_blocks(2)
    allocator.register_kv_block_hashes(blocks, chain)
    allocator.release_memory_blocks(blocks)
    assert allocator.match_prefix(allocator.hash_tokens(tokens[:8])).tolist() == blocks.tolist()
    assert allocator.match_prefix(allocator.hash_tokens(tokens, salt="tenant")).numel() == 0
    salted = make(hash_salt="weights-v2")
    assert salted.hash_tokens(tokens) != chain


# ---------------------------------------------------------------- eviction


def test_eviction_eats_a_cached_chain_from_its_end(allocator: KVBlockAllocator) -> None:
    blocks = cached_chain(allocator, 10, 3)
    assert allocator.evict_cached_blocks(1) == 1
    allocator.check_invariants()
    assert allocator.match_prefix(hashes(10, 3)).tolist() == blocks[:2]
    assert allocator.pool.free_ids()[-1] == blocks[2]
    assert allocator.evict_cached_blocks(1) == 1
    assert allocator.match_prefix(hashes(10, 3)).tolist() == blocks[:1]
    allocator.check_invariants()
    assert allocator.stats().num_evicted_blocks == 2


def test_lru_evicts_the_least_recently_used_leaf_first(allocator: KVBlockAllocator) -> None:
    older = cached_chain(allocator, 10, 2)
    newer = cached_chain(allocator, 20, 2)
    assert allocator.evict_cached_blocks(1) == 1
    assert allocator.match_prefix(hashes(10, 2)).tolist() == older[:1]
    assert allocator.match_prefix(hashes(20, 2)).tolist() == newer
    allocator.check_invariants()


def test_update_timestamps_protects_a_block(allocator: KVBlockAllocator) -> None:
    older = cached_chain(allocator, 10, 2)
    newer = cached_chain(allocator, 20, 2)
    clock = allocator.clock
    allocator.update_timestamps(older)
    assert allocator.clock == clock + 1
    assert allocator.evict_cached_blocks(1) == 1
    assert allocator.match_prefix(hashes(10, 2)).tolist() == older
    assert allocator.match_prefix(hashes(20, 2)).tolist() == newer[:1]
    allocator.check_invariants()


def test_a_parent_exposed_by_eviction_keeps_its_age(allocator: KVBlockAllocator) -> None:
    """Evicting a leaf inserts its parent by the parent's own last access, not as new."""
    older = cached_chain(allocator, 10, 2)
    newer = cached_chain(allocator, 20, 1)
    assert allocator.evict_cached_blocks(1) == 1
    assert allocator.evict_cached_blocks(1) == 1
    assert allocator.match_prefix(hashes(10, 2)).numel() == 0
    assert allocator.match_prefix([20]).tolist() == newer
    assert set(older) <= set(allocator.pool.free_ids().tolist())
    allocator.check_invariants()


def test_eviction_order_does_not_depend_on_batch_size(
    make: Callable[..., KVBlockAllocator],
) -> None:
    survivors = []
    for batches in ([2], [1, 1]):
        allocator = make()
        cached_chain(allocator, 10, 2)
        cached_chain(allocator, 20, 1)
        for size in batches:
            assert allocator.evict_cached_blocks(size) == size
        allocator.check_invariants()
        survivors.append(
            (allocator.match_prefix([10, 11]).numel(), allocator.match_prefix([20]).numel())
        )
    assert survivors[0] == survivors[1]


def test_update_timestamps_on_active_blocks_is_remembered_when_they_are_cached(
    allocator: KVBlockAllocator,
) -> None:
    first = allocator.allocate_memory_blocks(1)
    allocator.register_kv_block_hashes(first, [10])
    second = cached_chain(allocator, 20, 1)
    allocator.update_timestamps(first)
    allocator.release_memory_blocks(first)
    assert allocator.evict_cached_blocks(1) == 1
    assert allocator.match_prefix([10]).tolist() == first.tolist()
    assert allocator.match_prefix([20]).numel() == 0
    assert second[0] in allocator.pool.free_ids().tolist()


def test_eviction_of_a_cached_parent_pinned_by_a_referenced_child(
    allocator: KVBlockAllocator,
) -> None:
    """A request released its prefix block but still holds the later ones."""
    blocks = allocator.allocate_memory_blocks(3).tolist()
    allocator.register_kv_block_hashes(blocks, hashes(10, 3))
    allocator.release_memory_blocks(blocks[:1])
    allocator.check_invariants()
    assert allocator.get_evictable_block_count() == 1
    assert len(allocator.policy) == 0, "a block with a registered child is no leaf"
    assert allocator.is_memory_available(13)
    ids = allocator.allocate_memory_blocks(13)
    assert ids is not None and blocks[0] in ids.tolist()
    allocator.check_invariants()
    # The held blocks lost their hashes with their parent: nothing is unreachable.
    assert allocator.match_prefix(hashes(10, 3)).numel() == 0
    assert allocator.match_prefix(hashes(11, 2)).numel() == 0
    allocator.release_memory_blocks(blocks[1:])
    allocator.check_invariants()
    assert allocator.get_evictable_block_count() == 0
    assert allocator.pool.num_free == 2


def test_evict_cached_blocks_evicts_a_pinned_parent(allocator: KVBlockAllocator) -> None:
    blocks = allocator.allocate_memory_blocks(2).tolist()
    allocator.register_kv_block_hashes(blocks, hashes(10, 2))
    allocator.release_memory_blocks(blocks[:1])
    assert allocator.evict_cached_blocks(1) == 1
    allocator.check_invariants()
    assert allocator.match_prefix(hashes(11, 1)).numel() == 0


def test_evict_cached_blocks_never_frees_more_than_asked(allocator: KVBlockAllocator) -> None:
    blocks = allocator.allocate_memory_blocks(3).tolist()
    allocator.register_kv_block_hashes(blocks, hashes(10, 3))
    allocator.release_memory_blocks(blocks[:2])
    assert allocator.get_evictable_block_count() == 2
    assert allocator.evict_cached_blocks(1) == 1
    allocator.check_invariants()


def test_evict_lru_blocks_is_all_or_nothing(
    allocator: KVBlockAllocator, digest: Callable[[KVBlockAllocator], dict]
) -> None:
    cached_chain(allocator, 10, 2)
    before = digest(allocator)
    assert allocator.evict_lru_blocks(3) is False
    assert digest(allocator) == before
    assert allocator.evict_lru_blocks(0) is True
    assert allocator.evict_lru_blocks(2) is True
    allocator.check_invariants()
    assert allocator.get_evictable_block_count() == 0
    assert allocator.pool.num_free == allocator.num_usable


def test_evict_cached_blocks_returns_how_many_it_freed(allocator: KVBlockAllocator) -> None:
    cached_chain(allocator, 10, 2)
    cached_chain(allocator, 20, 1)
    assert allocator.evict_cached_blocks(0) == 0
    assert allocator.evict_cached_blocks(2) == 2
    assert allocator.evict_cached_blocks(5) == 1
    assert allocator.evict_cached_blocks(5) == 0
    allocator.check_invariants()


def test_ref_zero_has_nothing_to_evict(make: Callable[..., KVBlockAllocator]) -> None:
    allocator = make("ref_zero")
    cached_chain(allocator, 10, 2)
    assert allocator.get_evictable_block_count() == 0
    assert allocator.evict_lru_blocks(1) is False
    assert allocator.evict_cached_blocks(1) == 0


# ---------------------------------------------------------------- partitions


def test_pause_and_resume_move_blocks_between_partitions(
    make: Callable[..., KVBlockAllocator],
) -> None:
    allocator = make(paused_count=4)
    assert (allocator.active_count, allocator.paused_count) == (11, 4)
    blocks = allocator.allocate_memory_blocks(3)
    allocator.pause(blocks[:2])
    allocator.check_invariants()
    assert allocator.get_active_used() == 1
    assert allocator.get_paused_used() == 2
    assert allocator.get_total_used() == 3
    assert allocator.get_active_avail() == 10
    assert allocator.get_paused_avail() == 2
    allocator.resume(blocks[:1])
    allocator.check_invariants()
    assert (allocator.get_active_used(), allocator.get_paused_used()) == (2, 1)
    assert allocator.get_paused_avail() == 3


def test_pause_of_one_of_two_references_keeps_the_block_active(
    make: Callable[..., KVBlockAllocator],
) -> None:
    allocator = make(paused_count=2)
    block = allocator.allocate_memory_blocks(1)
    allocator.acquire_blocks(block)
    allocator.pause(block)
    allocator.check_invariants()
    assert (allocator.get_active_used(), allocator.get_paused_used()) == (1, 0)
    allocator.release_memory_blocks(block)
    allocator.check_invariants()
    assert (allocator.get_active_used(), allocator.get_paused_used()) == (0, 1)
    allocator.resume([int(block[0])])
    assert (allocator.get_active_used(), allocator.get_paused_used()) == (1, 0)


def test_pause_and_resume_with_duplicates(make: Callable[..., KVBlockAllocator]) -> None:
    allocator = make(paused_count=2)
    block = int(allocator.allocate_memory_blocks(1)[0])
    allocator.acquire_blocks([block])
    allocator.pause([block, block])
    assert (allocator.get_active_used(), allocator.get_paused_used()) == (0, 1)
    allocator.release_memory_blocks([block], paused=True)
    assert allocator.get_paused_used() == 1
    allocator.resume([block])
    allocator.check_invariants()
    assert (allocator.get_active_used(), allocator.get_paused_used()) == (1, 0)


def test_paused_blocks_are_never_evicted(make: Callable[..., KVBlockAllocator]) -> None:
    allocator = make(paused_count=2)
    block = allocator.allocate_memory_blocks(1)
    allocator.register_kv_block_hashes(block, [10])
    allocator.pause(block)
    assert allocator.get_evictable_block_count() == 0
    assert allocator.allocate_memory_blocks(allocator.num_usable) is None
    assert allocator.match_prefix([10]).tolist() == block.tolist()


def test_is_memory_available_counts_free_and_cached(allocator: KVBlockAllocator) -> None:
    cached_chain(allocator, 10, 3)
    allocator.allocate_memory_blocks(10)
    assert allocator.pool.num_free == 2
    assert allocator.get_evictable_block_count() == 3
    assert allocator.is_memory_available(5)
    assert not allocator.is_memory_available(6)
    assert allocator.is_memory_available(0)


def test_counters_agree_with_stats(make: Callable[..., KVBlockAllocator]) -> None:
    allocator = make(paused_count=3)
    cached_chain(allocator, 10, 2)
    paused = allocator.allocate_memory_blocks(2)
    allocator.pause(paused)
    allocator.allocate_memory_blocks(4)
    stats = allocator.stats()
    assert stats.num_active == allocator.get_active_used() == 4
    assert stats.num_paused == allocator.get_paused_used() == 2
    assert stats.num_cached == allocator.get_evictable_block_count() == 2
    assert stats.num_free == allocator.pool.num_free == 7
    assert allocator.get_total_used() == 8
    assert stats.num_free + stats.num_active + stats.num_paused + stats.num_cached == 15


# ---------------------------------------------------------------- free_group


def test_free_group_frees_nothing_until_exit(allocator: KVBlockAllocator) -> None:
    first = allocator.allocate_memory_blocks(2)
    second = allocator.allocate_memory_blocks(1)
    with allocator.free_group():
        allocator.release_memory_blocks(first)
        allocator.release_memory_blocks(second)
        assert allocator.get_active_used() == 3
        assert allocator.pool.num_free == 12
        allocator.check_invariants()
    allocator.check_invariants()
    assert allocator.get_active_used() == 0
    assert allocator.pool.num_free == allocator.num_usable
    assert allocator.stats().num_released_references == 3


def test_free_group_merges_releases_of_a_shared_block(allocator: KVBlockAllocator) -> None:
    shared = allocator.allocate_memory_blocks(1)
    allocator.register_kv_block_hashes(shared, [10])
    allocator.acquire_blocks(shared)
    with allocator.free_group():
        allocator.release_memory_blocks(shared)
        allocator.release_memory_blocks(shared)
    allocator.check_invariants()
    assert allocator.get_evictable_block_count() == 1


def test_free_group_validates_each_release_when_called(
    allocator: KVBlockAllocator, digest: Callable[[KVBlockAllocator], dict]
) -> None:
    block = allocator.allocate_memory_blocks(1)
    with allocator.free_group():
        allocator.release_memory_blocks(block)
        before = digest(allocator)
        with pytest.raises(ReferenceCountError):
            allocator.release_memory_blocks(block)
        assert digest(allocator) == before
    allocator.check_invariants()
    assert allocator.pool.num_free == allocator.num_usable


def test_free_groups_nest(allocator: KVBlockAllocator) -> None:
    blocks = allocator.allocate_memory_blocks(2)
    with allocator.free_group():
        with allocator.free_group():
            allocator.release_memory_blocks(blocks[:1])
        assert allocator.get_active_used() == 2, "the inner exit applies nothing"
        allocator.release_memory_blocks(blocks[1:])
    allocator.check_invariants()
    assert allocator.get_active_used() == 0


def test_free_group_applies_its_releases_when_the_body_raises(
    allocator: KVBlockAllocator,
) -> None:
    blocks = allocator.allocate_memory_blocks(2)
    with pytest.raises(RuntimeError, match="scheduler"), allocator.free_group():
        allocator.release_memory_blocks(blocks)
        raise RuntimeError("scheduler failed")
    allocator.check_invariants()
    assert allocator.pool.num_free == allocator.num_usable


def test_paused_releases_inside_a_free_group_apply_at_once(
    make: Callable[..., KVBlockAllocator],
) -> None:
    allocator = make(paused_count=1)
    block = allocator.allocate_memory_blocks(1)
    allocator.pause(block)
    with allocator.free_group():
        allocator.release_memory_blocks(block, paused=True)
        assert allocator.get_paused_used() == 0
    allocator.check_invariants()


def test_pause_of_a_reference_queued_for_release_is_refused(
    make: Callable[..., KVBlockAllocator],
) -> None:
    allocator = make(paused_count=1)
    block = allocator.allocate_memory_blocks(1)
    with allocator.free_group():
        allocator.release_memory_blocks(block)
        with pytest.raises(ReferenceCountError):
            allocator.pause(block)
    allocator.check_invariants()


def test_free_group_does_not_keep_the_callers_tensor(allocator: KVBlockAllocator) -> None:
    blocks = allocator.allocate_memory_blocks(2)
    scratch = blocks[:1].clone()
    with allocator.free_group():
        allocator.release_memory_blocks(scratch)
        scratch[0] = blocks[1]  # the caller reuses its buffer
    allocator.check_invariants()
    assert allocator.get_active_used() == 1
    assert int(blocks[0]) in allocator.pool.free_ids().tolist()


# ---------------------------------------------------------------- clock, reset, str, stats


def test_clock_advances_on_hand_outs_and_on_request(allocator: KVBlockAllocator) -> None:
    assert allocator.clock == 0
    allocator.allocate_memory_blocks(1)
    assert allocator.clock == 1
    assert allocator.advance_clock(5) == 6
    assert allocator.advance_clock() == 7
    assert allocator.stats().clock == 7


def test_reset_returns_to_the_constructed_state(
    populated: SimpleNamespace, digest: Callable[[KVBlockAllocator], dict]
) -> None:
    allocator = populated.allocator
    fresh = KVBlockAllocator(allocator.config)
    allocator.reset()
    allocator.check_invariants()
    # The routing store's raw values may stay behind after reset: with their
    # written flags cleared they can no longer be read.
    after, constructed = digest(allocator), digest(fresh)
    del after["routing_data"], constructed["routing_data"]
    assert after == constructed
    assert allocator.get_block_routing(int(populated.chain_a[0])) is None
    assert allocator.match_prefix([101]).numel() == 0


def test_reset_inside_a_free_group_drops_queued_releases(allocator: KVBlockAllocator) -> None:
    blocks = allocator.allocate_memory_blocks(2)
    with allocator.free_group():
        allocator.release_memory_blocks(blocks)
        allocator.reset()
    allocator.check_invariants()
    assert allocator.pool.num_free == allocator.num_usable


def test_str_is_one_line_with_used_over_total_per_partition(
    make: Callable[..., KVBlockAllocator],
) -> None:
    allocator = make(paused_count=4)
    cached_chain(allocator, 10, 1)
    paused = allocator.allocate_memory_blocks(2)
    allocator.pause(paused)
    allocator.allocate_memory_blocks(3)
    text = str(allocator)
    assert "\n" not in text
    assert "total 6/15" in text
    assert "active 3/11" in text
    assert "paused 2/4" in text
    assert "cached 1" in text
    assert "KVBlockAllocator" in repr(allocator)


def test_stats_is_a_frozen_dataclass_of_counts_and_events(allocator: KVBlockAllocator) -> None:
    cached_chain(allocator, 10, 2)
    allocator.match_prefix([10, 11, 12], acquire=True)
    allocator.evict_cached_blocks(1)
    stats = allocator.stats()
    assert isinstance(stats, AllocatorStats)
    assert dataclasses.is_dataclass(stats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.num_free = 0  # type: ignore[misc]
    fields = {field.name for field in dataclasses.fields(stats)}
    assert {
        "total_count",
        "num_usable",
        "num_free",
        "num_active",
        "num_paused",
        "num_cached",
        "num_registered",
        "num_allocated_blocks",
        "num_released_references",
        "num_queried_blocks",
        "num_hit_blocks",
        "num_evicted_blocks",
        "clock",
    } <= fields
    assert (stats.total_count, stats.num_usable) == (16, 15)
    assert (stats.num_active, stats.num_cached, stats.num_registered) == (2, 0, 2)
    assert (stats.num_queried_blocks, stats.num_hit_blocks) == (3, 2)
    assert stats.num_allocated_blocks == 2
    assert stats.num_released_references == 2
    assert stats.num_evicted_blocks == 0, "nothing was cached when evict ran"


def test_stats_snapshot_does_not_follow_later_changes(allocator: KVBlockAllocator) -> None:
    stats = allocator.stats()
    allocator.allocate_memory_blocks(2)
    assert stats.num_free == 15
    assert allocator.stats().num_free == 13


def test_check_invariants_detects_corruption(allocator: KVBlockAllocator) -> None:
    """Proves check_invariants is no no-op: break one private counter and it complains."""
    allocator.allocate_memory_blocks(2)
    allocator.check_invariants()
    allocator._engine.ledger.num_active += 1
    with pytest.raises(InvariantError, match="active"):
        allocator.check_invariants()
