"""Counters and gauges a serving stack scrapes: block states, prefix hits, evictions, events.

:func:`collect` reads one allocator (and optionally its event publisher) into
a flat ``dict`` for anyone: logs, JSON endpoints, tests; every value is a
plain ``int``, ``float`` or ``str``. :class:`PrometheusExporter` exposes the
same values through ``prometheus_client`` (the ``metrics`` extra) under
Prometheus's conventions: one prefix (``prefixcache_``), the unit last in
every name and declared as the family's unit, counters ending in
``_total``, help text on every family, and no precomputed rates (a hit ratio
is ``rate(prefixcache_prefix_hit_tokens_total[5m]) /
rate(prefixcache_prefix_queried_tokens_total[5m])``, as for vLLM's
``vllm:prefix_cache_hits`` and ``vllm:prefix_cache_queries``).

=============================  =======  =======  ==============================================
key                            kind     unit     meaning
=============================  =======  =======  ==============================================
blocks_{free,active,paused,    gauge    blocks   blocks per state (one family ``blocks`` with a
cached}                                          ``state`` label; they sum to usable_blocks)
usable_blocks                  gauge    blocks   blocks the pool hands out (the dummy excluded)
registered_hashes              gauge    hashes   hashes resident now
kv_cache_usage_ratio           gauge    ratio    (active + paused) / usable blocks, in [0, 1]:
                                                 vLLM's ``kv_cache_usage_perc`` (cached blocks
                                                 are free to vLLM too)
block_size_tokens              gauge    tokens   tokens per block
prefix_queried_tokens          counter  tokens   prompt tokens of ``match_prefix`` queries, the
                                                 partial last block included when the caller
                                                 passes ``num_tokens`` (vLLM's
                                                 ``prefix_cache_queries``)
prefix_hit_tokens              counter  tokens   tokens of the blocks found cached (vLLM's
                                                 ``prefix_cache_hits``)
prefix_preempted_queried_      counter  tokens   tokens looked up by requests resuming after
tokens                                           preemption (``resumed=True``): counted apart
                                                 from the two above (vLLM's
                                                 ``prefix_cache_queries`` for preempted)
prefix_preempted_hit_tokens    counter  tokens   of those, tokens found cached (their own
                                                 blocks, mostly)
prefix_queried_blocks          counter  blocks   full blocks looked up
prefix_hit_blocks              counter  blocks   of those, blocks found cached
evicted_blocks                 counter  blocks   cached blocks freed for room, label ``policy``
dropped_blocks                 counter  blocks   hashed blocks freed at release (ref-zero)
rejected_hit_blocks            counter  blocks   matches cut by a fingerprint mismatch
kv_recorded_events             counter  events   events the allocator recorded
kv_queue_dropped_events        counter  events   events lost to the allocator's full queue
kv_queued_events               gauge    events   events waiting for ``take_events``
kv_published_events            counter  events   events the publisher sent
kv_publish_dropped_events      counter  events   events in batches the publisher could not send
kv_published_batches           counter  batches  batches the publisher sent
kv_publish_dropped_batches     counter  batches  batches a slow subscriber could not take
                                                 (replayable; see ``ZmqEventPublisher``)
kv_replay_requests             counter  requests replay requests answered
=============================  =======  =======  ==============================================

Counters restart when the allocator is ``reset()``; Prometheus treats that
as a counter reset. Event keys are present only when the allocator records
events, publisher keys only when a publisher is given.

>>> from prefixcache import KVBlockAllocator
>>> allocator = KVBlockAllocator(total_count=8, block_size_tokens=4, device="cpu")
>>> ids = allocator.allocate_memory_blocks(2)
>>> _ = allocator.register_kv_block_hashes(ids, [11, 12])
>>> _ = allocator.match_prefix([11, 99], num_tokens=10)  # 2 full blocks and 2 more tokens
>>> values = collect(allocator)
>>> values["blocks_active"], values["prefix_hit_tokens"], values["prefix_queried_tokens"]
(2, 4, 10)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prefixcache.engine.stats import metric_unit

if TYPE_CHECKING:
    from prefixcache.engine.allocator import KVBlockAllocator
    from prefixcache.wire.publisher import ZmqEventPublisher

__all__ = ["COUNTERS", "PrometheusExporter", "collect"]

MetricValue = int | float | str

COUNTERS = frozenset(
    {
        "prefix_queried_tokens",
        "prefix_hit_tokens",
        "prefix_preempted_queried_tokens",
        "prefix_preempted_hit_tokens",
        "prefix_queried_blocks",
        "prefix_hit_blocks",
        "evicted_blocks",
        "dropped_blocks",
        "rejected_hit_blocks",
        "kv_recorded_events",
        "kv_queue_dropped_events",
        "kv_published_events",
        "kv_publish_dropped_events",
        "kv_published_batches",
        "kv_publish_dropped_batches",
        "kv_replay_requests",
    }
)
"""Keys of :func:`collect` that only grow (between resets); the other numbers are gauges."""

_HELP = {
    "usable_blocks": "Blocks the pool hands out (dummy excluded)",
    "registered_hashes": "Block hashes resident now",
    "kv_cache_usage_ratio": "KV-cache usage: blocks held by requests / usable blocks, in [0, 1]",
    "block_size_tokens": "Tokens per KV-cache block",
    "prefix_queried_tokens": "Prompt tokens looked up by match_prefix, partial last block included",
    "prefix_hit_tokens": "Prompt tokens found in cached blocks",
    "prefix_preempted_queried_tokens": "Prompt tokens looked up by requests resuming after "
    "preemption (not in prefix_queried_tokens)",
    "prefix_preempted_hit_tokens": "Tokens of resuming requests found cached "
    "(not in prefix_hit_tokens)",
    "prefix_queried_blocks": "Full prompt blocks looked up by match_prefix",
    "prefix_hit_blocks": "Looked-up blocks found cached",
    "evicted_blocks": "Cached blocks evicted for room",
    "dropped_blocks": "Hashed blocks freed at release because the policy keeps nothing",
    "rejected_hit_blocks": "Prefix matches cut short by a fingerprint mismatch",
    "kv_recorded_events": "KV cache events the allocator recorded",
    "kv_queue_dropped_events": "KV cache events lost to the allocator's full queue",
    "kv_queued_events": "KV cache events waiting to be drained",
    "kv_published_events": "KV cache events sent by the publisher",
    "kv_publish_dropped_events": "KV cache events in batches the publisher could not send",
    "kv_published_batches": "KV event batches sent by the publisher",
    "kv_publish_dropped_batches": "KV event batches a slow subscriber could not take (replayable)",
    "kv_replay_requests": "Replay requests the publisher answered",
}
"""Help text of every exported family (the block-state family has its own)."""


unit_of = metric_unit  # the one naming rule (engine/stats.py)


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

    Also holds ``eviction_policy`` (the policy's name, a label).
    Reads counters only: call it from the thread that owns the allocator.

    Complexity: O(1).
    """
    stats = allocator.stats()
    held = stats.num_active + stats.num_paused
    values: dict[str, MetricValue] = {
        "eviction_policy": _policy_name(allocator),
        "block_size_tokens": int(allocator.block_size_tokens),
        "blocks_free": stats.num_free,
        "blocks_active": stats.num_active,
        "blocks_paused": stats.num_paused,
        "blocks_cached": stats.num_cached,
        "usable_blocks": stats.num_usable,
        "registered_hashes": stats.num_registered,
        "kv_cache_usage_ratio": held / stats.num_usable,
        "prefix_queried_tokens": stats.num_queried_tokens,
        "prefix_hit_tokens": stats.num_hit_tokens,
        "prefix_preempted_queried_tokens": stats.num_preempted_queried_tokens,
        "prefix_preempted_hit_tokens": stats.num_preempted_hit_tokens,
        "prefix_queried_blocks": stats.num_queried_blocks,
        "prefix_hit_blocks": stats.num_hit_blocks,
        "evicted_blocks": stats.num_evicted_blocks,
        "dropped_blocks": stats.num_dropped_blocks,
        "rejected_hit_blocks": stats.num_rejected_hits,
    }
    log = allocator.events
    if log is not None:
        values["kv_recorded_events"] = int(log.num_recorded)
        values["kv_queue_dropped_events"] = int(log.num_dropped)
        values["kv_queued_events"] = len(log)
    if publisher is not None:
        values["kv_published_events"] = int(publisher.num_published_events)
        values["kv_publish_dropped_events"] = int(publisher.num_dropped_events)
        values["kv_published_batches"] = int(publisher.num_published_batches)
        values["kv_publish_dropped_batches"] = int(publisher.num_dropped_batches)
        values["kv_replay_requests"] = int(publisher.num_replay_requests)
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
                "PrometheusExporter needs prometheus_client: pip install -e '.[metrics]' in a clone"
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
            f"{self.namespace}_blocks",
            "Blocks per state: free, active (running requests), paused, cached (evictable)",
            labels=[*names, "state"],
            unit="blocks",
        )
        for state in ("free", "active", "paused", "cached"):
            states.add_metric([*label_values, state], float(values[f"blocks_{state}"]))
        yield states
        for key, value in values.items():
            if isinstance(value, str) or key.startswith("blocks_"):
                continue
            name = f"{self.namespace}_{key}"
            extra: list[str] = ["policy"] if key == "evicted_blocks" else []
            extra_values = [str(values["eviction_policy"])] if extra else []
            family_type = CounterMetricFamily if key in COUNTERS else GaugeMetricFamily
            family = family_type(name, _HELP[key], labels=[*names, *extra], unit=unit_of(key))
            family.add_metric([*label_values, *extra_values], float(value))
            yield family
