"""A request served the way an engine composes it from the allocator's calls.

Hash, match and pin the cached prefix, allocate the rest, register the new full
blocks, and (unless kept) release everything: the five calls an engine makes per
request without ``admit_request``. Stateful tests run it on two allocators (two
engines, or an engine and a policy object) and compare what each returned.
"""

from __future__ import annotations

from prefixcache.engine.allocator import KVBlockAllocator


def serve_composed(
    allocator: KVBlockAllocator, tokens: list[int], block_size: int, *, keep: bool
) -> list[int] | None:
    """Serve ``tokens``: the request's block IDs (hits first), or None if the pool is short.

    The last token is never matched (a request must compute at least one), so the
    match stops one block short when the prompt fills its last block. A refused
    allocation releases the pinned hits and returns None; errors propagate as the
    allocator raises them. With ``keep=False`` the blocks are released again.
    """
    hashes = allocator.hash_tokens(tokens)
    limit = (len(tokens) - 1) // block_size if tokens else 0
    hit = allocator.match_prefix(hashes[:limit], acquire=True).tolist()
    new = allocator.allocate_memory_blocks(-(-len(tokens) // block_size) - len(hit))
    if new is None:
        allocator.release_memory_blocks(hit)
        return None
    new_ids = new.tolist()
    if len(hashes) > len(hit):
        allocator.register_kv_block_hashes(
            new_ids[: len(hashes) - len(hit)],
            hashes[len(hit) :],
            parent_hash=hashes[len(hit) - 1] if hit else None,
        )
    if not keep:
        allocator.release_memory_blocks(hit + new_ids)
    return hit + new_ids
