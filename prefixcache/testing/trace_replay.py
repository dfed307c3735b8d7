"""A capacity-bound trace replay for tests: the model of ``prefixcache.tools.replay``.

Tests of a policy's shortcuts replay a trace twice (shortcut taken, shortcut
refused) and compare what came out; this is the one loop they share.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.reference.trace import TRACE_BLOCK_SIZE, TraceRequest, trace_block_hashes


def replay_hits_and_evictions(
    requests: list[TraceRequest], capacity: int, **config: Any
) -> tuple[int, int]:
    """Replay ``requests`` keeping at most ``capacity`` blocks cached: (hits, evicted blocks).

    Each request matches its chain, allocates and registers the rest, releases
    everything, then the cache is trimmed to ``capacity`` by eviction.
    ``config`` goes to :class:`~prefixcache.KVBlockAllocator` (e.g.
    ``eviction_policy``, ``engine``).
    """
    chains = [np.array(trace_block_hashes(r.hash_ids), dtype=np.int64) for r in requests]
    allocator = KVBlockAllocator(
        total_count=capacity + max(len(c) for c in chains) + 1,
        block_size_tokens=TRACE_BLOCK_SIZE,
        device="cpu",
        **config,
    )
    hits = 0
    for hashes in chains:
        hit_ids = allocator.match_prefix(hashes, acquire=True)
        hits += len(hit_ids)
        fresh = allocator.allocate_memory_blocks(len(hashes) - len(hit_ids))
        assert fresh is not None
        if len(fresh):
            parent = int(hashes[len(hit_ids) - 1]) if len(hit_ids) else None
            allocator.register_kv_block_hashes(fresh, hashes[len(hit_ids) :], parent_hash=parent)
            allocator.release_memory_blocks(fresh)
        allocator.release_memory_blocks(hit_ids)
        excess = allocator.get_evictable_block_count() - capacity
        if excess > 0:
            allocator.evict_cached_blocks(excess)
    return hits, allocator.stats().num_evicted_blocks
