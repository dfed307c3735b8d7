"""``auto`` on replays: ``evicts_first`` books an eviction as the round trip would; bounds hold.

The engine evicts an exposed parent that ``evicts_first`` names without
inserting it; ``auto`` then books that eviction's statistics (new uses,
duel) itself. Replaying a trace with the shortcut and with it refused must
give the same hits, evictions, charges and metadata.
"""

from __future__ import annotations

import pytest
from prefixcache.policies.auto import AutoPolicy

from prefixcache.reference.trace import TraceRequest
from prefixcache.testing.trace_replay import replay_hits_and_evictions
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
    assert replay_hits_and_evictions(
        trace, capacity, eviction_policy=shortcut
    ) == replay_hits_and_evictions(trace, capacity, eviction_policy=round_trip)
    assert shortcut.granted > 0  # the shortcut was taken
    assert shortcut.charges() == round_trip.charges() and shortcut.leader == round_trip.leader
    assert shortcut.metadata() == round_trip.metadata()
    assert shortcut.evict(len(shortcut)) == round_trip.evict(len(round_trip))


def test_metadata_stays_within_its_stated_fractions_of_the_pool_on_a_replay() -> None:
    policy = AutoPolicy(duel_ratio=0.5, sketch_ratio=4.0)
    trace = documents_with_hot_prefixes(400, seed=5, num_hot_prefixes=8, hot_prefix_blocks=12)
    replay_hits_and_evictions(trace, 150, eviction_policy=policy)
    meta = policy.metadata()
    pool = meta["pool"]
    assert 150 < pool <= 150 + 120 + 1  # the highest block ID seen + 1: capacity + a request
    assert 0 < meta["duels"] <= 0.5 * pool
    width = 1 << (4 * pool - 1).bit_length()  # the power of two >= 4 x pool
    assert meta["sketch_counters"] == 4 * width <= 32 * pool
    assert meta["stays"] <= pool
