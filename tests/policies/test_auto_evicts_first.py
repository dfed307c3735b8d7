"""``auto`` on replays: ``evicts_first`` books an eviction as the round trip would; bounds hold.

The engine evicts an exposed parent that ``evicts_first`` names without
inserting it; ``auto`` then books that eviction's statistics (new uses,
duel) itself. Replaying a trace with the shortcut and with it refused must
give the same hits, evictions, charges and metadata.
"""

from __future__ import annotations

import numpy as np
import pytest
from prefixcache.policies.auto import AutoPolicy

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.reference.trace import TRACE_BLOCK_SIZE, TraceRequest, trace_block_hashes
from prefixcache.tools.workloads import documents_with_hot_prefixes, multi_turn_chats


class _Counting(AutoPolicy):
    """``auto`` counting the shortcuts it granted."""

    granted = 0

    def evicts_first(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> bool:
        answer = super().evicts_first(block_id, block_hash, last_access, num_accesses, depth)
        self.granted += answer
        return answer


class _RoundTrip(AutoPolicy):
    """``auto`` refusing every shortcut: every exposed parent is inserted, then evicted."""

    def evicts_first(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> bool:
        return False


def _replay(requests: list[TraceRequest], capacity: int, policy: AutoPolicy) -> tuple[int, int]:
    """The replay model of prefixcache.tools.replay, on a given policy object: (hits, evicted)."""
    chains = [np.array(trace_block_hashes(r.hash_ids), dtype=np.int64) for r in requests]
    allocator = KVBlockAllocator(
        total_count=capacity + max(len(c) for c in chains) + 1,
        block_size_tokens=TRACE_BLOCK_SIZE,
        eviction_policy=policy,
        device="cpu",
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


@pytest.mark.parametrize(
    ("trace", "capacity"),
    [
        (documents_with_hot_prefixes(300, seed=2, num_hot_prefixes=8, hot_prefix_blocks=12), 120),
        (multi_turn_chats(400, seed=3, num_conversations=40), 200),
    ],
    ids=["documents", "chats"],
)
@pytest.mark.parametrize("switch_z", [0.0, 1.5])  # the lead moves on any gap / on a tested one
def test_the_shortcut_learns_what_the_round_trip_learns(
    trace: list[TraceRequest], capacity: int, switch_z: float
) -> None:
    shortcut = _Counting(half_life_ratio=0.5, switch_z=switch_z)
    round_trip = _RoundTrip(half_life_ratio=0.5, switch_z=switch_z)
    assert _replay(trace, capacity, shortcut) == _replay(trace, capacity, round_trip)
    assert shortcut.granted > 0  # the shortcut was taken
    assert shortcut.charges() == round_trip.charges() and shortcut.leader == round_trip.leader
    assert shortcut.metadata() == round_trip.metadata()
    assert shortcut.evict(len(shortcut)) == round_trip.evict(len(round_trip))


def test_metadata_stays_within_its_stated_fractions_of_the_pool_on_a_replay() -> None:
    policy = AutoPolicy(duel_ratio=0.5, sketch_ratio=4.0)
    trace = documents_with_hot_prefixes(400, seed=5, num_hot_prefixes=8, hot_prefix_blocks=12)
    _replay(trace, 150, policy)
    meta = policy.metadata()
    pool = meta["pool"]
    assert 150 < pool <= 150 + 120 + 1  # the highest block ID seen + 1: capacity + a request
    assert 0 < meta["duels"] <= 0.5 * pool
    width = 1 << (4 * pool - 1).bit_length()  # the power of two >= 4 x pool
    assert meta["sketch_counters"] == 4 * width <= 32 * pool
    assert meta["stays"] <= pool
