"""HybridBatchingSim: the reference dynamic-batching loop for a hybrid model, checked exactly.

:class:`~prefixcache.reference.sim.DynamicBatchingSim` serves a full-attention model
through one allocator and one block table. This loop serves a
:class:`~prefixcache.reference.toy_hybrid.ToyHybridModel` through its
:class:`~prefixcache.serving.hybrid.HybridMemory`, and so exercises every hybrid piece:

- **prefix hits** restore KV blocks in every layer group *and* the recurrent state
  from a checkpoint; prefill chunks end at checkpoint boundaries so checkpoints are
  taken while requests run;
- **sliding-window groups** give back blocks that fall out of their window mid-run
  (:attr:`HybridStepReport.held_blocks` shows it);
- **forks** (``fork_ranks``: parallel sampling) share every block, the partly filled
  last one included, and copy it on the first write
  (:class:`~prefixcache.serving.shared_tails.SharedTails`);
- **preemption** under memory pressure requeues the newest request, which is
  readmitted later through the prefix cache;
- a **between-steps hook** (:func:`run_hybrid`'s ``between_steps``) for changes to the
  memory in the middle of a run, such as a defragmentation.

Decoding is deterministic: each request takes the token of rank ``sample_rank`` in
its logits (0: greedy). With ``verify`` (the default), every finished request's
outputs at every position it computed are compared with
:meth:`~prefixcache.reference.toy_hybrid.ToyHybridModel.forward_reference`, a run of
the same model with no cache at all, by ``torch.equal``: a wrong block, a state not
restored, a tail written while shared, any of them raises
:class:`~prefixcache.errors.InvariantError`. See DESIGN.md, "Hybrid models".

The loop's requests, outputs and reports are records in ``sim_hybrid_records.py``,
importable from here.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable

import torch

from prefixcache.engine.hashing import compute_block_hashes
from prefixcache.engine.validation import require_flag, require_int
from prefixcache.errors import CapacityError, ConfigError, InvalidArgumentError, InvariantError
from prefixcache.reference.sim_hybrid_records import (
    _SUMMED,
    HybridOutput,
    HybridSimReport,
    HybridSimRequest,
    HybridStepReport,
    _Run,
)
from prefixcache.reference.toy_hybrid import ToyHybridModel

__all__ = [
    "HybridBatchingSim",
    "HybridOutput",
    "HybridSimReport",
    "HybridSimRequest",
    "HybridStepReport",
    "run_hybrid",
]


class HybridBatchingSim:
    """The hybrid reference loop: admit, chunked prefill, decode, fork, finish, verify.

    Call :meth:`submit` for each request, then :meth:`step` until
    :attr:`is_done`; :func:`run_hybrid` does both. Each step admits waiting
    requests (a prefix hit over every group and a checkpointed state), then
    computes decode tokens first and prefill chunks after them under
    ``step_token_budget`` tokens, one
    :meth:`~prefixcache.reference.toy_hybrid.ToyHybridModel.forward_cached` per
    request and chunk. A step in which no request can get its blocks
    requeues the newest running request. Finished requests leave a
    :class:`HybridOutput` in :attr:`outputs`. Not thread-safe.

    Args:
        model: the model; its :attr:`~ToyHybridModel.memory` is the memory served.
        step_token_budget: tokens computed per step, >= 1.
        verify: compare every finished request with the uncached run.

    Raises:
        ConfigError: a bad budget or flag, or not a ToyHybridModel.
    """

    def __init__(
        self, model: ToyHybridModel, *, step_token_budget: int = 64, verify: bool = True
    ) -> None:
        if not isinstance(model, ToyHybridModel):
            raise ConfigError(f"model must be a ToyHybridModel, got {type(model).__name__}")
        self.model = model
        self.memory = model.memory
        self.block_size = self.memory.block_size
        self.step_token_budget = require_int(
            step_token_budget, "step_token_budget", minimum=1, error=ConfigError
        )
        self.verify = require_flag(verify, "verify", error=ConfigError)
        self.outputs: list[HybridOutput] = []
        self._arrivals: list[tuple[int, int, _Run]] = []  # heap by (arrival_step, order)
        self._order = itertools.count()
        self._waiting: deque[_Run] = deque()
        self._running: list[_Run] = []  # admission order
        self._clock = 0
        self._num_requests = 0
        self._steps: list[HybridStepReport] = []

    # ------------------------------------------------------------------ public

    def submit(self, request: HybridSimRequest) -> None:
        """Queue ``request``; it joins the waiting queue at its ``arrival_step``.

        Raises:
            InvalidArgumentError: not a HybridSimRequest, or a token or rank
                outside the vocabulary.
            CapacityError: it could never fit in a table row.

        Complexity: O(prompt tokens).
        """
        if not isinstance(request, HybridSimRequest):
            raise InvalidArgumentError(f"expected a HybridSimRequest, got {request!r}")
        vocab = self.model.vocab_size
        if any(not 0 <= token < vocab for token in request.prompt_tokens):
            raise InvalidArgumentError(
                f"request {request.request_id!r}: a token outside the vocabulary [0, {vocab})"
            )
        if any(rank >= vocab for rank in (request.sample_rank, *request.fork_ranks)):
            raise InvalidArgumentError(f"request {request.request_id!r}: a rank >= {vocab}")
        total = len(request.prompt_tokens) + request.output_length
        row = self.memory.groups.tables[self.memory.groups.specs[0].name].max_blocks_per_request
        if -(-total // self.block_size) > row:
            raise CapacityError(f"request {request.request_id!r} needs more than {row} blocks")
        run = _Run(request, list(request.prompt_tokens), len(request.prompt_tokens))
        heapq.heappush(self._arrivals, (request.arrival_step, next(self._order), run))
        self._num_requests += 1

    @property
    def is_done(self) -> bool:
        """Whether every submitted request (and fork) has finished. O(1)."""
        return not (self._arrivals or self._waiting or self._running)

    @property
    def num_steps(self) -> int:
        """Steps run so far. O(1)."""
        return len(self._steps)

    def step(self) -> HybridStepReport:
        """Admit, compute one budget of tokens, fork, finish and verify.

        Raises:
            InvariantError: with ``verify``, a finished request whose outputs
                differ from the uncached run.
            CapacityError: a lone request cannot get its blocks.

        Complexity: O(tokens computed * context * layers), plus the
        reference forward of each finished request when verifying.
        """
        events = dict.fromkeys(_SUMMED, 0)
        self._arrive()
        self._admit(events)
        progressed = self._compute(events)
        events["num_finished"] = self._finish()
        if not progressed and self._running:
            if len(self._running) == 1:
                run = self._running[0]
                raise CapacityError(
                    f"request {run.request.request_id!r} cannot get its blocks alone"
                )
            self._requeue(self._running.pop())
            events["num_preemptions"] += 1
        report = HybridStepReport(
            step=self._clock,
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            held_blocks=self.memory.groups.num_held_blocks(),
            **events,
        )
        self._steps.append(report)
        self._clock += 1
        return report

    def report(self) -> HybridSimReport:
        """The totals of every step so far. O(steps)."""
        totals = {name: sum(getattr(step, name) for step in self._steps) for name in _SUMMED}
        return HybridSimReport(
            num_steps=len(self._steps),
            num_requests=self._num_requests,
            steps=tuple(self._steps),
            **totals,
        )

    # ------------------------------------------------------------------ admission

    def _arrive(self) -> None:
        if self._arrivals and not (self._waiting or self._running):
            self._clock = max(self._clock, self._arrivals[0][0])  # idle: skip ahead
        while self._arrivals and self._arrivals[0][0] <= self._clock:
            self._waiting.append(heapq.heappop(self._arrivals)[2])

    def _admit(self, events: dict[str, int]) -> None:
        """Admit waiting requests in order while a row, a state slot and prompt blocks remain."""
        groups = self.memory.groups
        while self._waiting:
            run = self._waiting[0]
            per_pool = dict.fromkeys(groups.allocators, 0)
            for spec in groups.specs:
                per_pool[spec.pool_name] += -(-run.prompt_length // self.block_size)
            if self._running and not all(
                groups.allocators[pool].is_memory_available(n) for pool, n in per_pool.items()
            ):
                return  # room for the whole prompt, unless nothing else runs
            # Match on the prompt minus its last token: that token is always computed.
            hashes = self._hashes(run, (run.prompt_length - 1) // self.block_size)
            handle = self.memory.admit(hashes, run.prompt_length)
            if handle is None:
                return
            self._waiting.popleft()
            run.handle = handle
            run.num_hit_tokens += handle.num_hit_tokens
            run.num_restored_states += handle.restored_from is not None
            self._running.append(run)
            events["prompt_tokens"] += run.prompt_length
            events["hit_tokens"] += handle.num_hit_tokens
            events["num_restored_states"] += handle.restored_from is not None

    # ------------------------------------------------------------------ computing

    def _compute(self, events: dict[str, int]) -> bool:
        """Decodes first, then prefill chunks, under the budget; whether any token was computed."""
        budget = self.step_token_budget
        decoding = [run for run in self._running if self._computed(run) >= run.prompt_length]
        prefilling = [run for run in self._running if self._computed(run) < run.prompt_length]
        progressed = False
        for run in decoding + prefilling:
            if budget <= 0:
                break
            handle = run.handle
            assert handle is not None  # running requests are admitted
            start = handle.num_computed_tokens
            stop = min(len(run.tokens), start + budget)
            if start < run.prompt_length:  # end prefill chunks at checkpoint boundaries
                stop = min([stop, *self.memory.chunk_boundaries(handle)])
            if not self.memory.reserve(handle, stop):
                continue
            events["num_copies"] += len(self.memory.last_copies)
            for position, output in enumerate(
                self.model.forward_cached(handle, run.tokens, stop), start
            ):
                run.outputs[position] = output
            saved = self.memory.commit(handle, stop, self._hashes(run, stop // self.block_size))
            events["num_checkpoints_saved"] += saved is not None
            kind = "decode_tokens" if start >= run.prompt_length else "prefill_tokens"
            events[kind] += stop - start
            budget -= stop - start
            progressed = True
            if stop == len(run.tokens):
                if run.request.fork_ranks and not run.forked:
                    self._fork(run, events)
                self._next_token(run, run.request.sample_rank)
        return progressed

    def _fork(self, parent: _Run, events: dict[str, int]) -> None:
        """One fork per ``fork_ranks`` entry, sharing the parent's blocks, tail and state."""
        parent.forked = True
        assert parent.handle is not None
        for rank in parent.request.fork_ranks:
            handle = self.memory.fork(parent.handle)
            if handle is None:
                events["num_forks_refused"] += 1
                continue
            request = HybridSimRequest(
                f"{parent.request.request_id}/{rank}",
                parent.request.prompt_tokens,
                parent.request.output_length,
                arrival_step=self._clock,
                sample_rank=rank,
            )
            last = len(parent.tokens) - 1
            child = _Run(
                request,
                list(parent.tokens),
                parent.prompt_length,
                handle=handle,
                block_hashes=list(parent.block_hashes),
                outputs={last: parent.outputs[last]},
                num_hit_tokens=handle.num_hit_tokens,
            )
            self._next_token(child, rank)
            self._running.append(child)
            self._num_requests += 1
            events["num_forks"] += 1

    def _next_token(self, run: _Run, rank: int) -> None:
        if run.is_finished:
            return
        run.tokens.append(self.model.next_token(run.outputs[len(run.tokens) - 1], rank))
        run.num_generated += 1

    def _hashes(self, run: _Run, num_blocks: int) -> list[int]:
        """Chain hashes of ``run``'s first ``num_blocks`` full blocks, extended as needed."""
        have = len(run.block_hashes)
        if num_blocks > have:
            parent = run.block_hashes[-1] if run.block_hashes else None
            tokens = run.tokens[have * self.block_size : num_blocks * self.block_size]
            run.block_hashes += compute_block_hashes(tokens, self.block_size, parent=parent)
        return run.block_hashes[:num_blocks]

    @staticmethod
    def _computed(run: _Run) -> int:
        assert run.handle is not None
        return run.handle.num_computed_tokens

    # ------------------------------------------------------------------ endings

    def _requeue(self, run: _Run) -> None:
        """Give back everything ``run`` holds; it recomputes its tokens, mostly from the cache."""
        assert run.handle is not None
        self.memory.finish(run.handle)
        run.handle = None
        run.prompt_length = len(run.tokens)
        self._waiting.appendleft(run)

    def _finish(self) -> int:
        finished = [run for run in self._running if run.is_finished]
        for run in finished:
            assert run.handle is not None
            self.memory.finish(run.handle)
            run.handle = None
            output = self._output_of(run)
            if self.verify:
                self._check(run, output)
            self.outputs.append(output)
        self._running = [run for run in self._running if not run.is_finished]
        return len(finished)

    def _output_of(self, run: _Run) -> HybridOutput:
        positions = tuple(sorted(run.outputs))
        prompt_length = len(run.request.prompt_tokens)
        return HybridOutput(
            request_id=run.request.request_id,
            prompt_tokens=run.request.prompt_tokens,
            tokens=tuple(run.tokens[prompt_length:]),
            positions=positions,
            outputs=torch.stack([run.outputs[position] for position in positions]),
            num_hit_tokens=run.num_hit_tokens,
            num_restored_states=run.num_restored_states,
        )

    def _check(self, run: _Run, output: HybridOutput) -> None:
        """Raise InvariantError at the first position whose output differs from the uncached run."""
        reference = self.model.forward_reference(run.tokens[: output.positions[-1] + 1])
        for row, position in enumerate(output.positions):
            if not torch.equal(output.outputs[row], reference[position]):
                raise InvariantError(
                    f"request {run.request.request_id!r}: the output at position {position} "
                    "differs from the uncached run"
                )


def run_hybrid(
    model: ToyHybridModel,
    requests: Iterable[HybridSimRequest],
    *,
    step_token_budget: int = 64,
    verify: bool = True,
    max_steps: int | None = None,
    between_steps: Callable[[HybridBatchingSim, HybridStepReport], None] | None = None,
) -> tuple[HybridSimReport, list[HybridOutput]]:
    """Serve ``requests`` with a fresh :class:`HybridBatchingSim` until all finish.

    Args:
        model: the model and, through it, the memory.
        requests: the workload.
        step_token_budget, verify: see :class:`HybridBatchingSim`.
        max_steps: stop after this many steps even if requests remain.
        between_steps: called after every step with the loop and the step's
            report; the place to change the memory in the middle of a run (a
            defragmentation that moves blocks, a check of invariants) and let
            the verification catch any damage.

    Returns:
        The totals and the outputs of every finished request, in finish order.

    Complexity: as :meth:`HybridBatchingSim.step` per step.
    """
    sim = HybridBatchingSim(model, step_token_budget=step_token_budget, verify=verify)
    for request in requests:
        sim.submit(request)
    while not sim.is_done and (max_steps is None or sim.num_steps < max_steps):
        report = sim.step()
        if between_steps is not None:
            between_steps(sim, report)
    return sim.report(), sim.outputs
