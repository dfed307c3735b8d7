"""prefixcache.wire.metrics: the plain dict and the Prometheus exporter.

Moved from tests/test_metrics.py with the metric names of issue 15, item 8.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from prefixcache import KVBlockAllocator
from prefixcache.wire.metrics import COUNTERS, PrometheusExporter, collect


@pytest.fixture
def busy(make: Callable[..., KVBlockAllocator]) -> KVBlockAllocator:
    """Blocks in every state, hits, misses and one eviction (15 usable blocks of 4 tokens)."""
    allocator = make(kv_events_capacity=3, paused_count=2)
    cached = allocator.allocate_memory_blocks(13)
    allocator.register_kv_block_hashes(cached, list(range(100, 113)))
    allocator.release_memory_blocks(cached)
    allocator.match_prefix([100, 101, 999])  # 2 of 3 blocks hit
    active = allocator.allocate_memory_blocks(3)  # 2 free + 1 evicted
    allocator.pause(active[:1])
    return allocator


def test_collect_counts_states_hits_and_evictions(busy: KVBlockAllocator) -> None:
    values = collect(busy)
    states = [values[f"blocks_{s}"] for s in ("free", "active", "paused", "cached")]
    assert states == [0, 2, 1, 12]
    assert sum(states) == values["usable_blocks"] == 15
    assert (values["prefix_hit_blocks"], values["prefix_queried_blocks"]) == (2, 3)
    assert (values["prefix_hit_tokens"], values["prefix_queried_tokens"]) == (8, 12)
    assert "prefix_hit_rate" not in values  # a ratio is computed from the counters
    assert values["evicted_blocks"] == 1
    assert values["eviction_policy"] == "lru"
    # 13 hashes stored in one event, one removal: 2 recorded, none dropped yet.
    assert (values["kv_recorded_events"], values["kv_queue_dropped_events"]) == (2, 0)
    assert "kv_published_events" not in values


def test_collect_sees_event_queue_drops(busy: KVBlockAllocator) -> None:
    for _ in range(2):  # two more removals: 4 events into a queue of 3
        busy.evict_cached_blocks(1)
    values = collect(busy)
    assert values["kv_queue_dropped_events"] == 1
    assert values["kv_queued_events"] == 3


def test_collect_without_events_has_no_event_keys(allocator: KVBlockAllocator) -> None:
    assert not any(key.endswith(("_events", "_batches", "_requests")) for key in collect(allocator))


def test_prometheus_exporter_serves_last_update(busy: KVBlockAllocator) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    exporter = PrometheusExporter(busy, registry=registry, labels={"worker": "w0"})

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"worker": "w0", **labels})

    assert sample("prefixcache_blocks", state="cached") == 12
    assert sample("prefixcache_evicted_blocks_total", policy="lru") == 1
    assert sample("prefixcache_prefix_hit_tokens_total") == 8
    assert sample("prefixcache_prefix_hit_blocks_total") == 2
    busy.evict_cached_blocks(2)
    assert sample("prefixcache_evicted_blocks_total", policy="lru") == 1  # not updated yet
    exporter.update()
    assert sample("prefixcache_evicted_blocks_total", policy="lru") == 3
    text = prometheus_client.generate_latest(registry).decode()
    assert "# TYPE prefixcache_prefix_queried_blocks_total counter" in text
    assert "# TYPE prefixcache_usable_blocks gauge" in text
    exporter.unregister()
    assert (
        registry.get_sample_value("prefixcache_blocks", {"worker": "w0", "state": "free"}) is None
    )


def test_counter_keys_are_collected_keys(busy: KVBlockAllocator) -> None:
    class FakePublisher:
        num_published_events = num_dropped_events = 0
        num_published_batches = num_dropped_batches = num_replay_requests = 0

    keys = set(collect(busy, FakePublisher()))  # type: ignore[arg-type]
    assert keys >= COUNTERS


def test_a_resumed_request_counts_in_the_preempted_counters_only(busy: KVBlockAllocator) -> None:
    before = collect(busy)
    busy.match_prefix([100, 101, 102], resumed=True)  # its own blocks: no cache hit
    values = collect(busy)
    assert (values["prefix_hit_tokens"], values["prefix_queried_tokens"]) == (8, 12)
    assert (before["prefix_preempted_queried_tokens"], before["prefix_preempted_hit_tokens"]) == (
        0,
        0,
    )
    assert (values["prefix_preempted_queried_tokens"], values["prefix_preempted_hit_tokens"]) == (
        12,
        12,
    )
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    PrometheusExporter(busy, registry=registry)
    assert registry.get_sample_value("prefixcache_prefix_preempted_hit_tokens_total") == 12
    assert registry.get_sample_value("prefixcache_prefix_hit_tokens_total") == 8
