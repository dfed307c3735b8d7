"""Locality and defragmentation: a scattered pool compacted mid-run, its KV data intact.

Run: python examples/defragment.py

Requests come and go on a pool with the lowest-first free list; the cached
prompts and the running requests end up scattered. ``plan_defragment`` moves
every live block to the lowest free IDs, ``apply_defragment`` copies the KV
data with the cache's ``copy_blocks`` and moves the allocator's state, and the
block table follows. A prefix hit after the move finds the same K/V values
under the new IDs. Then a page-aware policy shows what it frees. DESIGN.md,
"Locality" and "Defragmentation".
"""

from __future__ import annotations

import numpy as np
import torch
from prefixcache.policies.page_aware import PageAwarePolicy

from prefixcache import KVBlockAllocator
from prefixcache.serving.block_table import BlockTable
from prefixcache.serving.kv_cache import KVCache

BLOCKS = 64


def main() -> None:
    allocator = KVBlockAllocator(
        total_count=BLOCKS + 1, device="cpu", free_list="lowest", block_size_tokens=1
    )
    cache = KVCache(
        1, BLOCKS + 1, block_size=1, k_heads=1, k_head_dim=1, dtype=torch.float32, device="cpu"
    )
    table = BlockTable(16, 8, allocator.dummy_block_id, device="cpu")
    rng = np.random.default_rng(0)
    slots, prompts = [], []
    for request in range(12):
        ids = allocator.allocate_memory_blocks(5)
        assert ids is not None  # the pool has room for every prompt
        values = torch.arange(5, dtype=torch.float32).reshape(5, 1, 1) + 100 * request
        cache.write(0, ids, [0] * 5, values, values)
        hashes = [1000 * request + position for position in range(1, 6)]
        allocator.register_kv_block_hashes(ids, hashes)
        slots.append(table.add_request(ids))
        prompts.append(hashes)
    for request in rng.permutation(12)[:8]:  # eight finish: their prompts stay cached
        allocator.release_memory_blocks(table.remove_request(slots[request]))
    allocator.evict_cached_blocks(17)  # memory pressure took some, scattered
    before = allocator.stats()
    print(f"before: {before.num_free} free, fragmentation {before.fragmentation:.2f}")

    plan = allocator.plan_defragment()
    allocator.apply_defragment(plan, copy=cache.copy_blocks)
    table.apply_moves(plan.sources, plan.destinations)
    after = allocator.stats()
    print(f"moved {len(plan)} blocks: fragmentation {after.fragmentation:.2f}")
    allocator.check_invariants()
    for request, hashes in enumerate(prompts):
        hit = allocator.match_prefix(hashes)
        if len(hit):
            keys, _ = cache.gather(0, hit)
            expected = [100.0 * request + p for p in range(len(hit))]
            assert keys.flatten().tolist() == expected, request
    print("every cached prompt still reads its own K/V after the move")

    # Page-aware eviction: memory a paged KV store can give back.
    for policy in ("lru", PageAwarePolicy(page_size=8)):
        paged = KVBlockAllocator(
            total_count=BLOCKS + 1,
            device="cpu",
            free_list="lowest",
            page_size_blocks=8,
            eviction_policy=policy,
            block_size_tokens=1,
        )
        held = []
        for request in range(16):
            ids = paged.allocate_memory_blocks(4)
            assert ids is not None
            paged.register_kv_block_hashes(ids, [10 * request + p for p in range(1, 5)])
            held.append(ids)
        for request in range(16):
            if request % 4 != 1:  # every fourth request keeps running
                paged.release_memory_blocks(held[request])
        paged.evict_cached_blocks(16)
        free = np.zeros(BLOCKS, dtype=bool)
        free[paged._engine.free_ids()] = True
        pages = int(free.reshape(-1, 8).all(axis=1).sum())
        print(f"{type(paged.policy).__name__}: 16 blocks evicted, {pages} whole pages free")


if __name__ == "__main__":
    main()
