"""The layout of one paged serving step, shared by the model and the loop that feeds it.

:class:`PagedBatch` is what :meth:`~prefixcache.reference.model.TinyDecoder.forward_paged`
reads: decode tokens first, then prefill chunks (:class:`PrefillChunk`), with block IDs
and offsets from the :class:`~prefixcache.serving.block_table.BlockTable`'s host copy for
the writes and the table's device rows for the reads. :func:`build_paged_batch` builds it
(and a :class:`StepPlan` with its host copies) from a step's work, one
:class:`StepEntry` per request. It sits below both
:mod:`~prefixcache.reference.model` and :mod:`~prefixcache.reference.model_serving`, so
neither imports the other for it; the names are importable from ``model_serving`` too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from prefixcache.errors import InvalidArgumentError
from prefixcache.serving.block_table import BlockTable


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
