"""AllocatorStats: a frozen snapshot of the allocator's counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class AllocatorStats:
    """Counts per block state now, and events since construction or reset.

    ``num_free + num_active + num_paused + num_cached == num_usable`` always.
    Hit counts are in blocks: ``num_hit_blocks / num_queried_blocks`` is the
    block hit rate of :meth:`KVBlockAllocator.match_prefix` queries. The
    token counts are vLLM's ``prefix_cache_queries``/``prefix_cache_hits``:
    ``num_queried_tokens`` counts every prompt token of the queries (the
    partial last block included, when the caller passes ``num_tokens``),
    ``num_hit_tokens`` the tokens of the blocks found cached. A lookup of a request
    that comes back after preemption (``match_prefix(..., resumed=True)``) finds its own
    blocks: it counts apart, in ``num_preempted_queried_tokens`` /
    ``num_preempted_hit_tokens`` (vLLM's ``preempted_queries``/``preempted_hits``).
    ``num_evicted_blocks`` counts cached blocks freed for room (or by an
    explicit evict call); ``num_dropped_blocks`` counts hashed blocks freed
    at their last release because the policy retains nothing (ref-zero).
    ``num_rejected_hits`` counts matches cut short because a block's hash
    matched but its verification fingerprint did not (a hash collision).
    ``num_dropped_events`` counts KV cache events lost to a full event queue:
    a consumer that sees it grow should resynchronise from ``snapshot()``.
    ``largest_free_run`` is the longest run of consecutive free IDs, and
    :attr:`fragmentation` the share of free blocks outside it (DESIGN.md,
    "Defragmentation").

    Every field is a plain Python ``int`` (never a numpy integer), so
    ``json.dumps(stats.as_dict())`` works.
    """

    total_count: int
    num_usable: int
    num_free: int
    num_active: int
    num_paused: int
    num_cached: int
    num_registered: int
    num_allocated_blocks: int
    num_released_references: int
    num_queried_blocks: int
    num_hit_blocks: int
    num_evicted_blocks: int
    num_dropped_blocks: int
    num_rejected_hits: int
    num_dropped_events: int
    clock: int
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    largest_free_run: int = 0
    num_preempted_queried_tokens: int = 0
    num_preempted_hit_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        """Every field by name, for logs and JSON. Complexity: O(fields)."""
        return asdict(self)

    @property
    def fragmentation(self) -> float:
        """Share of free blocks outside the largest free run: 0.0 packed, near 1.0 scattered.

        0.0 when nothing is free. A request of ``n`` blocks gets contiguous
        IDs under ``free_list="lowest"`` whenever ``n <= largest_free_run``
        and the run is the lowest free one.
        """
        if not self.num_free:
            return 0.0
        return (self.num_free - self.largest_free_run) / self.num_free

    @property
    def hit_rate(self) -> float:
        """Matched blocks over queried blocks (0.0 before any query)."""
        return self.num_hit_blocks / self.num_queried_blocks if self.num_queried_blocks else 0.0


def metric_unit(key: str) -> str:
    """The unit of an exported metric key: its last word (``prefix_hit_tokens`` -> ``tokens``).

    The naming rule every exporter follows (``prefixcache.wire.metrics``,
    ``prefixcache.tiers.metrics``): the unit last in every name, declared as the
    Prometheus family's unit. Complexity: O(len(key)).
    """
    return key.rsplit("_", 1)[-1]
