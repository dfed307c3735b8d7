"""Issue 15, items 4 and 8: plain values, and metrics that follow Prometheus's conventions.

The exposition is read back with ``prometheus_client``'s own parsers (the
classic text format and OpenMetrics, which carries units), so a name, type,
help or unit that a scraper would see wrongly fails here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable

import numpy as np
import pytest

from prefixcache import KVBlockAllocator
from prefixcache.wire.metrics import COUNTERS, PrometheusExporter, collect

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.openmetrics.exposition import (  # noqa: E402
    generate_latest as openmetrics_latest,
)
from prometheus_client.openmetrics.parser import (  # noqa: E402
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text  # noqa: E402


class FakePublisher:
    num_published_events, num_dropped_events = 7, 2
    num_published_batches, num_dropped_batches, num_replay_requests = 3, 1, 4


@pytest.fixture
def make(make: Callable[..., KVBlockAllocator]) -> Callable[..., KVBlockAllocator]:
    return functools.partial(make, engine="python")


@pytest.fixture
def busy(make: Callable[..., KVBlockAllocator]) -> KVBlockAllocator:
    """Blocks in every state, hits, one eviction, events; numpy scalars as arguments."""
    allocator = make(kv_events_capacity=50, paused_count=2)  # 15 usable blocks of 4 tokens
    cached = allocator.allocate_memory_blocks(np.int64(13))
    allocator.register_kv_block_hashes(cached, np.arange(100, 113, dtype=np.int64))
    allocator.release_memory_blocks(cached.numpy())
    allocator.match_prefix([np.int64(100), 101, 999], num_tokens=np.int32(14))  # 2 of 3 blocks
    active = allocator.allocate_memory_blocks(np.uint8(3))  # 2 free + 1 evicted
    allocator.pause(active[:1])
    allocator.advance_clock(np.int16(2))
    allocator.evict_cached_blocks(np.int64(1))
    return allocator


def test_stats_getters_and_metrics_are_plain_python_values(busy: KVBlockAllocator) -> None:
    stats = busy.stats()
    for name, value in stats.as_dict().items():
        assert type(value) is int, (name, type(value))
    assert stats.as_dict() == dataclasses.asdict(stats)
    json.dumps(stats.as_dict())
    for getter in (
        busy.get_total_used,
        busy.get_active_used,
        busy.get_paused_used,
        busy.get_active_avail,
        busy.get_paused_avail,
        busy.get_evictable_block_count,
    ):
        assert type(getter()) is int, getter.__name__
    assert type(busy.clock) is int
    assert type(busy.advance_clock(np.int64(1))) is int
    assert type(busy.evict_cached_blocks(np.int64(1))) is int
    values = collect(busy, FakePublisher())  # type: ignore[arg-type]
    for key, value in values.items():
        assert type(value) in (int, float, str), (key, type(value))
    json.dumps(values)


def test_hit_counters_count_tokens_as_vllm_does(make: Callable[..., KVBlockAllocator]) -> None:
    allocator = make()
    ids = allocator.allocate_memory_blocks(2)
    allocator.register_kv_block_hashes(ids, [11, 12])
    allocator.match_prefix([11, 12, 13], num_tokens=14)  # 3 full blocks of 4, 2 tokens left over
    allocator.match_prefix([11])  # without num_tokens: the full blocks' tokens
    stats = allocator.stats()
    assert (stats.num_queried_tokens, stats.num_hit_tokens) == (14 + 4, 8 + 4)
    assert (stats.num_queried_blocks, stats.num_hit_blocks) == (4, 3)
    values = collect(allocator)
    assert (values["prefix_queried_tokens"], values["prefix_hit_tokens"]) == (18, 12)
    with pytest.raises(ValueError, match="num_tokens"):
        allocator.match_prefix([11, 12], num_tokens=7)  # fewer than 2 full blocks
    allocator.reset()
    assert allocator.stats().num_queried_tokens == 0


def test_kv_cache_usage_ratio_is_held_blocks_over_usable(busy: KVBlockAllocator) -> None:
    values = collect(busy)
    held = values["blocks_active"] + values["blocks_paused"]  # type: ignore[operator]
    assert values["kv_cache_usage_ratio"] == pytest.approx(held / values["usable_blocks"])
    assert 0.0 <= values["kv_cache_usage_ratio"] <= 1.0  # type: ignore[operator]


def test_exposition_follows_prometheus_conventions(busy: KVBlockAllocator) -> None:
    registry = prometheus_client.CollectorRegistry()
    PrometheusExporter(busy, FakePublisher(), registry=registry, labels={"worker": "w0"})  # type: ignore[arg-type]
    families = {f.name: f for f in parse_text(prometheus_client.generate_latest(registry).decode())}
    open_families = {f.name: f for f in parse_openmetrics(openmetrics_latest(registry).decode())}
    assert families.keys() == open_families.keys()
    for name, family in families.items():
        assert name.startswith("prefixcache_"), name
        assert family.documentation and family.documentation != name, name
        unit = open_families[name].unit
        assert unit and name.endswith(f"_{unit}"), (name, unit)
        assert not name.endswith(("_rate", "_perc", "_percent")), name
        if family.type == "counter":
            assert all(sample.name == f"{name}_total" for sample in family.samples), name
        else:
            assert family.type == "gauge", name
            assert not any(sample.name.endswith("_total") for sample in family.samples), name
    event_families = [name for name in families if "event" in name or "batch" in name]
    assert event_families and all(n.startswith("prefixcache_kv_") for n in event_families)
    assert {f"prefixcache_{key}" for key in COUNTERS} <= {
        name for name, f in families.items() if f.type == "counter"
    }
    for name in (
        "prefixcache_prefix_queried_tokens",
        "prefixcache_prefix_hit_tokens",
        "prefixcache_kv_cache_usage_ratio",
        "prefixcache_kv_publish_dropped_batches",
    ):
        assert name in families, name
    hit = families["prefixcache_prefix_hit_tokens"].samples[0]
    assert hit.labels == {"worker": "w0"} and hit.value == 8
    evicted = families["prefixcache_evicted_blocks"].samples[0]
    assert evicted.labels == {"worker": "w0", "policy": "lru"}
