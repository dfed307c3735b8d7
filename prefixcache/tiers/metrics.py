"""Per-tier metrics: host tier, copies, remote tier and per-label cache numbers, for Prometheus.

The device pool's metrics are :mod:`prefixcache.wire.metrics`'s (export
``tiered.allocator`` with its :class:`~prefixcache.wire.metrics.PrometheusExporter`);
this module adds what the tiers above it count, under the same conventions:
the ``prefixcache_`` prefix, the unit last in every name, counters ending in
``_total``, no precomputed rates. A dashboard's hit ratio per tenant is
``sum by (label) (rate(prefixcache_request_hit_tokens_total[5m])) /
sum by (label) (rate(prefixcache_request_queried_tokens_total[5m]))``, and
``tier`` splits the hits into device, host and remote.

=============================  =======  =======  ==============================================
key                            kind     unit     meaning
=============================  =======  =======  ==============================================
host_total_slots               gauge    slots    host tier capacity
host_used_slots                gauge    slots    host slots holding a block now
host_stored_blocks             counter  blocks   blocks demoted into a host slot
host_evicted_blocks            counter  blocks   live host entries dropped for room (to remote)
host_retired_blocks            counter  blocks   host entries of old weight epochs dropped
host_queried_blocks            counter  blocks   hashes a match asked the host tier for
host_hit_blocks                counter  blocks   of those, found and promoted
demoted_blocks                 counter  blocks   device -> host copies queued
promoted_blocks                counter  blocks   host -> device copies queued
weight_epoch                   gauge    epoch    the epoch new requests are admitted in
remote_lookups                 counter  lookups  pipelined round trips to the remote tier
remote_queried_blocks          counter  blocks   hashes asked of the remote tier
remote_hit_blocks              counter  blocks   of those, found (the leading run)
remote_failed_lookups          counter  lookups  round trips that failed or timed out (misses)
remote_submitted_writes        counter  writes   writes queued for the writer thread
remote_dropped_writes          counter  writes   writes refused by the full queue
remote_completed_writes        counter  writes   writes the server acknowledged
remote_failed_writes           counter  writes   writes lost to a server error or timeout
=============================  =======  =======  ==============================================

Remote keys are present only with a remote tier. Per label (tenant or
model) of a :class:`~prefixcache.tiers.requests.RequestCache`: the counters
``request_queried_tokens``, ``request_hit_tokens`` (label ``tier``),
``request_admitted_requests`` and ``request_resumed_requests``.

>>> from prefixcache import KVBlockAllocator
>>> from prefixcache.tiers import HostTier, TieredCache
>>> allocator = KVBlockAllocator(total_count=8, block_size_tokens=4, device="cpu")
>>> values = collect_tiers(TieredCache(allocator, HostTier(16)))
>>> values["host_total_slots"], values["host_used_slots"], "remote_lookups" in values
(16, 0, False)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prefixcache.engine.stats import metric_unit
from prefixcache.tiers.requests import RequestCache
from prefixcache.tiers.tiered import TieredCache

__all__ = ["TIER_COUNTERS", "TierPrometheusExporter", "collect_tiers"]

_HELP = {
    "host_total_slots": "Host tier slots",
    "host_used_slots": "Host tier slots holding a block",
    "host_stored_blocks": "Blocks demoted into the host tier",
    "host_evicted_blocks": "Live host tier entries dropped for room",
    "host_retired_blocks": "Host tier entries of retired weight epochs dropped",
    "host_queried_blocks": "Block hashes a prefix match asked the host tier for",
    "host_hit_blocks": "Block hashes found in the host tier and promoted",
    "demoted_blocks": "Device to host copies queued",
    "promoted_blocks": "Host to device copies queued",
    "weight_epoch": "Weight epoch new requests are admitted in",
    "remote_lookups": "Pipelined lookups sent to the remote tier",
    "remote_queried_blocks": "Block hashes asked of the remote tier",
    "remote_hit_blocks": "Block hashes found on the remote tier",
    "remote_failed_lookups": "Remote lookups that failed or timed out (counted as misses)",
    "remote_submitted_writes": "Writes queued for the remote tier",
    "remote_dropped_writes": "Writes to the remote tier dropped by the full queue",
    "remote_completed_writes": "Writes the remote tier acknowledged",
    "remote_failed_writes": "Writes lost to a remote tier error or timeout",
}

TIER_COUNTERS = frozenset(_HELP) - {"host_total_slots", "host_used_slots", "weight_epoch"}
"""Keys of :func:`collect_tiers` that only grow; the other three are gauges."""

_LABEL_HELP = {
    "request_queried_tokens": "Prompt tokens of admitted requests (resumptions not counted)",
    "request_hit_tokens": "Prompt tokens found cached, by tier",
    "request_admitted_requests": "Requests admitted (resumptions not counted)",
    "request_resumed_requests": "Preempted requests admitted again (counted nowhere else)",
}


unit_of = metric_unit  # the one naming rule (engine/stats.py)


def collect_tiers(tiered: TieredCache) -> dict[str, int]:
    """The tier metrics of ``tiered`` as a flat dict (see the module table).

    Reads counters only: call it from the thread that owns the cache.
    Complexity: O(1).
    """
    stats = tiered.stats()
    host = stats.host
    values = {
        "host_total_slots": host.num_slots,
        "host_used_slots": host.num_used,
        "host_stored_blocks": host.num_stored,
        "host_evicted_blocks": host.num_evicted,
        "host_retired_blocks": host.num_retired,
        "host_queried_blocks": host.num_queried_blocks,
        "host_hit_blocks": host.num_hit_blocks,
        "demoted_blocks": stats.num_demoted_blocks,
        "promoted_blocks": stats.num_promoted_blocks,
        "weight_epoch": stats.weight_epoch,
    }
    if tiered.remote is not None:
        remote = tiered.remote.stats()
        values.update(
            remote_lookups=remote.num_lookups,
            remote_queried_blocks=remote.num_queried_blocks,
            remote_hit_blocks=remote.num_hit_blocks,
            remote_failed_lookups=remote.num_lookup_errors,
            remote_submitted_writes=remote.num_submitted,
            remote_dropped_writes=remote.num_dropped_writes,
            remote_completed_writes=remote.num_written,
            remote_failed_writes=remote.num_write_errors,
        )
    return values


class TierPrometheusExporter:
    """Exposes :func:`collect_tiers` and per-label request counters through ``prometheus_client``.

    Like :class:`~prefixcache.wire.metrics.PrometheusExporter`, scrapes serve
    the values of the last :meth:`update`, which the scheduler thread calls.

    Args:
        tiered: the tiered cache to read.
        requests: its request cache, for the per-label counters (optional).
        registry: a ``prometheus_client.CollectorRegistry`` (default: the global one).
        namespace: metric name prefix.
        labels: constant labels on every sample, e.g. ``{"worker": "0"}``.

    Raises:
        ImportError: ``prometheus_client`` is not installed (the ``metrics`` extra).
    """

    def __init__(
        self,
        tiered: TieredCache,
        requests: RequestCache | None = None,
        *,
        registry: Any = None,
        namespace: str = "prefixcache",
        labels: Mapping[str, str] | None = None,
    ) -> None:
        try:
            import prometheus_client
        except ImportError as exc:
            raise ImportError(
                "TierPrometheusExporter needs prometheus_client: "
                "pip install -e '.[metrics]' in a clone"
            ) from exc
        self.tiered, self.requests = tiered, requests
        self.namespace = namespace
        self.labels = dict(labels or {})
        self.update()
        self.registry = prometheus_client.REGISTRY if registry is None else registry
        self.registry.register(self)

    def update(self) -> None:
        """Read the tiers now; scrapes serve these values until the next call.

        Complexity: O(labels).
        """
        self._values = collect_tiers(self.tiered)
        self._counters = {} if self.requests is None else self.requests.counters()

    def unregister(self) -> None:
        """Remove the exporter from its registry."""
        self.registry.unregister(self)

    def collect(self) -> Iterator[Any]:
        """The metric families of the last update (called by ``prometheus_client``)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        names, constant = list(self.labels), list(self.labels.values())
        for key, value in self._values.items():
            kind = CounterMetricFamily if key in TIER_COUNTERS else GaugeMetricFamily
            family = kind(f"{self.namespace}_{key}", _HELP[key], labels=names, unit=unit_of(key))
            family.add_metric(constant, float(value))
            yield family
        if self.requests is None:
            return
        families = {
            key: CounterMetricFamily(
                f"{self.namespace}_{key}",
                help_text,
                labels=[*names, "label", *(["tier"] if key == "request_hit_tokens" else [])],
                unit=unit_of(key),
            )
            for key, help_text in _LABEL_HELP.items()
        }
        for label, counters in self._counters.items():
            families["request_queried_tokens"].add_metric(
                [*constant, label], counters["num_queried_tokens"]
            )
            for tier in ("device", "host", "remote"):
                families["request_hit_tokens"].add_metric(
                    [*constant, label, tier], counters[f"num_{tier}_hit_tokens"]
                )
            families["request_admitted_requests"].add_metric(
                [*constant, label], counters["num_requests"]
            )
            families["request_resumed_requests"].add_metric(
                [*constant, label], counters["num_resumed_requests"]
            )
        yield from families.values()
