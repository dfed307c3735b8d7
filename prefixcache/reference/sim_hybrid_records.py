"""The records of the hybrid loop: its requests, what they produce, what it reports.

:class:`HybridSimRequest` (a prompt, an output length, forks), :class:`HybridOutput`
(what a finished request produced, compared with the uncached run),
:class:`HybridStepReport` and :class:`HybridSimReport` (per step and summed), and
``_Run``, a request's progress, changed only by the loop
(:class:`~prefixcache.reference.sim_hybrid.HybridBatchingSim`). Apart from the loop so
it reads as scheduling; every public name is importable from
:mod:`prefixcache.reference.sim_hybrid`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prefixcache.engine.validation import is_int, require_int
from prefixcache.errors import InvalidArgumentError
from prefixcache.serving.hybrid import HybridRequest


@dataclass(frozen=True)
class HybridSimRequest:
    """One request of the hybrid loop.

    Attributes:
        request_id: a name for reports and errors (a fork is named
            ``f"{request_id}/{rank}"``).
        prompt_tokens: the prompt, token IDs in the model's vocabulary.
        output_length: tokens to generate, >= 1.
        arrival_step: the loop step at which it arrives, >= 0.
        sample_rank: each generated token is the one ranked this by the logits.
        fork_ranks: when the prompt is prefilled, fork one request per rank
            here; each shares the request's blocks and state and samples that
            rank.

    Raises:
        InvalidArgumentError: an empty prompt, a non-int token, or a bad count.
    """

    request_id: int | str
    prompt_tokens: tuple[int, ...]
    output_length: int
    arrival_step: int = 0
    sample_rank: int = 0
    fork_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        tokens = tuple(self.prompt_tokens)
        if not tokens or not all(map(is_int, tokens)):
            raise InvalidArgumentError(
                f"request {self.request_id!r}: prompt_tokens must be a non-empty sequence of ints"
            )
        object.__setattr__(self, "prompt_tokens", tuple(int(token) for token in tokens))
        for name, minimum in (("output_length", 1), ("arrival_step", 0), ("sample_rank", 0)):
            object.__setattr__(self, name, require_int(getattr(self, name), name, minimum=minimum))
        ranks = tuple(require_int(rank, "fork_ranks", minimum=0) for rank in self.fork_ranks)
        object.__setattr__(self, "fork_ranks", ranks)


@dataclass(frozen=True)
class HybridOutput:
    """What a finished request produced.

    Attributes:
        request_id: its name.
        prompt_tokens, tokens: the prompt and the generated tokens.
        positions: the positions this request computed (over all its
            admissions), ascending; the others came from the cache or its parent.
        outputs: ``[len(positions), hidden]``, the model's output at each.
        num_hit_tokens: prompt tokens served without computing, summed over
            admissions (a fork counts what it shared with its parent).
        num_restored_states: admissions whose state came from a checkpoint.
    """

    request_id: int | str
    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    outputs: torch.Tensor
    num_hit_tokens: int
    num_restored_states: int


@dataclass(frozen=True)
class HybridStepReport:
    """What one :meth:`HybridBatchingSim.step` did; ``held_blocks`` is after the step."""

    step: int
    num_running: int
    num_waiting: int
    held_blocks: dict[str, int]
    num_finished: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    num_restored_states: int = 0
    num_checkpoints_saved: int = 0
    num_forks: int = 0
    num_forks_refused: int = 0
    num_copies: int = 0
    num_preemptions: int = 0


_SUMMED = (
    "num_finished",
    "prompt_tokens",
    "hit_tokens",
    "prefill_tokens",
    "decode_tokens",
    "num_restored_states",
    "num_checkpoints_saved",
    "num_forks",
    "num_forks_refused",
    "num_copies",
    "num_preemptions",
)


@dataclass(frozen=True)
class HybridSimReport:
    """Totals of a run: each summed field of every :class:`HybridStepReport`."""

    num_steps: int
    num_requests: int
    num_finished: int
    prompt_tokens: int
    hit_tokens: int
    prefill_tokens: int
    decode_tokens: int
    num_restored_states: int
    num_checkpoints_saved: int
    num_forks: int
    num_forks_refused: int
    num_copies: int
    num_preemptions: int
    steps: tuple[HybridStepReport, ...] = field(default=(), repr=False)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache over prompt tokens admitted (0.0 if none)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True, eq=False)
class _Run:
    """A request's progress; changed only by the loop."""

    request: HybridSimRequest
    tokens: list[int]
    prompt_length: int  # tokens to prefill at this admission (all tokens, once requeued)
    handle: HybridRequest | None = None
    block_hashes: list[int] = field(default_factory=list)  # of the full blocks hashed so far
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> output
    num_generated: int = 0
    num_hit_tokens: int = 0
    num_restored_states: int = 0
    forked: bool = False

    @property
    def is_finished(self) -> bool:
        return self.num_generated == self.request.output_length
