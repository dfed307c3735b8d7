"""Replaying a trace over many workers behind a router: which placement keeps prefixes hot.

:func:`replay_cluster` models a deployment of N workers, each a
:class:`~prefixcache.reference.sim.DynamicBatchingSim` (an allocator plus the reference
dynamic-batching loop) holding ``total_capacity // N`` blocks, so runs with
different N compare at a fixed total memory. All workers step in lockstep,
one loop step per ``step_ms`` of trace time; a request is routed when it
arrives, by one of the routers of :mod:`prefixcache.cluster.routers`.

The router learns what each worker holds only from the KV cache events the
workers' allocators record (drained after every step), as a real router
would.

>>> from prefixcache.reference.trace import TraceRequest
>>> def request(i):  # three prompt families of 8 shared blocks, taken in turn
...     return TraceRequest(i * 100, 9 * 512, 4, (*range(100 * (i % 3), 100 * (i % 3) + 8), i))
>>> trace = [request(i) for i in range(12)]
>>> for name in ("round_robin", "prefix_aware"):
...     result = replay_cluster(trace, num_workers=2, total_capacity=40, router=name)
...     print(name, result.tokens_saved, result.requests_per_worker)
round_robin 3072 (6, 6)
prefix_aware 36864 (8, 4)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

from prefixcache.cluster.routers import RouteQuery, Router, WorkerLoad, make_router
from prefixcache.engine.events import AllBlocksCleared
from prefixcache.engine.validation import require_int
from prefixcache.errors import InvalidArgumentError
from prefixcache.reference.sim import DynamicBatchingSim, SimConfig, SimRequest
from prefixcache.reference.trace import TRACE_BLOCK_SIZE, TraceRequest

__all__ = ["ClusterResult", "replay_cluster"]

_EVENT_QUEUE = 1 << 16  # events a worker may record in one step before drops force a resync


@dataclass(frozen=True)
class ClusterResult:
    """What one cluster replay measured.

    Attributes:
        router: router name.
        num_workers: workers.
        total_capacity: blocks across all workers (each has ``total // N``).
        num_requests: requests replayed.
        num_steps: loop steps until the last request finished.
        prompt_tokens: prompt tokens admitted, all workers (requeues count again).
        tokens_saved: of those, tokens served from a worker's cache.
        requests_per_worker: requests routed to each worker.
        tokens_per_worker: tokens each worker computed (prefill + decode).
        evictions: blocks evicted, all workers.
        preemptions: paused requests released and requeued, all workers.
        seconds: wall time.
    """

    router: str
    num_workers: int
    total_capacity: int
    num_requests: int
    num_steps: int
    prompt_tokens: int
    tokens_saved: int
    requests_per_worker: tuple[int, ...]
    tokens_per_worker: tuple[int, ...]
    evictions: int
    preemptions: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from cache / prompt tokens admitted (0.0 if none)."""
        return self.tokens_saved / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def load_spread(self) -> float:
        """Busiest worker's computed tokens over the mean (1.0 = perfectly even)."""
        total = sum(self.tokens_per_worker)
        return max(self.tokens_per_worker) * self.num_workers / total if total else 1.0


def _sim_config(
    capacity: int,
    policy: str,
    requests: Sequence[TraceRequest],
    *,
    step_token_budget: int,
    max_requests: int,
) -> SimConfig:
    needed = max(
        (-(-(r.input_length + r.output_length) // TRACE_BLOCK_SIZE) for r in requests), default=1
    )
    return SimConfig(
        total_count=capacity + 1,
        block_size=TRACE_BLOCK_SIZE,
        eviction_policy=policy,
        max_blocks_per_request=needed,
        device="cpu",
        step_token_budget=step_token_budget,
        max_requests=max_requests,
    )


def _new_worker(config: SimConfig) -> DynamicBatchingSim:
    return DynamicBatchingSim(dataclasses.replace(config, kv_events_capacity=_EVENT_QUEUE))


def replay_cluster(
    requests: Sequence[TraceRequest],
    num_workers: int,
    total_capacity: int,
    router: str | Router = "prefix_aware",
    *,
    policy: str = "lru",
    step_ms: int = 50,
    step_token_budget: int = 8192,
    max_requests: int = 256,
) -> ClusterResult:
    """Replay ``requests`` over ``num_workers`` simulated engines behind ``router``.

    Each worker is a :class:`~prefixcache.reference.sim.DynamicBatchingSim` with
    ``total_capacity // num_workers`` blocks of ``TRACE_BLOCK_SIZE`` tokens
    and the knobs of :func:`~prefixcache.tools.replay.replay_concurrent`. Requests
    are routed at their arrival step (``timestamp_ms // step_ms``); after
    every step each worker's KV cache events are drained into
    ``router.observe`` (when the allocator's queue overflowed, the router
    gets ``AllBlocksCleared`` and a snapshot instead).

    Args:
        requests: the trace, in arrival order.
        num_workers: workers (>= 1).
        total_capacity: blocks across all workers; each must hold the largest request.
        router: a name from :data:`ROUTERS` or a :class:`Router`.
        policy: eviction policy of every worker.
        step_ms: trace milliseconds per loop step.
        step_token_budget: tokens a worker computes per step.
        max_requests: running plus paused requests per worker.

    Returns:
        A :class:`ClusterResult`.

    Raises:
        InvalidArgumentError: a bad count (ConfigError: unknown router or policy).
        CapacityError: a request does not fit one worker.

    Complexity: O(total tokens / block size + steps * (workers + requests in flight)).
    """
    num_workers = require_int(num_workers, "num_workers", minimum=1)
    total_capacity = require_int(total_capacity, "total_capacity", minimum=1)
    step_ms = require_int(step_ms, "step_ms", minimum=1)
    capacity = total_capacity // num_workers
    if capacity < 1:
        raise InvalidArgumentError(f"{total_capacity} blocks cannot be split over {num_workers}")
    chosen = make_router(router) if isinstance(router, str) else router
    config = _sim_config(
        capacity, policy, requests, step_token_budget=step_token_budget, max_requests=max_requests
    )
    start = time.perf_counter()
    workers = [_new_worker(config) for _ in range(num_workers)]
    routed = [0] * num_workers
    finished = [0] * num_workers
    dropped = [0] * num_workers
    arrivals = sorted(range(len(requests)), key=lambda i: requests[i].timestamp_ms)
    position, clock = 0, 0
    while position < len(arrivals) or not all(sim.is_done for sim in workers):
        if all(sim.is_done for sim in workers):
            clock = max(clock, requests[arrivals[position]].timestamp_ms // step_ms)
        while position < len(arrivals) and (
            requests[arrivals[position]].timestamp_ms // step_ms <= clock
        ):
            index = arrivals[position]
            trace_request = requests[index]
            request = SimRequest.from_hash_ids(
                index,
                trace_request.hash_ids,
                trace_request.input_length,
                trace_request.output_length,
                arrival_step=clock,
            )
            loads = [
                WorkerLoad(routed[w] - finished[w], workers[w].allocator.get_active_used())
                for w in range(num_workers)
            ]
            worker = chosen.choose(_route_query(request, config.block_size), loads)
            if not 0 <= worker < num_workers:
                raise InvalidArgumentError(f"router {chosen.name!r} chose worker {worker}")
            workers[worker].submit(request)
            routed[worker] += 1
            position += 1
        for worker, sim in enumerate(workers):
            if not sim.is_done:
                finished[worker] += sim.step().num_finished
            _forward_events(sim, worker, chosen, dropped)
        clock += 1
    reports = [sim.report() for sim in workers]
    return ClusterResult(
        router=chosen.name,
        num_workers=num_workers,
        total_capacity=total_capacity,
        num_requests=len(requests),
        num_steps=clock,
        prompt_tokens=sum(r.prompt_tokens for r in reports),
        tokens_saved=sum(r.prefill_tokens_saved for r in reports),
        requests_per_worker=tuple(routed),
        tokens_per_worker=tuple(r.prefill_tokens + r.decode_tokens for r in reports),
        evictions=sum(r.num_evicted_blocks for r in reports),
        preemptions=sum(r.num_preemptions for r in reports),
        seconds=time.perf_counter() - start,
    )


def _route_query(request: SimRequest, block_size: int) -> RouteQuery:
    """What the loop could match: full blocks, leaving the last prompt token to compute."""
    hashes = request.block_hashes or ()
    num_matchable = (request.input_length - 1) // block_size
    return RouteQuery(
        request.request_id, tuple(hashes[:num_matchable]), -(-request.input_length // block_size)
    )


def _forward_events(
    sim: DynamicBatchingSim, worker: int, router: Router, dropped: list[int]
) -> None:
    log = sim.allocator.events
    assert log is not None  # attached by _new_worker
    events = sim.allocator.take_events()
    if log.num_dropped != dropped[worker]:  # the queue overflowed: resynchronise
        dropped[worker] = log.num_dropped
        router.observe(worker, [AllBlocksCleared(), *sim.allocator.snapshot()])
    elif events:
        router.observe(worker, events)
