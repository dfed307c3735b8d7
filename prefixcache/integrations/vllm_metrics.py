"""The vLLM plugin's own Prometheus metrics: what the eviction policy did, with its name.

vLLM's metrics (``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits``,
``vllm:kv_cache_usage_perc``) stay vLLM's and carry no policy. The plugin adds three
families through ``prometheus_client`` (a requirement of vLLM; where it is absent the
plugin exports nothing and raises nothing), labelled as vLLM labels its own (``model_name``:
the served model name; ``engine``: the data-parallel index) plus the policy:

==========================================  =======  ========================================
name                                        kind     meaning
==========================================  =======  ========================================
``prefixcache_vllm_policy_info``            gauge    1 per policy a block pool of this engine
                                                     was built with; labels also ``runs``
                                                     (native queue, inline lru queue,
                                                     Python policy object) and ``version``
``prefixcache_vllm_hit_blocks_total``       counter  prefix hits on *free* cached blocks:
                                                     blocks the policy kept, used again
``prefixcache_vllm_evicted_blocks_total``   counter  cached blocks the policy gave up for
                                                     reuse
==========================================  =======  ========================================

A block hit while another request holds it is no hit of the policy's (it was never free),
so ``hit / (hit + evicted)`` is the share of the free cached blocks leaving the free pool
that were used again rather than evicted: the number the policy is there to raise.
vLLM's token-level hit rate joins the policy by the info gauge:
``rate(vllm:prefix_cache_hits_total[5m]) * on(model_name, engine) group_left(policy)
prefixcache_vllm_policy_info``.

Where they show: block pools live in vLLM's engine-core process, a process of its own
under ``vllm serve``. Its samples reach the API server's ``/metrics`` through
prometheus_client's multiprocess mode: start vLLM with ``PROMETHEUS_MULTIPROC_DIR`` naming
an empty folder (vLLM's ``/metrics`` then reads every process's samples from it). Without
it, an engine built in the serving process (``LLM`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) shows them in the default registry, and a separate
engine core keeps them to itself.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefixcache.engine.version import installed_version

__all__ = [
    "COUNTS",
    "INFO",
    "LABELS",
    "PluginMetrics",
    "PoolCounts",
    "flush_all",
    "labelled",
    "metrics",
    "track",
]

INFO = "prefixcache_vllm_policy_info"
HITS = "prefixcache_vllm_hit_blocks"  # prometheus_client adds _total to counters
EVICTIONS = "prefixcache_vllm_evicted_blocks"
COUNTS = "_prefixcache_counts"
"""The attribute of a tracked queue that holds its :class:`PoolCounts`."""
LABELS = ("model_name", "engine", "policy")
"""Labels of the two counters: vLLM's own two, then the policy."""

_LOG = logging.getLogger(__name__)


class PluginMetrics:
    """The three families in one registry, and the labelled counters of each pool.

    Args:
        registry: a ``prometheus_client.CollectorRegistry`` (default: the global one,
            which vLLM serves, or reads through its multiprocess directory).

    Raises:
        ImportError: prometheus_client is not installed.
        ValueError: ``registry`` already holds a family of these names.
    """

    def __init__(self, registry: Any = None) -> None:
        import prometheus_client as client

        registry = client.REGISTRY if registry is None else registry
        # First in the registry: a read of it (a scrape, get_sample_value) adds the counts
        # waiting in the queues before the counters below are read.
        registry.register(_Flusher())
        self.info = client.Gauge(
            INFO,
            "Eviction policy of prefixcache's vLLM plugin: 1 per policy a block pool got",
            [*LABELS, "runs", "version"],
            registry=registry,
            multiprocess_mode="max",
        )
        self.hits = client.Counter(
            HITS,
            "Prefix hits on free cached blocks: blocks the eviction policy kept, used again",
            LABELS,
            registry=registry,
        )
        self.evictions = client.Counter(
            EVICTIONS,
            "Cached blocks the eviction policy gave up for reuse",
            LABELS,
            registry=registry,
        )

    def track(self, queue: Any, policy: str, runs: str) -> None:
        """Count ``queue``'s hits and evictions under ``policy`` and this engine's labels.

        The counts wait in a :class:`PoolCounts` on the queue (attribute :data:`COUNTS`)."""
        labels = (*_engine_labels, policy)
        self.info.labels(*labels, runs, installed_version()).set(1)
        counts = PoolCounts(self.hits.labels(*labels), self.evictions.labels(*labels), queue)
        setattr(queue, COUNTS, counts)
        _tracked.add(counts)


class _Flusher:
    """A collector that yields nothing: collecting it runs :func:`flush_all`."""

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        flush_all()
        return []


class PoolCounts:
    """A tracked queue's hits and evictions not yet added to its Prometheus counters.

    The Python queues' wrappers add plain ints here on vLLM's hot path (a Prometheus
    ``inc`` takes a lock, and writes a file in multiprocess mode) and :meth:`flush` them
    when ``touch`` or ``cache_full_blocks`` returns. The native queue's counts wait in C
    (``_native.BlockPoolHook`` counts them, ``take_counts()`` hands them over) until
    :func:`flush_all`: on each read of the registry, after each scheduler step, at exit,
    and when the queue is collected.
    """

    __slots__ = ("__weakref__", "_evicted", "_hit", "_take", "evictions", "hits")

    def __init__(self, hit: Any, evicted: Any, queue: Any = None) -> None:
        self.hits = 0
        self.evictions = 0
        self._hit, self._evicted = hit, evicted
        self._take = getattr(queue, "take_counts", None)  # the native queue's C counts

    def flush(self) -> None:
        """Add the waiting counts to the counters. O(1)."""
        if self._take is not None:
            hits, evictions = self._take()
            self.hits += hits
            self.evictions += evictions
        if self.hits:
            self._hit.inc(self.hits)
            self.hits = 0
        if self.evictions:
            self._evicted.inc(self.evictions)
            self.evictions = 0

    def __del__(self) -> None:
        # Collected with its queue (they reference each other): nothing counted is lost.
        # At interpreter shutdown or with a queue half torn down there is nothing to add.
        with contextlib.suppress(Exception):
            self.flush()


_tracked: weakref.WeakSet[PoolCounts] = weakref.WeakSet()


def flush_all() -> None:
    """Add every live queue's waiting counts to its counters. O(pools)."""
    for counts in list(_tracked):
        counts.flush()


atexit.register(flush_all)


_metrics: PluginMetrics | None = None
_failed = False
_engine_labels: tuple[str, str] = ("", "0")


def metrics() -> PluginMetrics | None:
    """The process's plugin metrics, made on first use; None without prometheus_client."""
    global _metrics, _failed
    if _metrics is None and not _failed:
        try:
            _metrics = PluginMetrics()
        except ImportError:
            _failed = True
        except ValueError as exc:  # the names taken in the default registry already
            _failed = True
            _LOG.warning("prefixcache's vLLM plugin exports no metrics: %s", exc)
    return _metrics


def track(queue: Any, policy: str, runs: str) -> None:
    """:meth:`PluginMetrics.track` on the process's metrics, if there are any."""
    exporter = metrics()
    if exporter is not None:
        exporter.track(queue, policy, runs)


@contextmanager
def labelled(vllm_config: Any) -> Iterator[None]:
    """Pools built inside get ``vllm_config``'s ``model_name`` and ``engine`` labels.

    vLLM's scheduler builds its block pools in its constructor; the plugin wraps that
    constructor in this. The values are the ones vLLM's own metrics use: the served
    model name and the data-parallel index (0 without data parallelism).
    """
    global _engine_labels
    saved = _engine_labels
    model = getattr(getattr(vllm_config, "model_config", None), "served_model_name", "")
    parallel = getattr(vllm_config, "parallel_config", None)
    index = getattr(parallel, "data_parallel_index", getattr(parallel, "data_parallel_rank", 0))
    _engine_labels = (str(model or ""), str(index or 0))
    try:
        yield
    finally:
        _engine_labels = saved
