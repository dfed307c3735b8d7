"""Per-tier metrics: the flat dict follows the stats, and Prometheus sees the same numbers."""

from __future__ import annotations

import pytest

from prefixcache.tiers.metrics import TIER_COUNTERS, TierPrometheusExporter, collect_tiers
from prefixcache.tiers.remote import RemoteTier

BLOCK = 4


def prompt(seed: int) -> list[int]:
    return [seed * 1000 + i for i in range(4 * BLOCK)]


def busy_loop(make_loop, dict_client):
    """A loop whose prompts spilled device -> host -> remote, and one promoted back."""
    remote = RemoteTier(dict_client(), namespace="m")
    loop = make_loop(5, 2, remote=remote)
    for seed in range(1, 6):
        loop.admit(seed, prompt(seed), label="tenant-a" if seed % 2 else "tenant-b")
        loop.requests.finish(seed)
    loop.copy()
    remote.flush()
    loop.admit("again", prompt(1), label="tenant-a")  # from the remote tier
    loop.requests.preempt("again")
    loop.admit("again", None)  # a resumption: counted apart
    loop.requests.begin_weight_epoch("v2")
    return loop, remote


def test_the_flat_dict_follows_the_stats(make_loop, dict_client):
    loop, remote = busy_loop(make_loop, dict_client)
    values = collect_tiers(loop.tiered)
    stats, rstats = loop.tiered.stats(), remote.stats()
    assert values["host_total_slots"] == 2 and values["host_used_slots"] == stats.host.num_used
    assert values["host_stored_blocks"] == stats.host.num_stored > 0
    assert values["host_evicted_blocks"] == stats.host.num_evicted > 0
    assert values["demoted_blocks"] == stats.num_demoted_blocks > 0
    assert values["promoted_blocks"] == stats.num_promoted_blocks > 0
    assert values["weight_epoch"] == 1
    assert values["remote_hit_blocks"] == rstats.num_hit_blocks > 0
    assert values["remote_completed_writes"] == rstats.num_written > 0
    assert values["remote_dropped_writes"] == values["remote_failed_lookups"] == 0
    assert set(values) - {"host_total_slots", "host_used_slots", "weight_epoch"} == set(
        TIER_COUNTERS
    )
    remote.close()


def test_prometheus_sees_the_tiers_and_the_labels(make_loop, dict_client):
    prometheus = pytest.importorskip("prometheus_client")
    loop, remote = busy_loop(make_loop, dict_client)
    registry = prometheus.CollectorRegistry()
    exporter = TierPrometheusExporter(
        loop.tiered, loop.requests, registry=registry, labels={"worker": "0"}
    )

    def sample(name, **labels):
        return registry.get_sample_value(name, {"worker": "0", **labels})

    values = collect_tiers(loop.tiered)
    assert sample("prefixcache_host_hit_blocks_total") == values["host_hit_blocks"]
    assert sample("prefixcache_host_used_slots") == values["host_used_slots"]
    assert sample("prefixcache_weight_epoch") == 1
    assert sample("prefixcache_remote_hit_blocks_total") == values["remote_hit_blocks"]
    counters = loop.requests.counters()
    for label, c in counters.items():
        assert (
            sample("prefixcache_request_queried_tokens_total", label=label)
            == (c["num_queried_tokens"])
        )
        assert (
            sample("prefixcache_request_admitted_requests_total", label=label)
            == (c["num_requests"])
        )
        for tier in ("device", "host", "remote"):
            assert (
                sample("prefixcache_request_hit_tokens_total", label=label, tier=tier)
                == (c[f"num_{tier}_hit_tokens"])
            )
    remote_hits = sample("prefixcache_request_hit_tokens_total", label="tenant-a", tier="remote")
    assert remote_hits == 2 * BLOCK  # two host slots to load into; the resumption adds nothing
    assert sample("prefixcache_request_resumed_requests_total", label="tenant-a") == 1

    loop.requests.finish("again")
    loop.admit("later", prompt(9))  # new numbers appear only after update()
    before = sample("prefixcache_request_admitted_requests_total", label="default")
    exporter.update()
    assert before is None
    assert sample("prefixcache_request_admitted_requests_total", label="default") == 1
    text = prometheus.generate_latest(registry).decode()
    assert "# TYPE prefixcache_host_hit_blocks_total counter" in text
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics

    text = openmetrics(registry).decode()
    assert "# UNIT prefixcache_host_used_slots slots" in text
    assert "# UNIT prefixcache_request_hit_tokens tokens" in text
    exporter.unregister()
    assert registry.get_sample_value("prefixcache_weight_epoch", {"worker": "0"}) is None
    remote.close()
