"""Replaying a request trace through a KVBlockAllocator, with or without concurrency.

:func:`replay` is the reference hit-rate model of ``../shared/traces/README.md``, run
through the real allocator API rather than a toy cache: requests in file
order, no concurrency, prompt blocks only, ``TRACE_BLOCK_SIZE``-token blocks.
For each request:

1. ``match_prefix(hashes, acquire=True)``: the hit is the longest cached
   prefix of its chained hashes (:func:`~prefixcache.reference.trace.trace_block_hashes`);
2. ``allocate_memory_blocks`` for the rest and ``register_kv_block_hashes``
   for them, so every block of the request is now inserted or touched;
3. ``release_memory_blocks`` on all of them: they become cached;
4. ``evict_cached_blocks`` trims the cache back to ``capacity`` blocks
   through the eviction policy.

With ``conversation_ends`` a request marked ``ends_conversation`` (the last
turn of a conversation its client closed) calls ``end_conversation`` on its
chain between steps 3 and 4, freeing the chain's cached tail (DESIGN.md,
"Scheduler hints"); never for ``belady``, which knows the future already.

Hit rate = hit blocks / all prompt blocks. The pool holds ``capacity`` plus
the longest request's blocks, so a request always fits beside a full cache
and the policy alone decides what goes, in step 4 (the model lets the cache
exceed capacity until the trim).

The trim is one ``evict_cached_blocks(excess)`` call. It follows the
policy's order exactly because the allocator asks the policy for one victim
at a time, so a parent exposed by evicting its child competes for the next
slot; taking all victims from the current leaves at once would not (Belady at
1,000 blocks would fall from 0.277 to 0.106 on the shared trace).

For the offline optimum (``policy="belady"``) the replay knows the future: it
lists for every hash the indices of the requests that use it and gives
:class:`~prefixcache.policies.BeladyPolicy` a ``next_use(block_id)`` callable over that
list and the block -> hash map of the blocks it registered.

:func:`replay_concurrent` replays the same trace with real concurrency
instead, through the dynamic-batching loop of :mod:`prefixcache.reference.sim`:
requests arrive at their timestamps, hold their blocks while they prefill
and decode, and the pool of ``capacity`` blocks holds running requests and
the cache together.

>>> from prefixcache.reference.trace import TraceRequest
>>> a, b = TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(5, 1536, 1, (1, 2, 3))
>>> result = replay([a, b, a], capacity=8)
>>> result.hit_blocks, result.prompt_blocks, result.tokens_saved
(4, 7, 2048)
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from prefixcache import policies
from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.engine.config import PolicySpec
from prefixcache.engine.validation import require_flag, require_int
from prefixcache.errors import CapacityError, InvalidArgumentError
from prefixcache.reference.trace import TRACE_BLOCK_SIZE, TraceRequest, trace_block_hashes
from prefixcache.tools.progress import progress_bar

if TYPE_CHECKING:
    from prefixcache.reference.sim import DynamicBatchingSim

__all__ = [
    "OPTIMUM_POLICY",
    "ConcurrentReplayResult",
    "ReplayResult",
    "online_policies",
    "replay",
    "replay_concurrent",
]

OPTIMUM_POLICY = "belady"
"""Name of the offline-optimum policy, which only a replay can run."""


def online_policies() -> list[str]:
    """Every registered policy name but :data:`OPTIMUM_POLICY`: those a live allocator can run.

    Complexity: O(registered policies).
    """
    return [name for name in policies.available() if name != OPTIMUM_POLICY]


@dataclass(frozen=True)
class ReplayResult:
    """What one replay measured.

    Attributes:
        policy: eviction policy name.
        capacity: cached blocks kept after each request.
        num_requests: requests replayed.
        prompt_blocks: prompt blocks of all requests (partial last blocks included).
        hit_blocks: prompt blocks found cached (longest cached prefix of each request).
        prompt_tokens: prompt tokens of all requests.
        tokens_saved: prefill tokens the hits spare: per request
            ``min(hit blocks * block size, input_length)``.
        evictions: blocks evicted from the cache.
        seconds: wall time of the replay (hashing included, trace loading not).
    """

    policy: str
    capacity: int
    num_requests: int
    prompt_blocks: int
    hit_blocks: int
    prompt_tokens: int
    tokens_saved: int
    evictions: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        """Hit blocks / prompt blocks (0.0 for an empty trace)."""
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def requests_per_second(self) -> float:
        """Replay speed (``inf`` when the run was too short to time)."""
        return self.num_requests / self.seconds if self.seconds > 0 else float("inf")


def replay(
    requests: Sequence[TraceRequest],
    capacity: int,
    policy: str = "lru",
    *,
    progress: bool = False,
    block_size: int = TRACE_BLOCK_SIZE,
    conversation_ends: bool = False,
) -> ReplayResult:
    """Replay ``requests`` in order, one at a time, through an allocator with ``policy``.

    Args:
        requests: the trace, e.g. from :func:`~prefixcache.reference.trace.load_mooncake_trace`.
        capacity: cached blocks kept after each request (>= 0).
        policy: a registered policy name; ``"belady"`` is the offline optimum.
        progress: show a progress bar on long runs (tqdm when installed,
            else a counter on stderr).
        block_size: tokens per trace block (what ``prefixcache convert`` used);
            it counts ``tokens_saved`` and nothing else.
        conversation_ends: after a request marked ``ends_conversation``,
            ``end_conversation`` on its chain (never for ``belady``).

    Returns:
        A :class:`ReplayResult`.

    Raises:
        InvalidArgumentError: ``capacity`` is not an int >= 0, ``policy``
            is not a name (:class:`~prefixcache.errors.ConfigError`: unknown
            name), or ``conversation_ends`` is not a bool.

    Complexity: O(prompt blocks) allocator work, plus O(log n) policy work per
    inserted, hit or evicted block.
    """
    capacity = require_int(capacity, "capacity", minimum=0)
    block_size = require_int(block_size, "block_size", minimum=1)
    _check_policy(policy)
    ends = require_flag(conversation_ends, "conversation_ends") and policy != OPTIMUM_POLICY
    start = time.perf_counter()
    chains = [np.array(trace_block_hashes(r.hash_ids), dtype=np.int64) for r in requests]
    max_blocks = max((len(chain) for chain in chains), default=0)
    total_count = capacity + max_blocks + 1  # + 1: the dummy block
    block_hash = np.zeros(total_count, dtype=np.int64)  # hash each block was registered under
    oracle: _NextUseOracle | None = None
    spec: PolicySpec = policy
    if policy == OPTIMUM_POLICY:
        oracle = _NextUseOracle((chain.tolist() for chain in chains), lambda b: int(block_hash[b]))
        spec = {"name": policy, "next_use": oracle}
    allocator = KVBlockAllocator(
        total_count=max(total_count, 2),
        block_size_tokens=block_size,
        eviction_policy=spec,
        device="cpu",
    )
    hit_blocks = tokens_saved = 0
    label = f"{policy}, {capacity} blocks"
    with progress_bar(len(requests), enabled=progress, label=label) as advance:
        for index, (request, hashes) in enumerate(zip(requests, chains, strict=True)):
            if oracle is not None:
                oracle.first_pending = index + 1
            ending = ends and request.ends_conversation
            num_hit = _replay_one(allocator, hashes, block_hash, capacity, ending)
            hit_blocks += num_hit
            tokens_saved += min(num_hit * block_size, request.input_length)
            advance(1)
    return ReplayResult(
        policy=policy,
        capacity=capacity,
        num_requests=len(requests),
        prompt_blocks=sum(len(chain) for chain in chains),
        hit_blocks=hit_blocks,
        prompt_tokens=sum(request.input_length for request in requests),
        tokens_saved=tokens_saved,
        evictions=allocator.stats().num_evicted_blocks,
        seconds=time.perf_counter() - start,
    )


def _check_policy(policy: object) -> None:
    if not isinstance(policy, str):
        raise InvalidArgumentError(f"policy must be a registered name, got {policy!r}")


def _replay_one(
    allocator: KVBlockAllocator,
    hashes: np.ndarray,
    block_hash: np.ndarray,
    capacity: int,
    ends: bool,
) -> int:
    """Look up, insert or touch, release, end its conversation if ``ends``, and trim for one
    request; return its hit blocks."""
    hit_ids = allocator.match_prefix(hashes, acquire=True)
    num_hit = len(hit_ids)
    fresh_ids = allocator.allocate_memory_blocks(len(hashes) - num_hit)
    if fresh_ids is None:  # the pool is sized so that this cannot happen
        raise CapacityError(f"no room for {len(hashes) - num_hit} blocks beside the cache")
    if len(fresh_ids):
        parent = int(hashes[num_hit - 1]) if num_hit else None
        allocator.register_kv_block_hashes(fresh_ids, hashes[num_hit:], parent_hash=parent)
        block_hash[fresh_ids.numpy()] = hashes[num_hit:]
        allocator.release_memory_blocks(fresh_ids)
    allocator.release_memory_blocks(hit_ids)
    if ends:
        allocator.end_conversation(hashes)
    excess = allocator.get_evictable_block_count() - capacity
    if excess > 0:
        allocator.evict_cached_blocks(excess)
    return num_hit


class _NextUseOracle:
    """Belady's view of the future: block ID -> index of the next request using its hash.

    Requests are indexed in arrival order. ``first_pending`` is the first
    request that has not taken its blocks yet, so the next use of a cached
    block is the first request at or after it whose chain holds the block's
    hash (``never``, the number of requests, if none). ``hash_of`` maps a block
    to the hash it is registered under.
    """

    def __init__(self, chains: Iterable[Iterable[int]], hash_of: Callable[[int], int]) -> None:
        self._uses: dict[int, list[int]] = {}
        index = -1
        for index, chain in enumerate(chains):
            for value in chain:
                self._uses.setdefault(value, []).append(index)
        self.never = index + 1
        self.hash_of = hash_of
        self.first_pending = 0

    def __call__(self, block_id: int) -> int:
        indices = self._uses.get(self.hash_of(block_id))
        if indices is None:
            return self.never
        position = bisect_left(indices, self.first_pending)
        return indices[position] if position < len(indices) else self.never


@dataclass(frozen=True)
class ConcurrentReplayResult:
    """What one replay through the dynamic-batching loop measured.

    Attributes:
        policy: eviction policy name.
        capacity: blocks in the pool (running requests and the cache together).
        num_requests: requests replayed.
        num_steps: loop steps run.
        prompt_tokens: prompt tokens admitted (a requeued request counts again).
        tokens_saved: prompt tokens served from the cache at admission.
        evictions: blocks evicted from the cache.
        pauses: requests paused for want of a block.
        preemptions: paused requests released and requeued.
        seconds: wall time of the replay.
    """

    policy: str
    capacity: int
    num_requests: int
    num_steps: int
    prompt_tokens: int
    tokens_saved: int
    evictions: int
    pauses: int
    preemptions: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache / prompt tokens admitted (0.0 if none)."""
        return self.tokens_saved / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def requests_per_second(self) -> float:
        """Replay speed (``inf`` when the run was too short to time)."""
        return self.num_requests / self.seconds if self.seconds > 0 else float("inf")


def replay_concurrent(
    requests: Sequence[TraceRequest],
    capacity: int,
    policy: str = "lru",
    *,
    step_ms: int = 50,
    step_token_budget: int = 8192,
    max_requests: int = 256,
    progress: bool = False,
    queue_hints: bool = False,
    conversation_ends: bool = False,
) -> ConcurrentReplayResult:
    """Replay ``requests`` with real concurrency through :mod:`prefixcache.reference.sim`.

    Each request arrives at loop step ``timestamp_ms // step_ms``; a step
    computes up to ``step_token_budget`` tokens (one decode token per running
    request, then prefill chunks), so the defaults model an engine that
    prefills about 160k tokens a second. Requests hold their blocks from
    admission until they finish; the pool has ``capacity`` blocks (plus the
    dummy), an eighth of them the paused budget, and the cache lives in what
    running requests leave free. Only full prompt blocks are matched and the
    hit rate is counted in prompt tokens, as the loop reports it.

    With ``policy="belady"`` the future is the arrival order: a cached
    block's next use is the first request not yet admitted (FIFO, counted
    after each step) whose prompt holds its hash. Under concurrency this is a
    strong reference, not a proven optimum.

    Args:
        requests: the trace, in arrival order.
        capacity: blocks in the pool (>= 1); must hold the largest request.
        policy: a registered policy name.
        step_ms: trace milliseconds per loop step (>= 1).
        step_token_budget: tokens computed per step (>= 1).
        max_requests: running plus paused requests at most (block-table rows).
        progress: show a progress bar (finished requests) on long runs.
        queue_hints: the loop protects the cached prefixes of waiting requests
            (``SimConfig.queue_hints``; DESIGN.md, "Scheduler hints"). Never
            for ``belady``, which knows the future already.
        conversation_ends: when a request marked ``ends_conversation``
            finishes, the loop calls ``end_conversation`` on its blocks
            (``SimConfig.conversation_ends``). Never for ``belady`` either.

    Returns:
        A :class:`ConcurrentReplayResult`.

    Raises:
        ImportError: :mod:`prefixcache.reference.sim` is not available.
        InvalidArgumentError: a bad argument (ConfigError: unknown policy).
        CapacityError: a request needs more blocks than the pool can give it.

    Complexity: O(total tokens / block size + steps * requests in flight).
    """
    from prefixcache.reference import sim as loop  # imported here: the loop is an optional module

    capacity = require_int(capacity, "capacity", minimum=1)
    _check_policy(policy)
    step_ms = require_int(step_ms, "step_ms", minimum=1)
    queue_hints = require_flag(queue_hints, "queue_hints")
    conversation_ends = require_flag(conversation_ends, "conversation_ends")
    start = time.perf_counter()
    sim_requests = [
        loop.SimRequest.from_hash_ids(
            index,
            request.hash_ids,
            request.input_length,
            request.output_length,
            arrival_step=request.timestamp_ms // step_ms,
            ends_conversation=request.ends_conversation,
        )
        for index, request in enumerate(requests)
    ]
    oracle: _NextUseOracle | None = None
    spec: PolicySpec = policy
    if policy == OPTIMUM_POLICY:
        oracle = _NextUseOracle((r.block_hashes or () for r in sim_requests), lambda b: 0)
        spec = {"name": policy, "next_use": oracle}
    blocks_needed = (-(-(r.input_length + r.output_length) // TRACE_BLOCK_SIZE) for r in requests)
    sim = loop.DynamicBatchingSim(
        loop.SimConfig(
            total_count=capacity + 1,
            block_size=TRACE_BLOCK_SIZE,
            eviction_policy=spec,
            max_requests=max_requests,
            max_blocks_per_request=max(blocks_needed, default=1),
            step_token_budget=step_token_budget,
            device="cpu",
            queue_hints=queue_hints and oracle is None,
            conversation_ends=conversation_ends and oracle is None,
            # The oracle reads block hashes from inside the policy's calls, which the
            # native engine refuses as re-entrant: the optimum runs on the Python engine.
            engine="auto" if oracle is None else "python",
        )
    )
    if oracle is not None:
        oracle.hash_of = sim.allocator.registry.hash_of
    for sim_request in sim_requests:
        sim.submit(sim_request)
    _run_loop(sim, oracle, len(requests), progress, f"{policy}, {capacity} blocks")
    report = sim.report()
    return ConcurrentReplayResult(
        policy=policy,
        capacity=capacity,
        num_requests=len(requests),
        num_steps=report.num_steps,
        prompt_tokens=report.prompt_tokens,
        tokens_saved=report.prefill_tokens_saved,
        evictions=report.num_evicted_blocks,
        pauses=report.num_pauses,
        preemptions=report.num_preemptions,
        seconds=time.perf_counter() - start,
    )


def _run_loop(
    sim: DynamicBatchingSim,
    oracle: _NextUseOracle | None,
    num_requests: int,
    progress: bool,
    label: str,
) -> None:
    """Step ``sim`` until every request finished, keeping the oracle's frontier current."""
    num_finished = 0
    with progress_bar(num_requests, enabled=progress, label=label) as advance:
        while not sim.is_done:
            step = sim.step()
            num_finished += step.num_finished
            if oracle is not None:
                oracle.first_pending = num_finished + step.num_running + step.num_paused
            advance(step.num_finished)
