"""What the serving loop needs around :class:`~prefixcache.reference.model.TinyDecoder`.

- :class:`PagedBatch` is the layout of one step that the paged forward reads;
  :func:`build_paged_batch` builds it from a step's work (which tokens of which
  request slot to compute). Both live in :mod:`~prefixcache.reference.paged_batch`,
  below the model and this module, and are importable from here.
- :class:`RequestOutput` is what a served request produced.
- :func:`reference_output` decodes a prompt greedily with the dense forward, no
  cache and no batching; :func:`compare_with_reference` and
  :func:`compare_outputs` are the identity check: same tokens, same routing,
  logits within :func:`logits_tolerance`.

See DESIGN.md, "Serving a model".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from prefixcache.engine.validation import require_int
from prefixcache.reference.model import TinyDecoder
from prefixcache.reference.paged_batch import (
    PagedBatch,
    PrefillChunk,
    StepEntry,
    StepPlan,
    build_paged_batch,
)

__all__ = [
    "PagedBatch",
    "PrefillChunk",
    "ReferenceOutput",
    "RequestOutput",
    "StepEntry",
    "StepPlan",
    "build_paged_batch",
    "compare_outputs",
    "compare_with_reference",
    "logits_tolerance",
    "reference_output",
]

_TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.05}


def logits_tolerance(dtype: torch.dtype) -> float:
    """Largest absolute logit difference the identity check accepts for ``dtype``.

    The paged and dense forwards reduce in different shapes (a step's batch, a
    padded gather), so they agree to rounding, not bit for bit: measured at
    about 1e-14 in float64 and 1e-6 in float32 on logits of order 1 (see
    ``tests/reference/test_model_serving.py``); the bounds leave a wide margin.

    Complexity: O(1).
    """
    return _TOLERANCES.get(dtype, 0.05)


# ---------------------------------------------------------------------- outputs and the check


@dataclass(frozen=True)
class RequestOutput:
    """What a request served by the loop's model mode produced.

    Attributes:
        request_id: the request's name.
        prompt_tokens: its prompt (for trace requests, the synthetic tokens).
        tokens: the generated tokens, greedy.
        routing: ``[prompt + generated, 1, top_k]`` int64 experts of every
            token: replayed from the per-block store for tokens served from the
            cache, computed for the rest.
        logits: ``[generated, vocab]`` CPU logits each token was chosen from,
            or None unless the loop records them.
        num_cached_tokens: prompt tokens served from the cache at its last admission.
    """

    request_id: int | str
    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]
    routing: np.ndarray
    logits: torch.Tensor | None
    num_cached_tokens: int


@dataclass(frozen=True)
class ReferenceOutput:
    """What :func:`reference_output` computes: tokens, their logits, and every token's routing."""

    tokens: tuple[int, ...]
    logits: torch.Tensor
    routing: np.ndarray


def reference_output(model: TinyDecoder, prompt: Sequence[int], num_tokens: int) -> ReferenceOutput:
    """Decode ``prompt`` greedily with the dense forward over the whole sequence at each step.

    The reference a served request must reproduce: no cache, no batching, no paging.

    Args:
        model: the model.
        prompt: token IDs, at least one.
        num_tokens: tokens to generate, >= 0.

    Raises:
        InvalidArgumentError: an empty or out-of-vocabulary prompt, a bad ``num_tokens``.

    Complexity: O(num_tokens) dense forwards of up to ``len(prompt) + num_tokens`` tokens.
    """
    num_tokens = require_int(num_tokens, "num_tokens", minimum=0)
    sequence = torch.tensor(list(prompt), dtype=torch.int64, device=model.device)
    rows = []
    for _ in range(num_tokens):
        row = model.forward_dense(sequence).logits[-1]
        rows.append(row)
        sequence = torch.cat([sequence, row.argmax()[None]])
    routing = model.forward_dense(sequence).routing.cpu().numpy()
    logits = torch.stack(rows).cpu() if rows else torch.empty(0, model.config.vocab_size)
    generated = sequence[len(sequence) - num_tokens :].tolist()
    return ReferenceOutput(tuple(generated), logits, routing)


def compare_with_reference(
    model: TinyDecoder,
    outputs: Iterable[RequestOutput],
    *,
    atol: float | None = None,
    cache: dict[tuple[tuple[int, ...], int], ReferenceOutput] | None = None,
) -> list[str]:
    """The identity check: each served request against the dense greedy reference.

    Tokens and routing must be equal; logits (when recorded) within ``atol``.

    Args:
        model: the model that served them.
        outputs: the served requests.
        atol: logits tolerance (default :func:`logits_tolerance` of the model's dtype).
        cache: reference outputs by ``(prompt, num_tokens)``, filled as computed
            (pass one dict to several calls on the same prompts).

    Returns:
        One line per disagreement; empty when every request matches.

    Complexity: one :func:`reference_output` per distinct prompt and length.
    """
    atol = logits_tolerance(model.dtype) if atol is None else atol
    cache = {} if cache is None else cache
    problems = []
    for output in outputs:
        key = (output.prompt_tokens, len(output.tokens))
        if key not in cache:
            cache[key] = reference_output(model, output.prompt_tokens, len(output.tokens))
        expected = cache[key]
        problems += _differences(output, expected.tokens, expected.logits, expected.routing, atol)
    return problems


def compare_outputs(
    first: Iterable[RequestOutput], second: Iterable[RequestOutput], *, atol: float
) -> list[str]:
    """Two runs of the same requests (say prefix caching on and off) against each other.

    Returns:
        One line per disagreement, a request missing from either run included.

    Complexity: O(total tokens + logits).
    """
    by_id = {output.request_id: output for output in second}
    problems = []
    for output in first:
        other = by_id.pop(output.request_id, None)
        if other is None:
            problems.append(f"request {output.request_id!r}: missing from the second run")
            continue
        problems += _differences(output, other.tokens, other.logits, other.routing, atol)
    problems += [f"request {name!r}: missing from the first run" for name in by_id]
    return problems


def _differences(
    output: RequestOutput,
    tokens: tuple[int, ...],
    logits: torch.Tensor | None,
    routing: np.ndarray,
    atol: float,
) -> list[str]:
    name = f"request {output.request_id!r}"
    problems = []
    if output.tokens != tokens:
        index = next(
            (i for i, (a, b) in enumerate(zip(output.tokens, tokens, strict=False)) if a != b),
            min(len(output.tokens), len(tokens)),
        )
        problems.append(
            f"{name}: generated token {index} differs ({list(output.tokens[index : index + 1])} "
            f"vs {list(tokens[index : index + 1])})"
        )
    if output.logits is not None and logits is not None:
        if output.logits.shape != logits.shape:
            problems.append(
                f"{name}: logits of shape {tuple(output.logits.shape)} vs {tuple(logits.shape)}"
            )
        else:
            error = (output.logits.double() - logits.double()).abs()
            if error.numel() and float(error.max()) > atol:
                row = int(error.max(dim=1).values.argmax())
                problems.append(
                    f"{name}: logits of generated token {row} differ by {float(error.max()):.3g} "
                    f"> {atol:g}"
                )
    if output.routing.shape != routing.shape or not np.array_equal(output.routing, routing):
        if output.routing.shape != routing.shape:
            problems.append(f"{name}: routing of shape {output.routing.shape} vs {routing.shape}")
        else:
            token = int(np.flatnonzero((output.routing != routing).any(axis=(1, 2)))[0])
            problems.append(f"{name}: routed experts of token {token} differ")
    return problems
