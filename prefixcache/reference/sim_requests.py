"""What the reference loop takes in, and the progress it keeps per request.

:class:`SimRequest` (a prompt as tokens or as trace block hashes, and an output
length) and :class:`SimConfig` (the loop's sizes and knobs) are the loop's
inputs; ``_Sequence`` is one request's progress, owned and changed only by the
loop (:mod:`prefixcache.reference.sim`). Kept apart from the loop so the
scheduler reads as scheduling; the synthetic tokens of trace prompts and of
generated text are defined here, beside the requests that carry them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from prefixcache.engine.config import PolicySpec
from prefixcache.engine.validation import require_flag, require_int
from prefixcache.errors import ConfigError, InvalidArgumentError
from prefixcache.reference.trace import trace_block_hashes

VOCAB_SIZE = 1 << 15
"""Synthetic tokens (trace prompts, generated tokens) lie in ``[0, VOCAB_SIZE)``."""

_MASK64 = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # odd: multiplying by it permutes 64-bit values


def _synthetic_token(seed: int, index: int) -> int:
    """A token that depends only on ``seed`` (a hash of the prefix) and ``index``.

    The top 15 bits of a multiplicative hash: cheap, and every bit of the seed counts.
    """
    return (((seed ^ index) * _MIX) & _MASK64) >> 49


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
        ends_conversation: the last turn of a conversation its client ends
            (a trace's mark); with ``SimConfig.conversation_ends`` the loop
            calls ``allocator.end_conversation`` once it finishes.

    Raises:
        InvalidArgumentError: both or neither prompt form, a bad length, or
            an ``ends_conversation`` that is not a bool.
    """

    request_id: int | str
    output_length: int
    prompt_tokens: tuple[int, ...] | None = None
    block_hashes: tuple[int, ...] | None = None
    input_length: int = 0
    arrival_step: int = 0
    ends_conversation: bool = False

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
        ends = require_flag(self.ends_conversation, "ends_conversation")
        object.__setattr__(self, "ends_conversation", ends)

    @classmethod
    def from_tokens(
        cls,
        request_id: int | str,
        tokens: Iterable[int],
        output_length: int,
        *,
        arrival_step: int = 0,
        ends_conversation: bool = False,
    ) -> SimRequest:
        """A request whose prompt is ``tokens``; the loop hashes them with the allocator.

        Complexity: O(len(tokens)).
        """
        return cls(
            request_id,
            output_length,
            prompt_tokens=tuple(tokens),
            arrival_step=arrival_step,
            ends_conversation=ends_conversation,
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
        ends_conversation: bool = False,
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
            ends_conversation: the trace marks it its conversation's last turn.

        Complexity: O(len(hash_ids)).
        """
        return cls(
            request_id,
            output_length,
            block_hashes=tuple(trace_block_hashes(hash_ids)),
            input_length=input_length,
            arrival_step=arrival_step,
            ends_conversation=ends_conversation,
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
        queue_hints: protect the cached prefix of each waiting request while it
            waits (``allocator.hint_upcoming`` on arrival and requeue,
            ``withdraw_hint`` once admitted; DESIGN.md, "Scheduler hints").
        engine: the allocator's engine (``"auto"``, ``"native"``, ``"python"``).
        conversation_ends: when a request marked ``ends_conversation`` finishes,
            call ``allocator.end_conversation`` with its block hashes (prompt and
            generated blocks), freeing its chain's cached tail (DESIGN.md,
            "Scheduler hints").
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
    queue_hints: bool = False
    engine: str = "auto"
    conversation_ends: bool = False

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
        flags = ("verify", "enable_prefix_caching", "record_logits", "queue_hints")
        for name in (*flags, "conversation_ends"):
            flag = require_flag(getattr(self, name), name, error=ConfigError)
            object.__setattr__(self, name, flag)


# ---------------------------------------------------------------------- progress


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
    order: int = -1  # submission order: the key of its scheduler hint
    hinted: bool = False  # holds a scheduler hint (queue_hints, while waiting)
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
