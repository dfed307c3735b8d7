"""Replaying a trace over many workers behind a router: which placement keeps prefixes hot.

A deployment runs N engine instances; a router picks one for every request.
:func:`replay_cluster` models that with N workers, each a
:class:`~prefixcache.serving.sim.DynamicBatchingSim` (an allocator plus the reference
dynamic-batching loop) holding ``total_capacity // N`` blocks, so runs with
different N compare at a fixed total memory. All workers step in lockstep,
one loop step per ``step_ms`` of trace time; a request is routed when it
arrives.

Routers (:data:`ROUTERS`):

- ``round_robin``: worker ``i mod N`` for the i-th request;
- ``least_loaded``: the worker with the fewest unfinished requests, then the
  fewest active blocks;
- ``prefix_aware``: the cost model of NVIDIA Dynamo's KV router,
  ``overlap_weight * blocks to prefill + active blocks``, where the blocks to
  prefill are the prompt's blocks minus the longest prefix the worker holds.

The prefix-aware router learns what each worker holds only from the KV
cache events the workers' allocators record (drained after every step), as
a real router would: by default from :class:`PrefixIndex`, an in-process
index; or from NVIDIA Dynamo's standalone indexer (:class:`DynamoPrefixIndex`,
events published over ZMQ, overlaps asked over HTTP) when it is installed.

The module also holds the ``prefixcache compare --workers`` command
(:func:`add_cluster_arguments`, :func:`cluster_main`), runnable on its own as
``python -m prefixcache.cluster.simulation``.

>>> from prefixcache.serving.trace import TraceRequest
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

import argparse
import dataclasses
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from prefixcache.engine.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    wire_hash,
)
from prefixcache.errors import ConfigError, InvalidArgumentError, PrefixCacheError
from prefixcache.serving.sim import DynamicBatchingSim, SimConfig, SimRequest
from prefixcache.serving.trace import (
    TRACE_BLOCK_SIZE,
    TraceRequest,
    load_mooncake_trace,
    sample_trace_path,
)

if TYPE_CHECKING:
    from prefixcache.wire.publisher import ZmqEventPublisher

__all__ = [
    "DEFAULT_TOTAL_CAPACITY",
    "DEFAULT_WORKERS",
    "ROUTERS",
    "ClusterResult",
    "DynamoIndexerClient",
    "DynamoPrefixIndex",
    "LeastLoadedRouter",
    "PrefixAwareRouter",
    "PrefixIndex",
    "RoundRobinRouter",
    "RouteQuery",
    "Router",
    "WorkerLoad",
    "add_cluster_arguments",
    "cluster_main",
    "format_table",
    "free_tcp_port",
    "make_router",
    "replay_cluster",
    "start_dynamo_indexer",
    "synthetic_block_tokens",
]

ROUTERS = ("round_robin", "least_loaded", "prefix_aware")
"""Names :func:`make_router` understands."""

DEFAULT_WORKERS = (2, 4, 8)
DEFAULT_TOTAL_CAPACITY = 8000
"""Blocks across all workers (512-token blocks: about 4M tokens of KV)."""

_EVENT_QUEUE = 1 << 16  # events a worker may record in one step before drops force a resync


# ---------------------------------------------------------------------- what routers see


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


class OverlapIndex(Protocol):
    """Where a prefix-aware router learns which worker holds which prefix."""

    def apply(self, worker: int, events: Sequence[KVCacheEvent]) -> None:
        """Fold worker ``worker``'s events into the index."""
        ...

    def overlaps(self, block_hashes: Sequence[int], num_workers: int) -> list[int]:
        """Per worker, how many leading ``block_hashes`` it holds."""
        ...


class PrefixIndex:
    """In-process index of resident hashes per worker, fed only by KV cache events.

    Keeps, per wire hash, the set of workers holding it. The overlap of a
    query with a worker is the number of leading hashes the worker holds, the
    quantity Dynamo's indexer reports. Not thread-safe.

    >>> index = PrefixIndex()
    >>> index.apply(0, [BlockStored((1, 2), None, (), 4)])
    >>> index.apply(1, [BlockStored((1,), None, (), 4)])
    >>> index.overlaps([1, 2, 3], num_workers=3)
    [2, 1, 0]
    """

    def __init__(self) -> None:
        self._workers_of: dict[int, set[int]] = {}
        self._hashes_of: dict[int, set[int]] = {}

    def apply(self, worker: int, events: Sequence[KVCacheEvent]) -> None:
        """Fold events into the index.

        Complexity: O(hashes in the events).
        """
        held = self._hashes_of.setdefault(worker, set())
        for event in events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    self._workers_of.setdefault(block_hash, set()).add(worker)
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._forget(worker, block_hash)
                held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                for block_hash in held:
                    self._forget(worker, block_hash)
                held.clear()

    def _forget(self, worker: int, block_hash: int) -> None:
        workers = self._workers_of.get(block_hash)
        if workers is not None:
            workers.discard(worker)
            if not workers:
                del self._workers_of[block_hash]

    def overlaps(self, block_hashes: Sequence[int], num_workers: int) -> list[int]:
        """Per worker, how many leading ``block_hashes`` it holds.

        Complexity: O(length of the longest overlap).
        """
        result = [0] * num_workers
        alive = set(range(num_workers))
        for depth, block_hash in enumerate(block_hashes):
            holders = self._workers_of.get(wire_hash(block_hash), set())
            for worker in alive - holders:
                result[worker] = depth
            alive &= holders
            if not alive:
                return result
        for worker in alive:
            result[worker] = len(block_hashes)
        return result

    def num_hashes(self, worker: int) -> int:
        """Hashes the index believes ``worker`` holds. O(1)."""
        return len(self._hashes_of.get(worker, ()))


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


# ---------------------------------------------------------------------- the replay


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
    capacity: int, policy: str, requests: Sequence[TraceRequest], **knobs: int
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
        **knobs,
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

    Each worker is a :class:`~prefixcache.serving.sim.DynamicBatchingSim` with
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
    for name, value in (("num_workers", num_workers), ("total_capacity", total_capacity)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
    if isinstance(step_ms, bool) or not isinstance(step_ms, int) or step_ms < 1:
        raise InvalidArgumentError(f"step_ms must be an int >= 1, got {step_ms!r}")
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


# ---------------------------------------------------------------------- NVIDIA Dynamo


def synthetic_block_tokens(block_hash: int, block_size: int) -> list[int]:
    """Token IDs standing in for a trace block, a function of its chained hash alone.

    Dynamo's indexer keys blocks by a hash of their tokens, and trace
    requests carry no tokens; equal chained hashes give equal tokens, so
    equal prefixes stay equal on the indexer's side.

    Complexity: O(block_size).
    """
    mask = (1 << 64) - 1
    return [(((block_hash ^ i) * 0x9E3779B97F4A7C15) & mask) >> 49 for i in range(block_size)]


class DynamoIndexerClient:
    """HTTP client of NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer``).

    Uses only the standard library. Endpoints (ai-dynamo-runtime 1.6):
    ``POST /register`` a worker's ZMQ (and replay) endpoint, ``POST /unregister``,
    ``GET /workers``, ``POST /query`` with ``token_ids`` for per-worker
    overlap in tokens, ``GET /health``.

    Args:
        url: e.g. ``"http://127.0.0.1:8090"``.
        model_name: the radix tree to use (one per model).
        block_size: tokens per block; the first registration fixes it.
        timeout: seconds per HTTP request.
    """

    def __init__(
        self, url: str, model_name: str = "prefixcache", block_size: int = 16, timeout: float = 5.0
    ) -> None:
        self.url = url.rstrip("/")
        self.model_name = model_name
        self.block_size = block_size
        self.timeout = timeout

    def _call(self, method: str, path: str, body: object = None) -> object:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as exc:
            raise PrefixCacheError(
                f"indexer {method} {path}: HTTP {exc.code} {exc.read().decode()!r}"
            ) from exc
        return json.loads(text) if text else None

    def is_healthy(self) -> bool:
        """Whether ``GET /health`` answers. Complexity: one HTTP request."""
        try:
            self._call("GET", "/health")
        except (OSError, PrefixCacheError):
            return False
        return True

    def register(self, worker_id: int, endpoint: str, replay_endpoint: str | None = None) -> None:
        """Have the indexer subscribe to a worker's events.

        Raises:
            PrefixCacheError: the indexer refused (e.g. another block size).
        """
        body: dict[str, object] = {
            "instance_id": worker_id,
            "endpoint": endpoint,
            "model_name": self.model_name,
            "block_size": self.block_size,
        }
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        self._call("POST", "/register", body)

    def workers(self) -> list[dict[str, object]]:
        """The registered workers and their listeners' status."""
        result = self._call("GET", "/workers")
        return result if isinstance(result, list) else []

    def overlap_tokens(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> dict[int, int]:
        """Per worker ID, how many leading tokens of ``token_ids`` it holds (whole blocks).

        Workers holding nothing are absent. Raises PrefixCacheError on an HTTP error.
        """
        body: dict[str, object] = {"token_ids": list(token_ids), "model_name": self.model_name}
        if lora_name is not None:
            body["lora_name"] = lora_name
        result = self._call("POST", "/query", body)
        scores = result.get("scores", {}) if isinstance(result, dict) else {}
        return {int(worker): max(ranks.values(), default=0) for worker, ranks in scores.items()}


def start_dynamo_indexer(
    port: int, log_path: Path | None = None, timeout: float = 20.0
) -> subprocess.Popen[bytes]:
    """Start ``python -m dynamo.indexer --port port`` and wait until it answers.

    The caller must terminate the returned process. Note: the indexer binds
    its HTTP port on all interfaces (it has no host option).

    Raises:
        PrefixCacheError: it did not answer within ``timeout`` seconds (it is killed).
    """
    log = open(log_path, "wb") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    client = DynamoIndexerClient(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        if client.is_healthy():
            return process
        time.sleep(0.05)
    process.kill()
    process.wait()
    raise PrefixCacheError(f"dynamo.indexer did not come up on port {port} in {timeout} s")


def free_tcp_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the indexer's HTTP server)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class DynamoPrefixIndex:
    """An :class:`OverlapIndex` backed by Dynamo's standalone indexer.

    Every worker gets a :class:`~prefixcache.wire.publisher.ZmqEventPublisher` on
    127.0.0.1 (with replay), registered with the indexer; :meth:`apply`
    publishes, :meth:`overlaps` asks ``POST /query``. Trace blocks carry no
    tokens, so stored events and queries use :func:`synthetic_block_tokens`.
    The indexer applies events asynchronously: :meth:`apply` waits
    ``settle_seconds`` so that the next query sees them (a real router
    accepts that lag instead).

    Args:
        client: the indexer's client; its ``block_size`` must be the workers'.
        num_workers: workers to register (IDs ``1..num_workers``).
        settle_seconds: pause after each publish.
    """

    def __init__(
        self, client: DynamoIndexerClient, num_workers: int, settle_seconds: float = 0.002
    ) -> None:
        from prefixcache.wire.publisher import ZmqEventPublisher

        self.client = client
        self.settle_seconds = settle_seconds
        self.publishers: list[ZmqEventPublisher] = []
        for worker in range(num_workers):
            publisher = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
            self.publishers.append(publisher)
            client.register(worker + 1, publisher.endpoint, publisher.replay_endpoint)
        self._tokens: Callable[[int], list[int]] = lambda h: synthetic_block_tokens(
            h, client.block_size
        )

    def apply(self, worker: int, events: Sequence[KVCacheEvent]) -> None:
        """Publish ``events`` for ``worker``, tokens filled in; then settle."""
        filled = [
            BlockStored(
                event.block_hashes,
                event.parent_block_hash,
                tuple(t for h in event.block_hashes for t in self._tokens(h)),
                event.block_size,
                event.lora_name,
                event.medium,
            )
            if isinstance(event, BlockStored) and not event.token_ids
            else event
            for event in events
        ]
        self.publishers[worker].publish(filled)
        time.sleep(self.settle_seconds)

    def overlaps(self, block_hashes: Sequence[int], num_workers: int) -> list[int]:
        """Per worker, leading blocks held, from the indexer (one HTTP request)."""
        tokens = [t for h in block_hashes for t in self._tokens(wire_hash(h))]
        scores = self.client.overlap_tokens(tokens) if tokens else {}
        size = self.client.block_size
        return [scores.get(worker + 1, 0) // size for worker in range(num_workers)]

    def close(self) -> None:
        """Close every publisher."""
        for publisher in self.publishers:
            publisher.close()


# ---------------------------------------------------------------------- command line


def _count_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(dict.fromkeys(int(part) for part in text.split(",")))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1, got {text!r}")
    return values


def _router_list(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",")))
    unknown = [name for name in names if name not in ROUTERS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown router(s) {unknown}; valid: {', '.join(ROUTERS)}"
        )
    return names


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--workers``, ``--routers``, ``--total-capacity`` and ``--dynamo`` to ``parser``.

    ``--workers`` defaults to None, so a command can tell whether cluster mode was asked.
    """
    parser.add_argument(
        "--workers",
        type=_count_list,
        default=None,
        help="replay over N workers behind each router, e.g. 4 or 2,4,8 (cluster mode)",
    )
    parser.add_argument(
        "--routers",
        type=_router_list,
        default=ROUTERS,
        help=f"comma-separated routers (default: {','.join(ROUTERS)})",
    )
    parser.add_argument(
        "--total-capacity",
        type=int,
        default=DEFAULT_TOTAL_CAPACITY,
        help=f"blocks across all workers (default: {DEFAULT_TOTAL_CAPACITY})",
    )
    parser.add_argument(
        "--dynamo",
        action="store_true",
        help="prefix_aware asks NVIDIA Dynamo's standalone indexer (started on 127.0.0.1)",
    )


def cluster_main(args: argparse.Namespace) -> int:
    """Run the cluster comparison and print a markdown table; return the exit status.

    Reads ``args.trace``, ``args.limit``, ``args.workers``, ``args.routers``,
    ``args.total_capacity``, ``args.dynamo`` and, if present, the first of
    ``args.policies`` (default LRU).

    Complexity: one :func:`replay_cluster` per router and worker count.
    """
    path = args.trace if args.trace is not None else sample_trace_path()
    try:
        requests = load_mooncake_trace(path, limit=args.limit)
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read trace {path}: {exc.strerror or exc}") from exc
    policy = args.policies[0] if getattr(args, "policies", None) else "lru"
    counts = args.workers or DEFAULT_WORKERS
    rows = [
        _run_one(requests, n, args.total_capacity, name, policy, args.dynamo)
        for n in counts
        for name in args.routers
    ]
    print(
        f"{Path(path).name}: {len(requests)} requests; {args.total_capacity:,} blocks in total "
        f"split evenly; policy {policy}; hit rate = prompt tokens served from cache / prompt "
        "tokens; spread = busiest worker's computed tokens / mean\n"
    )
    print(format_table(rows))
    return 0


def _run_one(
    requests: Sequence[TraceRequest], n: int, total: int, name: str, policy: str, dynamo: bool
) -> ClusterResult:
    if not (dynamo and name == "prefix_aware"):
        return replay_cluster(requests, n, total, name, policy=policy)
    port = free_tcp_port()
    process = start_dynamo_indexer(port)
    index = None
    try:
        client = DynamoIndexerClient(f"http://127.0.0.1:{port}", block_size=TRACE_BLOCK_SIZE)
        index = DynamoPrefixIndex(client, n)
        router = PrefixAwareRouter(index)
        result = replay_cluster(requests, n, total, router, policy=policy)
        return ClusterResult(**{**result.__dict__, "router": "prefix_aware (dynamo)"})
    finally:
        if index is not None:
            index.close()
        process.kill()
        process.wait()


def format_table(results: Sequence[ClusterResult]) -> str:
    """A markdown table, one row per result."""
    lines = [
        "| workers | router | hit rate | tokens saved | spread | requests/worker (min-max) "
        "| steps | evictions | preempted |",
        "| ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r.num_workers} | {r.router} | {r.hit_rate:.3f} | {r.tokens_saved:,} "
            f"| {r.load_spread:.2f} | {min(r.requests_per_worker)}-{max(r.requests_per_worker)} "
            f"| {r.num_steps:,} | {r.evictions:,} | {r.preemptions} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m prefixcache.cluster.simulation``: the cluster comparison on its own."""
    parser = argparse.ArgumentParser(
        prog="python -m prefixcache.cluster.simulation",
        description="Replay a trace over N workers behind several routers.",
    )
    parser.add_argument("--trace", type=Path, default=None, help="default: the shipped sample")
    parser.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    parser.add_argument("--policy", default="lru", help="eviction policy (default: lru)")
    add_cluster_arguments(parser)
    args = parser.parse_args(argv)
    args.policies = (args.policy,)
    try:
        return cluster_main(args)
    except PrefixCacheError as exc:
        print(f"prefixcache: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
