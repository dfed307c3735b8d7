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

The loop is this module and four parts under it: its inputs and per-request progress
(``sim_requests.py``), its step and run reports (``sim_report.py``), the queues a request
moves through (``sim_queues.py``) and the model step with the hit checks
(``sim_checks.py``); every public name is importable from here.

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
from collections.abc import Callable, Iterable

import torch

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.engine.config import AllocatorConfig
from prefixcache.engine.hashing import compute_block_hashes
from prefixcache.engine.pool import resolve_device
from prefixcache.errors import CapacityError, ConfigError, InvalidArgumentError
from prefixcache.reference.model import TinyDecoder
from prefixcache.reference.model_serving import RequestOutput
from prefixcache.reference.sim_queues import _RequestQueues
from prefixcache.reference.sim_report import _SUMMED, SimReport, StepReport
from prefixcache.reference.sim_requests import (
    VOCAB_SIZE,
    SimConfig,
    SimRequest,
    _Sequence,
    _synthetic_token,
)
from prefixcache.serving.block_table import BlockTable
from prefixcache.serving.kv_cache import KVCache

__all__ = [
    "VOCAB_SIZE",
    "DynamicBatchingSim",
    "SimConfig",
    "SimReport",
    "SimRequest",
    "StepReport",
    "run",
]


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


# ---------------------------------------------------------------------- the loop


class DynamicBatchingSim(_RequestQueues):
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
                engine=config.engine,
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
        self._awaiting: dict[int, list[_Sequence]] = {}  # queue hints waiting on a hash
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
        sequence.order = next(self._order)
        heapq.heappush(self._arrivals, (request.arrival_step, sequence.order, sequence))
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
        registered = sequence.block_hashes[start:num_full]
        self.allocator.register_kv_block_hashes(block_ids, registered, parent_hash=parent)
        sequence.num_registered = num_full
        if self._awaiting:
            self._extend_hints(registered)


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
