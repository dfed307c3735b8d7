"""Page-aware eviction (issue 17 part 5): victims that complete a free page go first.

The policy keeps the laws of every policy (``PolicyContract``, unbound and
bound to a fake page table); through the allocator it frees whole pages that
plain LRU leaves scattered, refuses a free list without matching pages, and
keeps the allocator's invariants while serving.
"""

from __future__ import annotations

import pytest
from prefixcache.policies import EvictionPolicy, LRUPolicy
from prefixcache.policies.page_aware import PageAwarePolicy

from prefixcache import KVBlockAllocator
from prefixcache.errors import ConfigError
from prefixcache.testing import PolicyContract
from prefixcache.testing.pages import fragmented_pool, whole_free_pages


class TestPageAwareContract(PolicyContract):
    def make_policy(self) -> EvictionPolicy:
        return PageAwarePolicy(page_size=4)


class TestPageAwareBoundContract(PolicyContract):
    def make_policy(self) -> EvictionPolicy:
        policy = PageAwarePolicy(page_size=3, inner=LRUPolicy())
        policy.bind_free_counts(lambda page: page % 3, lambda page: 3, lambda page: page % 2)
        return policy


def test_page_aware_frees_more_pages_than_lru_over_seeds() -> None:
    """A heuristic: it may lose on one state (a page's cached blocks with children elsewhere)."""
    page_size, totals = 8, [0, 0]
    for seed in range(6):
        lru = fragmented_pool("lru", page_size, seed)
        aware = fragmented_pool(PageAwarePolicy(page_size), page_size, seed)
        for allocator in (lru, aware):
            assert allocator.evict_cached_blocks(48) == 48
            allocator.check_invariants()
        totals[0] += whole_free_pages(lru, page_size)
        totals[1] += whole_free_pages(aware, page_size)
    assert totals[1] > totals[0]


def test_page_aware_evicts_the_leaves_of_an_almost_free_page_first() -> None:
    policy = PageAwarePolicy(page_size=4)
    allocator = KVBlockAllocator(
        total_count=13,
        device="cpu",
        engine="python",
        free_list="lowest",
        page_size_blocks=4,
        eviction_policy=policy,
        block_size_tokens=1,
    )
    ids = allocator.allocate_memory_blocks(12)
    for block_id in range(12):
        allocator.register_kv_block_hashes([block_id], [100 + block_id])
    allocator.release_memory_blocks(ids[[0, 4, 5, 6, 8, 9]])  # cached leaves
    allocator.release_memory_blocks(ids[[7]])  # and block 7 was touched last
    allocator.update_timestamps([7])
    # LRU would take 0 first (oldest); page 1 (4..7) is all leaves: it goes first.
    assert allocator.evict_cached_blocks(4) == 4
    assert [allocator._engine.describe_state(b) for b in (4, 5, 6, 7)] == ["free"] * 4
    assert allocator._engine.describe_state(0) == "cached"
    allocator.check_invariants()


def test_page_aware_needs_matching_pages() -> None:
    with pytest.raises(ConfigError, match="page_size_blocks=4"):
        KVBlockAllocator(total_count=9, device="cpu", eviction_policy=PageAwarePolicy(4))
    with pytest.raises(ConfigError, match="page_size_blocks=4"):
        KVBlockAllocator(
            total_count=9,
            device="cpu",
            free_list="lowest",
            page_size_blocks=2,
            eviction_policy=PageAwarePolicy(4),
        )
    with pytest.raises(ValueError):
        PageAwarePolicy(0)
