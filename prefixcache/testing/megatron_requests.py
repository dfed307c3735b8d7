"""Megatron-core's ``add_request`` bookkeeping, for tests and benchmarks of the drop-in.

What ``DynamicInferenceContext.add_request`` does to its allocator for a
prompt of full blocks: match the cached prefix through
``kv_hash_to_block_id``, pin it (``block_ref_counts[ids] += 1`` and
``update_timestamps``), allocate the rest, roll the pin back when the pool is
short, register the new blocks with their parents, tick the LRU clock.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["add_request", "admit"]


def add_request(allocator: Any, hashes: list[int]) -> torch.Tensor | None:
    """The request's block IDs (cached prefix first), or None when the pool is short.

    ``allocator`` is Megatron's ``KVBlockAllocator`` or the drop-in; its
    ``context`` needs ``prefix_cache_lru_clock``.
    """
    return admit(allocator, hashes)[0]


def admit(allocator: Any, hashes: list[int]) -> tuple[torch.Tensor | None, int]:
    """:func:`add_request`'s block IDs, and how many of them came from the cache.

    The peer benchmark (``benchmarks/bench_peers.py``) reads the count for its hit rate.
    """
    matched = []
    for block_hash in hashes:
        if block_hash not in allocator.kv_hash_to_block_id:
            break
        matched.append(allocator.kv_hash_to_block_id[block_hash])
    pinned = torch.tensor(matched, dtype=torch.int32)
    if matched:
        allocator.block_ref_counts[pinned] += 1
        allocator.update_timestamps(pinned)
    new = allocator.allocate_memory_blocks(len(hashes) - len(matched))
    if new is None:
        if matched:
            allocator.block_ref_counts[pinned] -= 1
        return None, 0
    parents = [hashes[k - 1] if k else 0 for k in range(len(matched), len(hashes))]
    allocator.register_kv_block_hashes(new.tolist(), hashes[len(matched) :], parents)
    allocator.context.prefix_cache_lru_clock += 1
    return torch.cat([pinned, new]), len(matched)
