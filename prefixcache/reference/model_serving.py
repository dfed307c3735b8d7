"""What the serving loop needs around :class:`~prefixcache.reference.model.TinyDecoder`.

- :class:`PagedBatch` is the layout of one step that the paged forward reads;
  :func:`build_paged_batch` builds it from a step's work (which tokens of which
  request slot to compute): block IDs and offsets from the
  :class:`~prefixcache.serving.block_table.BlockTable`'s host copy for the
  writes, the table's device rows for the reads.
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
from typing import TYPE_CHECKING

import numpy as np
import torch

from prefixcache.engine.validation import require_int
from prefixcache.errors import InvalidArgumentError
from prefixcache.serving.block_table import BlockTable

if TYPE_CHECKING:  # the model imports the batch layout from here
    from prefixcache.reference.model import TinyDecoder

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


@dataclass(frozen=True)
class PrefillChunk:
    """One request's prefill chunk inside a :class:`PagedBatch`.

    Attributes:
        start, stop: its tokens are rows ``[start, stop)`` of the batch.
        block_ids: ``[num_blocks]`` integer tensor on the model's device: the
            request's blocks covering positions ``0 .. last position`` (a
            block-table row prefix).
    """

    start: int
    stop: int
    block_ids: torch.Tensor


@dataclass(frozen=True)
class PagedBatch:
    """The layout of one serving step: decode tokens first, then prefill chunks.

    Every tensor lives on the model's device; the ints are host metadata from
    the scheduler, so nothing here is read back from the device.

    Attributes:
        token_ids: ``[T]`` int64 tokens to compute.
        positions: ``[T]`` int64 position of each token in its request.
        write_block_ids, write_offsets: ``[T]`` int64 block and in-block offset
            where each token's K/V goes.
        num_decode: the first ``num_decode`` rows are decode tokens, one per request.
        decode_block_ids: ``[num_decode, max_blocks]`` integer block-table rows of
            the decoding requests (padding points at the dummy block).
        decode_context_lengths: ``[num_decode]`` int64 tokens each decoding
            request attends over (its position + 1).
        prefills: the prefill chunks, in row order after the decode rows.
        logit_rows: ``[R]`` int64 rows whose next-token logits are wanted.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    write_block_ids: torch.Tensor
    write_offsets: torch.Tensor
    num_decode: int
    decode_block_ids: torch.Tensor | None
    decode_context_lengths: torch.Tensor | None
    prefills: tuple[PrefillChunk, ...]
    logit_rows: torch.Tensor


@dataclass(frozen=True, slots=True)
class StepEntry:
    """Tokens ``[start, stop)`` of the request in block-table row ``slot``, to compute now.

    Attributes:
        slot: the request's block-table row; it holds blocks for positions up to ``stop - 1``.
        start, stop: positions to compute, ``0 <= start < stop``.
        token_ids: the tokens at those positions.
        wants_logits: whether the next-token logits of position ``stop - 1`` are needed.
    """

    slot: int
    start: int
    stop: int
    token_ids: Sequence[int]
    wants_logits: bool


@dataclass(frozen=True)
class StepPlan:
    """A :class:`PagedBatch` and the host copies of where each token's K/V goes.

    Attributes:
        batch: the device-side layout.
        block_ids, offsets: ``[T]`` int64 numpy arrays, the host copy of
            ``batch.write_block_ids`` and ``batch.write_offsets`` (for storing
            per-token data such as routing without reading the device).
        logit_entries: for each logits row, the index of its entry.
    """

    batch: PagedBatch
    block_ids: np.ndarray
    offsets: np.ndarray
    logit_entries: tuple[int, ...]


def build_paged_batch(
    decode: Sequence[StepEntry],
    prefill: Sequence[StepEntry],
    block_table: BlockTable,
    block_size: int,
    device: torch.device,
) -> StepPlan:
    """Lay out one step: decode entries (one token each) first, then prefill chunks.

    Args:
        decode: one entry per decoding request, each of one token.
        prefill: prefill chunks, at most one per request.
        block_table: the table holding every entry's slot; its host copy gives
            the write targets, its :attr:`~BlockTable.device_table` the rows read.
        block_size: tokens per block.
        device: the model's device (the table's device).

    Returns:
        The plan; entries are numbered decode first, then prefill.

    Raises:
        InvalidArgumentError: an empty step, a decode entry of more than one
            token, token counts that do not match the positions, a slot with
            no request or with too few blocks for its positions.

    Complexity: O(tokens + blocks of the entries), a few host-to-device copies.
    """
    entries = [*decode, *prefill]
    if not entries:
        raise InvalidArgumentError("a step needs at least one entry")
    if any(entry.stop - entry.start != 1 for entry in decode):
        raise InvalidArgumentError("a decode entry computes exactly one token")
    tokens, positions, block_ids, logit_rows, logit_entries = [], [], [], [], []
    row = 0
    for index, entry in enumerate(entries):
        if not 0 <= entry.start < entry.stop or len(entry.token_ids) != entry.stop - entry.start:
            raise InvalidArgumentError(
                f"entry for slot {entry.slot}: positions [{entry.start}, {entry.stop}) "
                f"but {len(entry.token_ids)} tokens"
            )
        row_ids = block_table.blocks_of(entry.slot).numpy()
        if entry.stop > len(row_ids) * block_size:
            raise InvalidArgumentError(
                f"slot {entry.slot} holds {len(row_ids)} blocks of {block_size} tokens; "
                f"position {entry.stop - 1} needs more"
            )
        span = np.arange(entry.start, entry.stop, dtype=np.int64)
        tokens.append(np.asarray(entry.token_ids, dtype=np.int64))
        positions.append(span)
        block_ids.append(row_ids[span // block_size])
        row += entry.stop - entry.start
        if entry.wants_logits:
            logit_rows.append(row - 1)
            logit_entries.append(index)
    host_positions = np.concatenate(positions)
    host_block_ids = np.concatenate(block_ids).astype(np.int64)
    host_offsets = host_positions % block_size

    def upload(values: np.ndarray | list[int]) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values, dtype=np.int64)).to(device)

    table = block_table.device_table
    decode_block_ids = decode_lengths = None
    if decode:
        lengths = [entry.stop for entry in decode]
        num_blocks = -(-max(lengths) // block_size)
        decode_block_ids = table[upload([entry.slot for entry in decode]), :num_blocks]
        decode_lengths = upload(lengths)
    chunks, start = [], len(decode)
    for entry in prefill:
        stop = start + entry.stop - entry.start
        chunks.append(PrefillChunk(start, stop, table[entry.slot, : -(-entry.stop // block_size)]))
        start = stop
    batch = PagedBatch(
        token_ids=upload(np.concatenate(tokens)),
        positions=upload(host_positions),
        write_block_ids=upload(host_block_ids),
        write_offsets=upload(host_offsets),
        num_decode=len(decode),
        decode_block_ids=decode_block_ids,
        decode_context_lengths=decode_lengths,
        prefills=tuple(chunks),
        logit_rows=upload(logit_rows),
    )
    return StepPlan(batch, host_block_ids, host_offsets, tuple(logit_entries))


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
