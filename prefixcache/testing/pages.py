"""Fragmented pools for page-aware eviction: build one, count its whole free pages.

A kernel that reads KV pages of several blocks wants whole pages free; these
helpers build the state where that is hard (a full pool of requests of 1-8
blocks, each its own chain, a quarter still running) and measure it, for the
page-aware policy's tests and ``benchmarks/bench_locality.py``.
"""

from __future__ import annotations

import numpy as np

from prefixcache.engine.allocator import KVBlockAllocator

__all__ = ["fragmented_pool", "whole_free_pages"]


def whole_free_pages(allocator: KVBlockAllocator, page_size: int) -> int:
    """How many aligned pages of ``page_size`` blocks are wholly free (Python engine's pool)."""
    free = np.zeros(allocator.num_usable, dtype=bool)
    free[allocator._engine.free_ids()] = True
    whole = allocator.num_usable // page_size * page_size
    return int(free[:whole].reshape(-1, page_size).all(axis=1).sum())


def fragmented_pool(
    policy: object, page_size: int, seed: int, total_count: int = 257
) -> KVBlockAllocator:
    """A full pool of requests of 1..8 blocks (each its own chain), a quarter still running.

    The Python engine with the lowest-first free list and ``page_size`` blocks
    a page; ``policy`` evicts. Seeded, so the same state every time.
    """
    allocator = KVBlockAllocator(
        total_count=total_count,
        device="cpu",
        engine="python",
        free_list="lowest",
        page_size_blocks=page_size,
        eviction_policy=policy,
        block_size_tokens=1,
    )
    rng = np.random.default_rng(seed)
    requests, next_hash = [], 1
    while allocator.stats().num_free:
        count = min(int(rng.integers(1, 9)), allocator.stats().num_free)
        ids = allocator.allocate_memory_blocks(count)
        assert ids is not None  # count <= num_free
        allocator.register_kv_block_hashes(ids, list(range(next_hash, next_hash + count)))
        next_hash += count
        requests.append(ids)
    for index in rng.permutation(len(requests)):
        if rng.random() >= 0.25:
            allocator.release_memory_blocks(requests[index])
    return allocator
