"""Counters and gauges a serving stack scrapes: block states, prefix hits, evictions, events.

:func:`collect` reads one allocator (and optionally its event publisher) into
a flat ``dict`` for anyone: logs, JSON endpoints, tests. :class:`PrometheusExporter`
exposes the same values through ``prometheus_client`` (the ``metrics``
extra), named ``prefixcache_*`` as in this table:

=================================  =======  ==============================================
key                                kind     meaning
=================================  =======  ==============================================
blocks_{free,active,paused,cached} gauge    blocks per state (they sum to blocks_usable)
blocks_usable                      gauge    blocks the pool hands out (the dummy excluded)
hashes_registered                  gauge    hashes resident now
prefix_queried_blocks              counter  full blocks looked up by ``match_prefix``
prefix_hit_blocks                  counter  of those, blocks found cached
prefix_queried_tokens              counter  ``prefix_queried_blocks * block_size``
prefix_hit_tokens                  counter  ``prefix_hit_blocks * block_size``
prefix_hit_rate                    gauge    hit blocks / queried blocks (0.0 before a query)
evicted_blocks                     counter  cached blocks freed for room, label ``policy``
dropped_blocks                     counter  hashed blocks freed at release (ref-zero policy)
rejected_hits                      counter  matches cut by a fingerprint mismatch
kv_events_recorded                 counter  events the allocator recorded
kv_events_queue_dropped            counter  events lost to the allocator's full queue
kv_events_queued                   gauge    events waiting for ``take_events``
kv_events_published                counter  events the publisher sent
kv_events_publish_dropped          counter  events the PUB socket refused
kv_event_batches_published         counter  batches the publisher sent
kv_event_replay_requests           counter  replay requests answered
=================================  =======  ==============================================

The hit rate's denominator is explicit: full prompt blocks asked for in
``match_prefix`` calls, not prompt tokens (a trailing partial block is never
looked up). Counters restart when the allocator is ``reset()``; Prometheus
treats that as a counter reset. Event keys are present only when the
allocator records events, publisher keys only when a publisher is given.

>>> from prefixcache import KVBlockAllocator
>>> allocator = KVBlockAllocator(total_count=8, block_size_tokens=4, device="cpu")
>>> ids = allocator.allocate_memory_blocks(2)
>>> _ = allocator.register_kv_block_hashes(ids, [11, 12])
>>> _ = allocator.match_prefix([11, 99])
>>> values = collect(allocator)
>>> values["blocks_active"], values["prefix_hit_tokens"], values["prefix_queried_tokens"]
(2, 4, 8)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixcache.engine.allocator import KVBlockAllocator
    from prefixcache.wire.publisher import ZmqEventPublisher

__all__ = ["COUNTERS", "PrometheusExporter", "collect"]

MetricValue = int | float | str

COUNTERS = frozenset(
    {
        "prefix_queried_blocks",
        "prefix_hit_blocks",
        "prefix_queried_tokens",
        "prefix_hit_tokens",
        "evicted_blocks",
        "dropped_blocks",
        "rejected_hits",
        "kv_events_recorded",
        "kv_events_queue_dropped",
        "kv_events_published",
        "kv_events_publish_dropped",
        "kv_event_batches_published",
        "kv_event_replay_requests",
    }
)
"""Keys of :func:`collect` that only grow (between resets); the other numbers are gauges."""

_HELP = {
    "blocks_free": "Blocks on the free stack",
    "blocks_active": "Blocks held by running requests",
    "blocks_paused": "Blocks held only by paused requests",
    "blocks_cached": "Unreferenced blocks kept for prefix reuse (evictable)",
    "blocks_usable": "Blocks the pool hands out (dummy excluded)",
    "hashes_registered": "Block hashes resident now",
    "prefix_queried_blocks": "Full prompt blocks looked up by match_prefix",
    "prefix_hit_blocks": "Looked-up blocks found cached",
    "prefix_queried_tokens": "Tokens of looked-up blocks (blocks * block size)",
    "prefix_hit_tokens": "Tokens of blocks found cached (blocks * block size)",
    "prefix_hit_rate": "Hit blocks / queried blocks",
    "evicted_blocks": "Cached blocks evicted for room",
    "dropped_blocks": "Hashed blocks freed at release because the policy keeps nothing",
    "rejected_hits": "Prefix matches cut short by a fingerprint mismatch",
    "kv_events_recorded": "KV cache events the allocator recorded",
    "kv_events_queue_dropped": "KV cache events lost to the allocator's full queue",
    "kv_events_queued": "KV cache events waiting to be drained",
    "kv_events_published": "KV cache events sent by the publisher",
    "kv_events_publish_dropped": "KV cache events the publisher's socket refused",
    "kv_event_batches_published": "KV event batches sent by the publisher",
    "kv_event_replay_requests": "Replay requests the publisher answered",
}


def _policy_name(allocator: KVBlockAllocator) -> str:
    spec = allocator.config.eviction_policy
    if isinstance(spec, str):
        return spec
    if isinstance(spec, Mapping) and isinstance(spec.get("name"), str):
        return str(spec["name"])
    return type(allocator.policy).__name__


def collect(
    allocator: KVBlockAllocator, publisher: ZmqEventPublisher | None = None
) -> dict[str, MetricValue]:
    """Every metric of ``allocator`` (and ``publisher``) as a flat dict (see the module table).

    Also holds ``eviction_policy`` (the policy's name, a label) and ``block_size``.
    Reads counters only: call it from the thread that owns the allocator.

    Complexity: O(1).
    """
    stats = allocator.stats()
    size = allocator.block_size_tokens
    values: dict[str, MetricValue] = {
        "eviction_policy": _policy_name(allocator),
        "block_size": size,
        "blocks_free": stats.num_free,
        "blocks_active": stats.num_active,
        "blocks_paused": stats.num_paused,
        "blocks_cached": stats.num_cached,
        "blocks_usable": stats.num_usable,
        "hashes_registered": stats.num_registered,
        "prefix_queried_blocks": stats.num_queried_blocks,
        "prefix_hit_blocks": stats.num_hit_blocks,
        "prefix_queried_tokens": stats.num_queried_blocks * size,
        "prefix_hit_tokens": stats.num_hit_blocks * size,
        "prefix_hit_rate": stats.hit_rate,
        "evicted_blocks": stats.num_evicted_blocks,
        "dropped_blocks": stats.num_dropped_blocks,
        "rejected_hits": stats.num_rejected_hits,
    }
    log = allocator.events
    if log is not None:
        values["kv_events_recorded"] = log.num_recorded
        values["kv_events_queue_dropped"] = log.num_dropped
        values["kv_events_queued"] = len(log)
    if publisher is not None:
        values["kv_events_published"] = publisher.num_published_events
        values["kv_events_publish_dropped"] = publisher.num_dropped_events
        values["kv_event_batches_published"] = publisher.num_published_batches
        values["kv_event_replay_requests"] = publisher.num_replay_requests
    return values


class PrometheusExporter:
    """Exposes :func:`collect`'s values to Prometheus through ``prometheus_client``.

    The allocator is not thread-safe, and a scrape runs on the HTTP server's
    thread; so the exporter serves the values of the last :meth:`update`,
    which the thread owning the allocator calls when it likes (after a
    scheduler step). Block states are one gauge family with a ``state``
    label; evictions carry a ``policy`` label; ``labels`` (e.g. a worker name)
    go on every sample.

    Args:
        allocator: the allocator to read.
        publisher: its event publisher, if any.
        registry: a ``prometheus_client.CollectorRegistry`` (default: the
            global ``REGISTRY``).
        namespace: metric name prefix.
        labels: constant labels, e.g. ``{"worker": "0"}``.

    Raises:
        ImportError: ``prometheus_client`` is not installed (install the
            ``metrics`` extra).
    """

    def __init__(
        self,
        allocator: KVBlockAllocator,
        publisher: ZmqEventPublisher | None = None,
        *,
        registry: Any = None,
        namespace: str = "prefixcache",
        labels: Mapping[str, str] | None = None,
    ) -> None:
        try:
            import prometheus_client
        except ImportError as exc:
            raise ImportError(
                "PrometheusExporter needs prometheus_client: pip install 'prefixcache[metrics]'"
            ) from exc
        self._client = prometheus_client
        self.allocator = allocator
        self.publisher = publisher
        self.namespace = namespace
        self.labels = dict(labels or {})
        self._values = collect(allocator, publisher)
        self.registry = prometheus_client.REGISTRY if registry is None else registry
        self.registry.register(self)

    def update(self) -> None:
        """Read the allocator now; scrapes serve these values until the next call.

        Complexity: O(1).
        """
        self._values = collect(self.allocator, self.publisher)

    def unregister(self) -> None:
        """Remove the exporter from its registry."""
        self.registry.unregister(self)

    def start_http_server(self, port: int, addr: str = "127.0.0.1") -> None:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread (loopback by default)."""
        self._client.start_http_server(port, addr=addr, registry=self.registry)

    def collect(self) -> Iterator[Any]:
        """The metric families of the last update (called by ``prometheus_client``)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        values = self._values
        names, label_values = list(self.labels), list(self.labels.values())
        states = GaugeMetricFamily(
            f"{self.namespace}_blocks", "Blocks per state", labels=[*names, "state"]
        )
        for state in ("free", "active", "paused", "cached"):
            states.add_metric([*label_values, state], float(values[f"blocks_{state}"]))
        yield states
        for key, value in values.items():
            if isinstance(value, str) or (key.startswith("blocks_") and key != "blocks_usable"):
                continue
            name = f"{self.namespace}_{key}"
            extra: list[str] = ["policy"] if key == "evicted_blocks" else []
            extra_values = [str(values["eviction_policy"])] if extra else []
            family_type = CounterMetricFamily if key in COUNTERS else GaugeMetricFamily
            family = family_type(name, _HELP.get(key, key), labels=[*names, *extra])
            family.add_metric([*label_values, *extra_values], float(value))
            yield family
