"""The allocator's counters and clock: what each call counts, exactly.

``tests/MUTATION.md`` lists the mutants these tests kill and the survivors that are equivalent.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from prefixcache.policies import LRUPolicy

from prefixcache import KVBlockAllocator

Make = Callable[..., KVBlockAllocator]
Chain = Callable[..., list[int]]


# ---------------------------------------------------------------------- counters


def test_a_fresh_allocator_counts_nothing(make_small: Make) -> None:
    stats = make_small(LRUPolicy()).stats()
    assert stats.num_dropped_blocks == 0
    assert stats.num_rejected_hits == 0
    assert stats.num_dropped_events == 0


def test_dropped_events_are_counted(chain: Chain) -> None:
    allocator = KVBlockAllocator(
        total_count=8, block_size_tokens=2, device="cpu", kv_events_capacity=1
    )
    for block_hash in (11, 21, 31):
        chain(allocator, [block_hash])
    assert allocator.stats().num_dropped_events == 2


def test_each_allocation_and_hit_ticks_the_clock_once(make_small: Make, chain: Chain) -> None:
    allocator = make_small(LRUPolicy())
    allocator.allocate_memory_blocks(1)
    allocator.allocate_memory_blocks(1)
    assert allocator.clock == 2
    assert allocator.advance_clock(0) == 2
    chain(allocator, [11])
    allocator.match_prefix([11], acquire=True)
    assert allocator.clock == 4


def test_every_rejected_verified_hit_is_counted() -> None:
    allocator = KVBlockAllocator(
        total_count=8, block_size_tokens=2, device="cpu", verify_prefix_hits=True
    )
    ids = allocator.allocate_memory_blocks(1)
    allocator.register_kv_block_hashes(ids, [11], fingerprints=[5])
    for _ in range(2):
        assert allocator.match_prefix([11], fingerprints=[6]).tolist() == []
    assert allocator.stats().num_rejected_hits == 2


def test_ref_zero_counts_every_dropped_block_and_keeps_other_routing(chain: Chain) -> None:
    allocator = KVBlockAllocator(
        total_count=8,
        block_size_tokens=2,
        device="cpu",
        eviction_policy="ref_zero",
        routing_num_layers=1,
        routing_top_k=1,
    )
    kept = allocator.allocate_memory_blocks(1)
    allocator.store_block_routing(int(kept[0]), torch.ones((2, 1, 1), dtype=torch.int64))
    for block_hash in (11, 21):
        allocator.release_memory_blocks(chain(allocator, [block_hash]))
    assert allocator.stats().num_dropped_blocks == 2
    assert allocator.get_block_routing(int(kept[0])) is not None
    assert allocator.get_evictable_block_count() == 0


@pytest.mark.parametrize("registered", [False, True])
def test_releasing_an_unhashed_block_keeps_the_routing_of_others(
    registered: bool, chain: Chain
) -> None:
    allocator = KVBlockAllocator(
        total_count=8, block_size_tokens=2, device="cpu", routing_num_layers=1, routing_top_k=1
    )
    if registered:
        chain(allocator, [11])
    kept, released = allocator.allocate_memory_blocks(2).tolist()
    for block_id in (kept, released):
        allocator.store_block_routing(block_id, torch.ones((2, 1, 1), dtype=torch.int64))
    allocator.release_memory_blocks([released])
    assert allocator.get_block_routing(kept) is not None
