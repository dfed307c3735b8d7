"""Engine test fixtures beside the suite-wide ones in ``tests/conftest.py``."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from prefixcache import KVBlockAllocator


@pytest.fixture
def cached_chain(
    make_small: Callable[..., KVBlockAllocator],
) -> tuple[KVBlockAllocator, list[int]]:
    """A small LRU allocator with one active unhashed block and a cached chain of two.

    Returns the allocator and the chain's block IDs (hashes 11 and 12), with
    its invariants checked: the starting point of the checker's corruptions.
    """
    allocator = make_small()
    allocator.allocate_memory_blocks(1)
    chain = allocator.allocate_memory_blocks(2)
    allocator.register_kv_block_hashes(chain, [11, 12])
    allocator.release_memory_blocks(chain)
    allocator.check_invariants()
    return allocator, chain.tolist()
