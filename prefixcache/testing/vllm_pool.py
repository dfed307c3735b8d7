"""Driving a vLLM ``BlockPool`` as vLLM's KV cache manager does, for tests and benchmarks.

The steps of a request through ``vllm.v1.core.block_pool.BlockPool`` (look up
the longest cached prefix, touch it, allocate the rest, cache the full blocks,
free in reverse) with the plugin installed or not, and chained 32-byte block
hashes shaped as vLLM's ``BlockHash``. vLLM itself is not imported: the pool is
whatever the caller built.
"""

from __future__ import annotations

from typing import Any

__all__ = ["VllmRequest", "admit", "chain", "serve"]


class VllmRequest:
    """What ``BlockPool.cache_full_blocks`` reads of a vLLM request (events off)."""

    def __init__(self, block_hashes: list[bytes]) -> None:
        self.block_hashes = block_hashes


def chain(*ids: int) -> list[bytes]:
    """Chained 32-byte block hashes (vLLM's ``BlockHash``) for blocks of content ``ids``."""
    hashes, parent = [], 0
    for value in ids:
        parent = hash((parent, value)) & ((1 << 64) - 1)
        hashes.append(parent.to_bytes(32, "big"))
    return hashes


def admit(pool: Any, hashes: list[bytes]) -> tuple[list[Any], int]:
    """vLLM's manager's steps: longest cached prefix, touch it, allocate, cache the rest.

    Returns the request's blocks and how many came from the cache.
    """
    hit: list[Any] = []
    for block_hash in hashes:
        found = pool.get_cached_block(block_hash, [0])
        if not found:
            break
        hit.append(found[0])
    pool.touch(hit)
    blocks = hit + pool.get_new_blocks(len(hashes) - len(hit))
    pool.cache_full_blocks(VllmRequest(hashes), blocks, len(hit), len(hashes), 16, 0)
    return blocks, len(hit)


def serve(pool: Any, hashes: list[bytes]) -> int:
    """Admit and release one request (blocks freed in reverse, as vLLM); return its hit."""
    blocks, num_hit = admit(pool, hashes)
    pool.free_blocks(reversed(blocks))
    return num_hit
