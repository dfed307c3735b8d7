"""A reference dynamic-batching loop around one KVBlockAllocator, with an end-to-end check.

This is the scheduler every engine writes, cut to what touches the KV cache, to copy from:

- **admit** waiting requests in arrival order while memory allows: longest-prefix
  match with ``match_prefix(..., acquire=True)``, allocate the rest of the prompt,
  put the blocks in a :class:`~prefixcache.serving.block_table.BlockTable` row;
- **prefill** in chunks under a per-step token budget, registering each full
  block's hash once its KV is written, so later prompts can hit it;
- **decode** one token per running request, taking a new block every
  ``block_size`` tokens and registering a block when it fills, continuing the
  hash chain with ``parent_hash``;
- **pause** a request whose next block cannot be had (``allocator.pause``),
  **resume** it when room returns; a request the paused budget cannot take is
  released and requeued (recomputed later, mostly from the prefix cache);
- **finish** requests and release their blocks in one ``free_group``.

Requests carry prompt tokens or, as in traces, precomputed chained block
hashes. Generated tokens are synthetic but, like greedy decoding, a
deterministic function of the prefix, so identical prompts decode identically.

With ``verify=True`` each token's K and V are a deterministic function of the
whole prefix up to it (derived from a running chained hash of the tokens),
written into a :class:`~prefixcache.serving.kv_cache.KVCache` at prefill and decode;
on every prefix hit the matched blocks are gathered and compared with freshly
computed values, and a mismatch raises :class:`~prefixcache.errors.InvariantError`.

With ``model=`` a :class:`~prefixcache.reference.model.TinyDecoder` the loop serves
a real forward pass instead: one paged forward per step over its decode tokens
and prefill chunks, greedy tokens, MoE routing stored per block and replayed on
prefix hits, and a :class:`~prefixcache.reference.model_serving.RequestOutput` per
finished request that
:func:`~prefixcache.reference.model_serving.compare_with_reference` checks against
the dense model (DESIGN.md, "Serving a model").

Hybrid models (linear-attention state, sliding windows, forks sharing a partial block)
are served by :class:`~prefixcache.reference.sim_hybrid.HybridBatchingSim`, the same loop
over a :class:`~prefixcache.serving.hybrid.HybridMemory` (DESIGN.md, "Hybrid models").

>>> requests = [
...     SimRequest.from_tokens(i, [7] * 40 + [i], output_length=4, arrival_step=i) for i in range(6)
... ]
>>> report = run(requests, SimConfig(total_count=64, block_size=8, verify=True))
>>> report.num_finished, report.prefill_tokens_saved, report.prompt_tokens
(6, 200, 246)
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.engine.config import AllocatorConfig, PolicySpec
from prefixcache.engine.hashing import compute_block_hashes
from prefixcache.engine.pool import resolve_device
from prefixcache.engine.validation import require_flag, require_int
from prefixcache.errors import (
    BudgetExceededError,
    CapacityError,
    ConfigError,
    InvalidArgumentError,
    InvariantError,
)
from prefixcache.reference.model import TinyDecoder
from prefixcache.reference.model_serving import (
    RequestOutput,
    StepEntry,
    build_paged_batch,
    logits_tolerance,
)
from prefixcache.reference.trace import trace_block_hashes
from prefixcache.serving.block_table import BlockTable
from prefixcache.serving.kv_cache import KVCache

VOCAB_SIZE = 1 << 15
"""Synthetic tokens (trace prompts, generated tokens) lie in ``[0, VOCAB_SIZE)``."""

_MASK64 = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # odd: multiplying by it permutes 64-bit values


def _synthetic_token(seed: int, index: int) -> int:
    """A token that depends only on ``seed`` (a hash of the prefix) and ``index``.

    The top 15 bits of a multiplicative hash: cheap, and every bit of the seed counts.
    """
    return (((seed ^ index) * _MIX) & _MASK64) >> 49


def _same_device(first: torch.device, second: torch.device) -> bool:
    """Whether two devices are one (``cuda`` and ``cuda:0`` are, with one GPU current)."""
    if first.type != second.type:
        return False
    if first.type != "cuda":
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (first.index if first.index is not None else current) == (
        second.index if second.index is not None else current
    )


# ---------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class SimRequest:
    """One request: a prompt, given as tokens or as chained block hashes, and an output length.

    Give exactly one of ``prompt_tokens`` and ``block_hashes``. With hashes
    (trace requests), ``input_length`` says how long the prompt is and the
    hashes cover its full blocks (one more, for a trailing partial block as
    Mooncake traces list it, is allowed and only seeds that block's synthetic
    tokens). Build them with :meth:`from_tokens` or :meth:`from_hash_ids`.

    Attributes:
        request_id: a name for reports and error messages.
        output_length: tokens to generate, >= 0.
        prompt_tokens: the prompt's token IDs (each fits in int32), or None.
        block_hashes: chained hashes of the prompt's blocks (positive ints), or None.
        input_length: prompt length in tokens, >= 1 (derived from ``prompt_tokens``).
        arrival_step: the loop step at which the request arrives, >= 0.

    Raises:
        InvalidArgumentError: both or neither prompt form, or a bad length.
    """

    request_id: int | str
    output_length: int
    prompt_tokens: tuple[int, ...] | None = None
    block_hashes: tuple[int, ...] | None = None
    input_length: int = 0
    arrival_step: int = 0

    def __post_init__(self) -> None:
        if (self.prompt_tokens is None) == (self.block_hashes is None):
            raise InvalidArgumentError(
                f"request {self.request_id!r}: give exactly one of prompt_tokens and block_hashes"
            )
        if self.prompt_tokens is not None:
            if self.input_length not in (0, len(self.prompt_tokens)):
                raise InvalidArgumentError(
                    f"request {self.request_id!r}: input_length {self.input_length} but "
                    f"{len(self.prompt_tokens)} prompt tokens"
                )
            object.__setattr__(self, "input_length", len(self.prompt_tokens))
        for name, minimum in (("input_length", 1), ("output_length", 0), ("arrival_step", 0)):
            object.__setattr__(self, name, require_int(getattr(self, name), name, minimum=minimum))

    @classmethod
    def from_tokens(
        cls,
        request_id: int | str,
        tokens: Iterable[int],
        output_length: int,
        *,
        arrival_step: int = 0,
    ) -> SimRequest:
        """A request whose prompt is ``tokens``; the loop hashes them with the allocator.

        Complexity: O(len(tokens)).
        """
        return cls(
            request_id, output_length, prompt_tokens=tuple(tokens), arrival_step=arrival_step
        )

    @classmethod
    def from_hash_ids(
        cls,
        request_id: int | str,
        hash_ids: Sequence[int],
        input_length: int,
        output_length: int,
        *,
        arrival_step: int = 0,
    ) -> SimRequest:
        """A trace request: ``hash_ids`` name its prompt's blocks (Mooncake ``hash_ids``).

        Trace IDs are small ints (0 included, a sentinel to the allocator).
        They are chained into allocator hashes with
        :func:`~prefixcache.reference.trace.trace_block_hashes`, so equal ID prefixes give
        equal hashes and nothing else does.

        Args:
            request_id: a name for reports.
            hash_ids: one ID per prompt block, ints in int64 range.
            input_length: prompt tokens; the loop's ``block_size`` must be the
                trace's (512 for Mooncake traces).
            output_length: tokens to generate.
            arrival_step: loop step of arrival.

        Complexity: O(len(hash_ids)).
        """
        return cls(
            request_id,
            output_length,
            block_hashes=tuple(trace_block_hashes(hash_ids)),
            input_length=input_length,
            arrival_step=arrival_step,
        )


@dataclass(frozen=True)
class SimConfig:
    """Sizes and knobs of the loop.

    Attributes:
        total_count: KV blocks in the pool, the dummy included.
        block_size: tokens per block.
        paused_count: blocks paused requests may hold; ``None`` = an eighth of the pool.
        eviction_policy: any allocator policy spec (``"lru"``, ``"ref_zero"``, ...).
        max_requests: block-table rows, i.e. running plus paused requests.
        max_blocks_per_request: block-table columns.
        step_token_budget: tokens computed per step, decodes first, then prefill chunks.
        device: where the allocator's and block table's device mirrors live.
        verify: write reference K/V and check every prefix hit against it (with a
            model: check the K/V of every hit against the dense forward's).
        kv_events_capacity: passed to the allocator (0: no KV cache events).
        enable_prefix_caching: False turns prefix reuse off (nothing matches), for
            comparing a run with caching against one without.
        record_logits: with a model, keep the logits of every generated token in
            :attr:`DynamicBatchingSim.outputs` (one ``[vocab]`` row each, on the CPU).
    """

    total_count: int = 1024
    block_size: int = 16
    paused_count: int | None = None
    eviction_policy: PolicySpec = "lru"
    max_requests: int = 64
    max_blocks_per_request: int = 256
    step_token_budget: int = 2048
    device: str | None = "cpu"
    verify: bool = False
    kv_events_capacity: int = 0
    enable_prefix_caching: bool = True
    record_logits: bool = False

    def __post_init__(self) -> None:
        for name in (
            "total_count",
            "block_size",
            "max_requests",
            "max_blocks_per_request",
            "step_token_budget",
        ):
            value = require_int(getattr(self, name), name, minimum=1, error=ConfigError)
            object.__setattr__(self, name, value)
        for name in ("verify", "enable_prefix_caching", "record_logits"):
            flag = require_flag(getattr(self, name), name, error=ConfigError)
            object.__setattr__(self, name, flag)


# ---------------------------------------------------------------------- reports


@dataclass(frozen=True)
class StepReport:
    """What one :meth:`DynamicBatchingSim.step` did, and the state it left.

    Requests and blocks are counted after the step; events and tokens within it.
    ``prompt_tokens`` and ``prefill_tokens_saved`` belong to the requests
    admitted in this step (a requeued request is counted again when readmitted).
    """

    step: int
    num_running: int
    num_paused: int
    num_waiting: int
    num_free_blocks: int
    num_active_blocks: int
    num_paused_blocks: int
    num_cached_blocks: int
    num_finished: int = 0
    prompt_tokens: int = 0
    prefill_tokens_saved: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    num_evicted_blocks: int = 0
    num_pauses: int = 0
    num_resumes: int = 0
    num_preemptions: int = 0


_SUMMED = (
    "num_finished",
    "prompt_tokens",
    "prefill_tokens_saved",
    "prefill_tokens",
    "decode_tokens",
    "num_evicted_blocks",
    "num_pauses",
    "num_resumes",
    "num_preemptions",
)


@dataclass(frozen=True)
class SimReport:
    """Totals of a run: the events of every :class:`StepReport` summed.

    ``hit_rate`` is the prefix hit rate in tokens: prompt tokens served from
    the cache over prompt tokens admitted. ``num_preemptions`` counts paused
    requests released and requeued.
    """

    num_steps: int
    num_requests: int
    num_finished: int
    prompt_tokens: int
    prefill_tokens_saved: int
    prefill_tokens: int
    decode_tokens: int
    num_evicted_blocks: int
    num_pauses: int
    num_resumes: int
    num_preemptions: int
    steps: tuple[StepReport, ...] = field(default=(), repr=False)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache over prompt tokens admitted (0.0 if none)."""
        return self.prefill_tokens_saved / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> str:
        """A few human-readable lines."""
        return (
            f"{self.num_finished}/{self.num_requests} requests in {self.num_steps} steps\n"
            f"prefix hit rate {self.hit_rate:.1%}: {self.prefill_tokens_saved:,} of "
            f"{self.prompt_tokens:,} prompt tokens served from cache\n"
            f"computed {self.prefill_tokens:,} prefill + {self.decode_tokens:,} decode tokens\n"
            f"evicted {self.num_evicted_blocks:,} blocks; {self.num_pauses} pauses, "
            f"{self.num_resumes} resumes, {self.num_preemptions} requeued"
        )


# ---------------------------------------------------------------------- the loop


@dataclass(slots=True, eq=False)
class _Sequence:
    """A request's progress; owned and changed only by the loop."""

    request: SimRequest
    block_hashes: list[int]  # chained hashes of the full blocks of the tokens so far
    tail_tokens: list[int]  # tokens after the last full block
    # With a KV cache: the chained hash of the prefix ending at each token, else None.
    token_hashes: list[int] | None
    num_tokens: int  # prompt + generated tokens so far
    prompt_length: int  # tokens to prefill at this admission (all tokens, once requeued)
    num_generated: int = 0
    num_computed: int = 0  # tokens whose KV is in the cache (written or hit)
    num_registered: int = 0  # leading full blocks already handed to register_kv_block_hashes
    slot: int = -1  # BlockTable row while admitted
    # Model mode only: every token so far, the greedy choice for the next one, the
    # logits of each generated token (when recorded), each token's routed experts
    # ([input + output tokens, 1, top_k] int64) and the prompt tokens the cache served.
    tokens: list[int] | None = None
    next_token: int = -1
    logits: list[torch.Tensor] | None = None
    routing: np.ndarray | None = None
    num_cached: int = 0

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.prompt_length

    @property
    def is_finished(self) -> bool:
        return not self.is_prefilling and self.num_generated == self.request.output_length


class DynamicBatchingSim:
    """The reference loop: one allocator, one block table, optionally a KV cache and a model.

    Call :meth:`submit` for each request, then :meth:`step` until
    :attr:`is_done`; :meth:`report` sums the steps. :func:`run` does all three.
    The allocator, table and cache are public attributes so tests and users can
    inspect them between steps (``sim.allocator.check_invariants()``).

    **Model mode** (``model=`` a :class:`~prefixcache.reference.model.TinyDecoder`):
    each step runs one paged forward over the step's decode tokens and prefill
    chunks, reading and writing K/V through the KV cache by the block table's
    IDs; decoding is greedy (the first generated token comes from the prompt's
    last position, each decode step feeds the previous choice). The MoE routing
    of every computed token is stored per block in the allocator, and a prefix
    hit replays the stored routing for the tokens it skips. Each finished
    request leaves a :class:`~prefixcache.reference.model_serving.RequestOutput`
    in :attr:`outputs`, which
    :func:`~prefixcache.reference.model_serving.compare_with_reference` checks
    against the dense forward. Trace requests get synthetic prompt tokens
    (modulo the vocabulary), a function of their block hashes as before.

    Not thread-safe.

    Args:
        config: sizes and knobs.
        kv_cache: where K/V is written; ``None`` writes nothing, unless
            ``config.verify`` asks for a small float32 CPU cache
            (2 layers, 2 heads, head_dim 4), or a model is given (then a cache
            shaped for the model, on its device). Must have
            ``config.total_count`` blocks of ``config.block_size`` tokens.
        model: serve this model (see above); ``config.device`` must be its device.

    Raises:
        ConfigError: inconsistent sizes, or a model on another device than
            ``config.device`` or with a cache it cannot use.
    """

    def __init__(
        self,
        config: SimConfig | None = None,
        *,
        kv_cache: KVCache | None = None,
        model: TinyDecoder | None = None,
    ) -> None:
        self.config = config = config or SimConfig()
        paused_count = config.paused_count
        if model is not None:
            if not isinstance(model, TinyDecoder):
                raise ConfigError(f"model must be a TinyDecoder, got {type(model).__name__}")
            if not _same_device(resolve_device(config.device), model.device):
                raise ConfigError(
                    f"the model is on {model.device}; config.device is {config.device!r}"
                )
        self.model = model
        self.allocator = KVBlockAllocator(
            AllocatorConfig(
                total_count=config.total_count,
                paused_count=config.total_count // 8 if paused_count is None else paused_count,
                block_size_tokens=config.block_size,
                eviction_policy=config.eviction_policy,
                device=config.device,
                kv_events_capacity=config.kv_events_capacity,
                enable_prefix_caching=config.enable_prefix_caching,
                # Model mode: one MoE layer's top-k experts per token, stored per block.
                routing_num_layers=None if model is None else 1,
                routing_top_k=None if model is None else model.config.top_k,
                routing_num_experts=None if model is None else model.config.num_experts,
            )
        )
        self.block_table = BlockTable.for_allocator(
            self.allocator, config.max_requests, config.max_blocks_per_request
        )
        if model is not None:
            if kv_cache is None:
                kv_cache = model.new_kv_cache(config.total_count, config.block_size)
            model.check_kv_cache(kv_cache)
        elif kv_cache is None and config.verify:
            kv_cache = KVCache(
                2, config.total_count, config.block_size, 2, 4, dtype=torch.float32, device="cpu"
            )
        if kv_cache is not None and (
            kv_cache.num_blocks != config.total_count or kv_cache.block_size != config.block_size
        ):
            raise ConfigError(
                f"kv_cache has {kv_cache.num_blocks} blocks of {kv_cache.block_size} tokens; "
                f"the loop uses {config.total_count} of {config.block_size}"
            )
        self.kv_cache = kv_cache
        self._arrivals: list[tuple[int, int, _Sequence]] = []  # heap by (arrival_step, order)
        self._order = itertools.count()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._paused: list[_Sequence] = []  # oldest pause first
        self._clock = 0
        self._num_requests = 0
        self._steps: list[StepReport] = []
        # Model mode: what each finished request produced, in finish order.
        self.outputs: list[RequestOutput] = []

    # ------------------------------------------------------------------ public

    def submit(self, request: SimRequest) -> None:
        """Queue ``request``; it joins the waiting queue at its ``arrival_step``.

        Raises:
            InvalidArgumentError: block hashes that do not cover the prompt's full
                blocks; in model mode, a prompt token outside the vocabulary.
            CapacityError: the request could never fit (more blocks than a
                table row or the active budget holds).

        Complexity: O(prompt tokens), to hash the prompt.
        """
        if self.model is not None and request.prompt_tokens is not None:
            vocab_size = self.model.config.vocab_size
            bad = [token for token in request.prompt_tokens if not 0 <= token < vocab_size]
            if bad:
                raise InvalidArgumentError(
                    f"request {request.request_id!r}: token {bad[0]} is outside the model's "
                    f"vocabulary [0, {vocab_size})"
                )
        block_size = self.config.block_size
        needed = -(-(request.input_length + request.output_length) // block_size)
        limit = min(self.config.max_blocks_per_request, self.allocator.active_count)
        if needed > limit:
            raise CapacityError(
                f"request {request.request_id!r} needs {needed} blocks; at most {limit} fit "
                "(max_blocks_per_request, or the pool minus the paused budget)"
            )
        sequence = self._new_sequence(request)
        heapq.heappush(self._arrivals, (request.arrival_step, next(self._order), sequence))
        self._num_requests += 1

    @property
    def num_steps(self) -> int:
        """Steps run so far. O(1)."""
        return len(self._steps)

    @property
    def is_done(self) -> bool:
        """Whether every submitted request has finished. O(1)."""
        return not (self._arrivals or self._waiting or self._running or self._paused)

    def step(self) -> StepReport:
        """Run one scheduling step: resume, admit, decode, prefill, write, register, finish.

        Returns:
            What the step did and the state it left.

        Raises:
            InvariantError: with a KV cache and ``verify``, a prefix hit served K/V
                that differs from the recomputed values.

        Complexity: O(tokens computed + blocks touched + requests in the system).
        """
        evicted_before = self.allocator.stats().num_evicted_blocks
        events = dict.fromkeys(_SUMMED, 0)
        self._arrive()
        events["num_resumes"] = self._resume_paused()
        if not self._paused:  # paused requests go first; new ones would take their room
            self._admit_waiting(events)
        writes: list[tuple[_Sequence, int, int]] = []  # (sequence, first, last + 1) tokens
        num_decode = self._decode(events, writes)
        self._prefill(self.config.step_token_budget - num_decode, events, writes)
        if self.model is not None:
            self._run_model(writes, num_decode)
        else:
            self._write_kv(writes)
        for sequence, _, _ in writes:
            self._register_computed_blocks(sequence)
        events["num_finished"] = self._finish()
        if self._paused and not self._running:
            # Nobody can run and nobody will free a block: give up the latest pause.
            self._requeue(self._paused.pop(), paused=True)
            events["num_preemptions"] += 1
        stats = self.allocator.stats()
        events["num_evicted_blocks"] = stats.num_evicted_blocks - evicted_before
        report = StepReport(
            step=self._clock,
            num_running=len(self._running),
            num_paused=len(self._paused),
            num_waiting=len(self._waiting),
            num_free_blocks=stats.num_free,
            num_active_blocks=stats.num_active,
            num_paused_blocks=stats.num_paused,
            num_cached_blocks=stats.num_cached,
            **events,
        )
        self._steps.append(report)
        self._clock += 1
        return report

    def report(self) -> SimReport:
        """The totals of every step so far. Complexity: O(steps)."""
        totals = {name: sum(getattr(step, name) for step in self._steps) for name in _SUMMED}
        return SimReport(
            num_steps=len(self._steps),
            num_requests=self._num_requests,
            steps=tuple(self._steps),
            **totals,
        )

    def defragment(self) -> int:
        """Compact the pool's live blocks into the lowest IDs between steps; return the moves.

        The allocator plans and applies the moves (the KV cache's
        ``copy_blocks`` copies K/V; MoE routing moves with its blocks) and the
        block table follows. Running, paused and cached blocks all move; with
        ``verify`` the next prefix hit on a moved block checks its K/V, and in
        model mode the outputs do. DESIGN.md, "Defragmentation".

        Raises:
            ConfigError: the policy has no transactions (see ``apply_defragment``).

        Complexity: O(pool + table size) plus the copy of the moved blocks.
        """
        plan = self.allocator.plan_defragment()
        cache = self.kv_cache
        moved = self.allocator.apply_defragment(
            plan, copy=None if cache is None else cache.copy_blocks
        )
        if moved:
            self.block_table.apply_moves(plan.sources, plan.destinations)
        return moved

    # ------------------------------------------------------------------ requests

    def _new_sequence(self, request: SimRequest) -> _Sequence:
        block_size = self.config.block_size
        num_full = request.input_length // block_size
        if request.prompt_tokens is not None:
            tokens = list(request.prompt_tokens)
            block_hashes = self.allocator.hash_tokens(tokens)
            tail_tokens = tokens[num_full * block_size :]
        else:
            given = request.block_hashes or ()
            if not num_full <= len(given) <= -(-request.input_length // block_size):
                raise InvalidArgumentError(
                    f"request {request.request_id!r}: {len(given)} block hashes for "
                    f"{request.input_length} tokens in blocks of {block_size}"
                )
            block_hashes = list(given[:num_full])
            # Synthetic tokens: a block's depend only on its hash, so equal hashes hold
            # equal tokens. Full blocks need them only when K/V is written.
            num_tail = request.input_length - num_full * block_size
            tail_tokens = [_synthetic_token(given[-1] if given else 0, i) for i in range(num_tail)]
            if self.model is not None:  # synthetic tokens must be in the model's vocabulary
                tail_tokens = [token % self.model.config.vocab_size for token in tail_tokens]
            tokens = []
            if self.kv_cache is not None:
                tokens = [_synthetic_token(h, i) for h in block_hashes for i in range(block_size)]
                if self.model is not None:
                    tokens = [token % self.model.config.vocab_size for token in tokens]
            tokens += tail_tokens
        sequence = _Sequence(
            request,
            block_hashes,
            tail_tokens,
            None,
            num_tokens=request.input_length,
            prompt_length=request.input_length,
        )
        if self.model is None:
            if self.kv_cache is not None:
                sequence.token_hashes = compute_block_hashes(tokens, 1)
        else:
            total = request.input_length + request.output_length
            sequence.tokens = tokens
            sequence.logits = [] if self.config.record_logits else None
            sequence.routing = np.zeros((total, 1, self.model.config.top_k), dtype=np.int64)
        return sequence

    def _arrive(self) -> None:
        if self._arrivals and not (self._waiting or self._running or self._paused):
            self._clock = max(self._clock, self._arrivals[0][0])  # idle: skip to the next arrival
        while self._arrivals and self._arrivals[0][0] <= self._clock:
            self._waiting.append(heapq.heappop(self._arrivals)[2])

    def _admit_waiting(self, events: dict[str, int]) -> None:
        while self._waiting and self.block_table.num_free_slots and self._admit(self._waiting[0]):
            sequence = self._waiting.popleft()
            self._running.append(sequence)
            events["prompt_tokens"] += sequence.prompt_length
            events["prefill_tokens_saved"] += sequence.num_computed

    def _admit(self, sequence: _Sequence) -> bool:
        """Give ``sequence`` its cached prefix and fresh blocks for the rest, or nothing."""
        block_size = self.config.block_size
        # Leave at least one prompt token to compute: its forward pass yields the next token.
        num_matchable = (sequence.prompt_length - 1) // block_size
        hit_ids = self.allocator.match_prefix(sequence.block_hashes[:num_matchable], acquire=True)
        num_blocks = -(-sequence.prompt_length // block_size)
        new_ids = self.allocator.allocate_memory_blocks(num_blocks - len(hit_ids))
        if new_ids is None:
            self.allocator.release_memory_blocks(hit_ids)  # undo the acquire; retry next step
            return False
        if self.config.verify and len(hit_ids):
            self._check_hit(sequence, hit_ids)
        if self.model is not None:
            self._replay_routing(sequence, hit_ids)
        sequence.slot = self.block_table.add_request(torch.cat([hit_ids, new_ids]))
        sequence.num_computed = len(hit_ids) * block_size
        sequence.num_registered = len(hit_ids)
        return True

    def _replay_routing(self, sequence: _Sequence, hit_ids: torch.Tensor) -> None:
        """Copy the stored routing of the prefix-hit tokens into the request's routing."""
        num_tokens = len(hit_ids) * self.config.block_size
        sequence.num_cached = num_tokens
        if not num_tokens:
            return
        routing = self.allocator.reconstruct_routing_from_blocks(hit_ids, num_tokens)
        if routing is None:
            raise InvariantError(
                f"request {sequence.request.request_id!r}: prefix hit on blocks "
                f"{hit_ids.tolist()} whose routing is not all stored"
            )
        assert sequence.routing is not None  # kept in model mode
        sequence.routing[:num_tokens] = routing.numpy()

    def _pause(self, sequence: _Sequence, events: dict[str, int]) -> None:
        self._running.remove(sequence)
        try:
            self.allocator.pause(self.block_table.blocks_of(sequence.slot))
        except BudgetExceededError:
            self._requeue(sequence, paused=False)
            events["num_preemptions"] += 1
            return
        self._paused.append(sequence)
        events["num_pauses"] += 1

    def _resume_paused(self) -> int:
        num_resumed = 0
        for sequence in list(self._paused):
            # Each paused request stopped for want of one block: resume only those that get one.
            if not self.allocator.is_memory_available(num_resumed + 1):
                break
            try:
                self.allocator.resume(self.block_table.blocks_of(sequence.slot))
            except BudgetExceededError:
                break
            self._paused.remove(sequence)
            self._running.append(sequence)
            num_resumed += 1
        return num_resumed

    def _requeue(self, sequence: _Sequence, *, paused: bool) -> None:
        """Release every block of ``sequence`` and queue it to recompute all its tokens."""
        block_ids = self.block_table.remove_request(sequence.slot)
        self.allocator.release_memory_blocks(block_ids, paused=paused)
        sequence.slot = -1
        sequence.prompt_length = sequence.num_tokens
        sequence.num_computed = 0
        sequence.num_registered = 0
        self._waiting.appendleft(sequence)

    def _finish(self) -> int:
        finished = [sequence for sequence in self._running if sequence.is_finished]
        if not finished:
            return 0
        with self.allocator.free_group():
            for sequence in finished:
                self.allocator.release_memory_blocks(self.block_table.remove_request(sequence.slot))
        if self.model is not None:
            self.outputs += [self._output_of(sequence) for sequence in finished]
        self._running = [sequence for sequence in self._running if not sequence.is_finished]
        return len(finished)

    # ------------------------------------------------------------------ tokens

    def _decode(self, events: dict[str, int], writes: list[tuple[_Sequence, int, int]]) -> int:
        """One token for each decoding request; returns how many were decoded."""
        block_size = self.config.block_size
        for sequence in list(self._running):  # finished ones left at the end of the last step
            if sequence.is_prefilling:
                continue
            position = sequence.num_tokens
            if position % block_size == 0:  # the row holds ceil(num_tokens / block_size) blocks
                new_ids = self.allocator.allocate_memory_blocks(1)
                if new_ids is None:
                    self._pause(sequence, events)
                    continue
                self.block_table.append_blocks(sequence.slot, new_ids)
            if self.model is not None:
                token = sequence.next_token  # chosen by the step that computed the last token
            else:
                seed = sequence.block_hashes[-1] if sequence.block_hashes else 0
                token = _synthetic_token(seed, position)
            self._append_token(sequence, token)
            sequence.num_generated += 1
            sequence.num_computed += 1
            writes.append((sequence, position, position + 1))
            events["decode_tokens"] += 1
        return events["decode_tokens"]

    def _append_token(self, sequence: _Sequence, token: int) -> None:
        sequence.tail_tokens.append(token)
        if sequence.tokens is not None:
            sequence.tokens.append(token)
        sequence.num_tokens += 1
        if sequence.token_hashes is not None:
            prefix_hash = sequence.token_hashes[-1]
            sequence.token_hashes += compute_block_hashes([token], 1, parent=prefix_hash)
        if len(sequence.tail_tokens) == self.config.block_size:
            parent = sequence.block_hashes[-1] if sequence.block_hashes else None
            sequence.block_hashes += self.allocator.hash_tokens(sequence.tail_tokens, parent=parent)
            sequence.tail_tokens = []

    def _prefill(
        self, budget: int, events: dict[str, int], writes: list[tuple[_Sequence, int, int]]
    ) -> None:
        for sequence in self._running:
            if budget <= 0:
                break
            if not sequence.is_prefilling:
                continue
            start = sequence.num_computed
            stop = min(sequence.prompt_length, start + budget)
            sequence.num_computed = stop
            writes.append((sequence, start, stop))
            budget -= stop - start
            events["prefill_tokens"] += stop - start

    def _register_computed_blocks(self, sequence: _Sequence) -> None:
        """Register the hashes of the full blocks whose KV is now written."""
        num_full = min(sequence.num_computed // self.config.block_size, len(sequence.block_hashes))
        start = sequence.num_registered
        if num_full <= start:
            return
        if not self.config.enable_prefix_caching:  # nothing would register
            sequence.num_registered = num_full
            return
        parent = sequence.block_hashes[start - 1] if start else None
        # An eviction can deregister the chain above blocks we hold (the allocator drops
        # a pinned subtree when its policy has no leaves; ref_zero drops on release), and
        # parent_hash must be registered. Registering again from the root is idempotent and
        # restores the chain.
        if parent is not None and not self.allocator.is_hash_registered(parent):
            start, parent = 0, None
        block_ids = self.block_table.blocks_of(sequence.slot)[start:num_full]
        self.allocator.register_kv_block_hashes(
            block_ids, sequence.block_hashes[start:num_full], parent_hash=parent
        )
        sequence.num_registered = num_full

    # ------------------------------------------------------------------ the model

    def _run_model(self, writes: list[tuple[_Sequence, int, int]], num_decode: int) -> None:
        """One paged forward over the step's tokens (decodes first), then keep what it chose.

        The forward reads nothing back; the step then copies the chosen tokens and
        the routing to the host once, stores the routing per block, and sets each
        request's next token.
        """
        if not writes:
            return
        assert self.model is not None and self.kv_cache is not None  # model mode builds both
        entries = []
        for sequence, start, stop in writes:
            assert sequence.tokens is not None
            wants_logits = (
                stop == sequence.num_tokens
                and sequence.num_generated < sequence.request.output_length
            )
            entries.append(
                StepEntry(sequence.slot, start, stop, sequence.tokens[start:stop], wants_logits)
            )
        plan = build_paged_batch(
            entries[:num_decode],
            entries[num_decode:],
            self.block_table,
            self.config.block_size,
            self.model.device,
        )
        output = self.model.forward_paged(plan.batch, self.kv_cache)
        next_tokens = output.logits.argmax(dim=-1).cpu().tolist()  # the step's one wait
        routing = output.routing.cpu().numpy()
        self.allocator.store_routing_per_block(routing, plan.block_ids, plan.offsets)
        row = 0
        for sequence, start, stop in writes:
            assert sequence.routing is not None
            sequence.routing[start:stop] = routing[row : row + stop - start]
            row += stop - start
        logits = output.logits.cpu() if self.config.record_logits else None
        for index, entry in enumerate(plan.logit_entries):
            sequence = writes[entry][0]
            sequence.next_token = next_tokens[index]
            if sequence.logits is not None and logits is not None:
                del sequence.logits[sequence.num_generated :]  # recomputed after a requeue
                sequence.logits.append(logits[index])

    def _output_of(self, sequence: _Sequence) -> RequestOutput:
        assert self.model is not None and sequence.tokens is not None
        assert sequence.routing is not None
        prompt_length = sequence.request.input_length
        logits = None
        if sequence.logits is not None:
            vocab_size = self.model.config.vocab_size
            logits = torch.stack(sequence.logits) if sequence.logits else torch.empty(0, vocab_size)
        return RequestOutput(
            request_id=sequence.request.request_id,
            prompt_tokens=tuple(sequence.tokens[:prompt_length]),
            tokens=tuple(sequence.tokens[prompt_length:]),
            routing=sequence.routing[: sequence.num_tokens].copy(),
            logits=logits,
            num_cached_tokens=sequence.num_cached,
        )

    def _check_hit_against_model(self, sequence: _Sequence, hit_ids: torch.Tensor) -> None:
        """Compare the K/V of prefix-hit blocks with the dense forward's, within tolerance."""
        assert self.model is not None and self.kv_cache is not None
        assert sequence.tokens is not None
        num_tokens = len(hit_ids) * self.config.block_size
        dense = self.model.forward_dense(torch.tensor(sequence.tokens[:num_tokens]))
        tolerance = logits_tolerance(self.model.dtype)
        for layer in range(self.kv_cache.num_layers):
            cached_kv = self.kv_cache.gather(layer, hit_ids)
            fresh_kv = (dense.keys[layer], dense.values[layer])
            for name, cached, fresh in zip("KV", cached_kv, fresh_kv, strict=True):
                error = (cached - fresh).abs().reshape(num_tokens, -1).amax(dim=1)
                wrong = error > tolerance
                if wrong.any():
                    self._raise_wrong_hit(sequence, hit_ids, wrong, name, layer)

    def _raise_wrong_hit(
        self, sequence: _Sequence, hit_ids: torch.Tensor, wrong: torch.Tensor, name: str, layer: int
    ) -> None:
        position = int(wrong.nonzero()[0, 0])
        block_id = int(hit_ids[position // self.config.block_size])
        raise InvariantError(
            f"request {sequence.request.request_id!r}: prefix hit on block "
            f"{block_id} serves wrong {name} at token {position} (offset "
            f"{position % self.config.block_size} in the block), layer {layer}"
        )

    def corrupt_block_kv(self, block_id: int, *, seed: int = 0) -> None:
        """Test hook: overwrite ``block_id``'s K and V in every layer with seeded noise.

        For showing that the checks can fail: a later prefix hit on the block
        serves K/V that no forward computed, which ``verify`` reports at the hit
        and :func:`~prefixcache.reference.model_serving.compare_with_reference`
        reports in the outputs. Changes nothing but the cache.

        Raises:
            ConfigError: the loop has no KV cache.
            InvalidArgumentError: ``block_id`` is not a usable block ID.

        Complexity: O(layers * block_size * K/V width).
        """
        cache = self.kv_cache
        if cache is None:
            raise ConfigError("the loop has no KV cache to corrupt")
        block_id = require_int(block_id, "block_id", minimum=0)
        if block_id >= self.allocator.dummy_block_id:
            raise InvalidArgumentError(
                f"block_id {block_id} is not below the dummy block {self.allocator.dummy_block_id}"
            )
        generator = torch.Generator().manual_seed(seed)
        size = cache.block_size
        for layer in range(cache.num_layers):
            k, v = (
                (torch.randn((size, heads, dim), generator=generator) * 10).to(
                    cache.device, cache.dtype
                )
                for heads, dim in (
                    (cache.k_heads, cache.k_head_dim),
                    (cache.v_heads, cache.v_head_dim),
                )
            )
            cache.write(layer, [block_id] * size, list(range(size)), k, v)

    # ------------------------------------------------------------------ K/V

    def _write_kv(self, writes: list[tuple[_Sequence, int, int]]) -> None:
        """Write the reference K/V of every token computed in this step, one call per layer."""
        if self.kv_cache is None or not writes:
            return
        block_size = self.config.block_size
        block_ids, offsets, token_hashes = [], [], []
        for sequence, start, stop in writes:
            assert sequence.token_hashes is not None  # kept whenever there is a KV cache
            positions = np.arange(start, stop)
            table_row = self.block_table.blocks_of(sequence.slot).numpy()
            block_ids.append(table_row[positions // block_size])
            offsets.append(positions % block_size)
            token_hashes.append(sequence.token_hashes[start:stop])
        ids, offs = np.concatenate(block_ids), np.concatenate(offsets)
        hashes = np.fromiter(itertools.chain.from_iterable(token_hashes), dtype=np.uint64)
        for layer in range(self.kv_cache.num_layers):
            k, v = _reference_kv(self.kv_cache, layer, hashes)
            self.kv_cache.write(layer, ids, offs, k, v)

    def _check_hit(self, sequence: _Sequence, hit_ids: torch.Tensor) -> None:
        """Compare the K/V of prefix-hit blocks with freshly computed values."""
        if self.model is not None:
            self._check_hit_against_model(sequence, hit_ids)
            return
        cache = self.kv_cache
        assert cache is not None and sequence.token_hashes is not None  # verify builds both
        num_tokens = len(hit_ids) * self.config.block_size
        hashes = np.array(sequence.token_hashes[:num_tokens], dtype=np.uint64)
        for layer in range(cache.num_layers):
            expected = _reference_kv(cache, layer, hashes)
            for name, cached, fresh in zip(
                "KV", cache.gather(layer, hit_ids), expected, strict=True
            ):
                wrong = (cached != fresh).reshape(num_tokens, -1).any(dim=1)
                if wrong.any():
                    self._raise_wrong_hit(sequence, hit_ids, wrong, name, layer)


def _reference_kv(
    cache: KVCache, layer: int, token_hashes: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of tokens whose prefixes hash to ``token_hashes``, as a model would compute them.

    Each value is 24 bits of the prefix hash times an odd constant per layer,
    head and dimension, so every element differs and float32 holds it exactly.
    """
    k_width = cache.k_heads * cache.k_head_dim
    width = k_width + cache.v_heads * cache.v_head_dim
    multipliers = (np.arange(width, dtype=np.uint64) + np.uint64(1 + layer * width)) * np.uint64(
        0x9E3779B97F4A7C15
    ) | np.uint64(1)
    mixed = token_hashes[:, None] * multipliers[None, :]  # wraps modulo 2**64
    values = torch.from_numpy((mixed >> np.uint64(40)).astype(np.float32) / (1 << 24))
    values = values.to(device=cache.device, dtype=cache.dtype)
    num_tokens = len(token_hashes)
    k = values[:, :k_width].reshape(num_tokens, cache.k_heads, cache.k_head_dim)
    v = values[:, k_width:].reshape(num_tokens, cache.v_heads, cache.v_head_dim)
    return k, v


def run(
    requests: Iterable[SimRequest],
    config: SimConfig | None = None,
    *,
    kv_cache: KVCache | None = None,
    max_steps: int | None = None,
    on_step: Callable[[DynamicBatchingSim, StepReport], None] | None = None,
) -> SimReport:
    """Submit ``requests`` to a fresh :class:`DynamicBatchingSim` and step until all finish.

    Args:
        requests: the workload.
        config: sizes and knobs (default :class:`SimConfig`).
        kv_cache: see :class:`DynamicBatchingSim`.
        max_steps: stop after this many steps even if requests remain.
        on_step: called after every step with the loop and the step's report
            (e.g. to call ``sim.allocator.check_invariants()``).

    Returns:
        The totals of the run.

    Complexity: O(total tokens + steps * requests in flight).
    """
    sim = DynamicBatchingSim(config, kv_cache=kv_cache)
    for request in requests:
        sim.submit(request)
    while not sim.is_done and (max_steps is None or sim.num_steps < max_steps):
        report = sim.step()
        if on_step is not None:
            on_step(sim, report)
    return sim.report()
