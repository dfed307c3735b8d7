"""Routers: which worker serves a request.

A deployment runs N engine instances and a router picks one for every
request. Three routers (:data:`ROUTERS`):

- ``round_robin``: worker ``i mod N`` for the i-th request;
- ``least_loaded``: the worker with the fewest unfinished requests, then the
  fewest active blocks;
- ``prefix_aware``: the cost model of NVIDIA Dynamo's KV router,
  ``overlap_weight * blocks to prefill + active blocks``, where the blocks to
  prefill are the prompt's blocks minus the longest prefix the worker holds.

The prefix-aware router learns what each worker holds only from the KV
cache events the workers' allocators record, through an
:class:`~prefixcache.cluster.prefix_index.OverlapIndex`.

>>> router = make_router("least_loaded")
>>> router.choose(RouteQuery("r1", (), 2), [WorkerLoad(3, 10), WorkerLoad(1, 40)])
1
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from prefixcache.cluster.prefix_index import OverlapIndex, PrefixIndex
from prefixcache.engine.events import KVCacheEvent
from prefixcache.errors import ConfigError

__all__ = [
    "ROUTERS",
    "LeastLoadedRouter",
    "PrefixAwareRouter",
    "RoundRobinRouter",
    "RouteQuery",
    "Router",
    "WorkerLoad",
    "make_router",
]

ROUTERS = ("round_robin", "least_loaded", "prefix_aware")
"""Names :func:`make_router` understands."""


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """A request as a router sees it.

    Attributes:
        request_id: the request's name.
        block_hashes: chained hashes of the prompt blocks a prefix hit could
            serve (full blocks, the last prompt token excluded).
        num_prompt_blocks: blocks the prompt occupies.
    """

    request_id: int | str
    block_hashes: tuple[int, ...]
    num_prompt_blocks: int


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load when a request is routed.

    Attributes:
        num_requests: requests routed to it and not finished.
        num_active_blocks: blocks held by its running requests.
    """

    num_requests: int
    num_active_blocks: int


class Router(Protocol):
    """Picks a worker for each request; may learn from the workers' KV cache events."""

    name: str

    def choose(self, query: RouteQuery, loads: Sequence[WorkerLoad]) -> int:
        """Index of the worker that serves ``query``."""
        ...

    def observe(self, worker: int, events: Sequence[KVCacheEvent]) -> None:
        """Events worker ``worker`` recorded since the last call, oldest first."""
        ...


class RoundRobinRouter:
    """Worker ``i mod N`` for the i-th request: even counts, blind to prefixes."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, query: RouteQuery, loads: Sequence[WorkerLoad]) -> int:
        """Complexity: O(1)."""
        worker = self._next % len(loads)
        self._next += 1
        return worker

    def observe(self, worker: int, events: Sequence[KVCacheEvent]) -> None:
        """Ignored. Complexity: O(1)."""


class LeastLoadedRouter:
    """The worker with the fewest unfinished requests, then fewest active blocks."""

    name = "least_loaded"

    def choose(self, query: RouteQuery, loads: Sequence[WorkerLoad]) -> int:
        """Complexity: O(workers)."""
        return min(
            range(len(loads)),
            key=lambda w: (loads[w].num_requests, loads[w].num_active_blocks, w),
        )

    def observe(self, worker: int, events: Sequence[KVCacheEvent]) -> None:
        """Ignored. Complexity: O(1)."""


class PrefixAwareRouter:
    """Dynamo's KV-router cost: ``overlap_weight * blocks to prefill + active blocks``.

    The lowest cost wins; ties go to fewer unfinished requests, then the
    lower index. ``overlap_weight`` trades cache reuse (high) against load
    balance (low); 1.0 is Dynamo's default.

    Args:
        index: where overlaps come from (default: a fresh :class:`PrefixIndex`).
        overlap_weight: weight of the blocks a worker would have to prefill (>= 0).

    Raises:
        ConfigError: a negative ``overlap_weight``.
    """

    name = "prefix_aware"

    def __init__(self, index: OverlapIndex | None = None, overlap_weight: float = 1.0) -> None:
        if not overlap_weight >= 0:
            raise ConfigError(f"overlap_weight must be >= 0, got {overlap_weight!r}")
        self.index: OverlapIndex = PrefixIndex() if index is None else index
        self.overlap_weight = overlap_weight

    def choose(self, query: RouteQuery, loads: Sequence[WorkerLoad]) -> int:
        """Complexity: O(workers + overlap), one index query."""
        overlaps = self.index.overlaps(query.block_hashes, len(loads))

        def cost(worker: int) -> tuple[float, int, int]:
            prefill = query.num_prompt_blocks - overlaps[worker]
            load = loads[worker]
            return (
                self.overlap_weight * prefill + load.num_active_blocks,
                load.num_requests,
                worker,
            )

        return min(range(len(loads)), key=cost)

    def observe(self, worker: int, events: Sequence[KVCacheEvent]) -> None:
        """Forward events to the index. Complexity: that of the index."""
        self.index.apply(worker, events)


def make_router(name: str, *, index: OverlapIndex | None = None) -> Router:
    """A fresh router by name (:data:`ROUTERS`); ``index`` feeds ``prefix_aware``.

    Raises:
        ConfigError: an unknown name.
    """
    if name == "round_robin":
        return RoundRobinRouter()
    if name == "least_loaded":
        return LeastLoadedRouter()
    if name == "prefix_aware":
        return PrefixAwareRouter(index)
    raise ConfigError(f"unknown router {name!r}; valid: {', '.join(ROUTERS)}")
