"""The request path: one call to admit a request, one to release it.

Also :meth:`RequestPathMethods.allocate_block_ids`, allocation without a
tensor per call, for schedulers that keep block IDs on the host.

A serving engine calls the block manager for every request of every
scheduling step. :meth:`RequestPathMethods.admit_request` does what a request
needs in one call (hash the prompt's full blocks, find and pin the longest
cached prefix, evict if needed, allocate the rest, register the new full
blocks) and writes the request's block IDs into a row of the caller's block
table; :meth:`RequestPathMethods.release_request` drops them again.

On the native engine, when nothing above the engine must see the calls (no
KV events, no MoE routing, no verification fingerprints), both are the
extension's own functions bound on the allocator: one C call per request, no
tensor created (DESIGN.md, "The native engine"); so is ``allocate_block_ids``.
Otherwise they are composed here from the engine's primitives and the facade's
collaborators, with the same results (``tests/native/test_differential.py``
compares the two).
"""

from __future__ import annotations

import array as array_module
from typing import Any, cast

import numpy as np
import torch

from prefixcache.engine.block_ids import BlockIdsLike
from prefixcache.engine.core import fused_core
from prefixcache.engine.facade_view import FacadeView
from prefixcache.engine.pins import room_beside
from prefixcache.errors import CapacityError, InvalidArgumentError, InvalidTensorError


def _row_array(out_row: Any) -> np.ndarray:
    """``out_row`` as a writable 1-D C-contiguous int32 numpy view of the caller's memory."""
    row = out_row
    if isinstance(row, torch.Tensor):
        if not row.is_cpu:
            raise InvalidTensorError(
                f"out_row must be a CPU tensor (host memory), got device {row.device}"
            )
        row = row.numpy()
    elif isinstance(row, (memoryview, array_module.array)):  # a writable int32 buffer, in place
        if isinstance(row, memoryview) and not row.c_contiguous:
            raise InvalidTensorError("out_row must be a writable C-contiguous int32 array")
        row = np.asarray(row)
    if not isinstance(row, np.ndarray):
        raise InvalidTensorError(f"out_row must be an int32 array, got {type(out_row).__name__}")
    if row.dtype != np.int32 or row.ndim != 1:
        raise InvalidTensorError(
            f"out_row must be a 1-D int32 array, got {row.dtype} of shape {row.shape}"
        )
    if not row.flags.c_contiguous or not row.flags.writeable:
        raise InvalidTensorError("out_row must be a writable C-contiguous int32 array")
    return row


def _event_tokens(allocator: FacadeView, tokens: Any, start: int, stop: int) -> Any:
    """``tokens[start:stop]`` for the KV events of a registration; None when events are off."""
    if allocator.events is None:
        return None
    if isinstance(tokens, torch.Tensor):
        return tokens[start:stop]
    return np.asarray(tokens)[start:stop]


def _num_tokens(tokens: Any) -> int:
    if isinstance(tokens, torch.Tensor):
        return int(tokens.numel())
    return len(tokens)


class RequestPathMethods:
    """Adds :meth:`admit_request` and :meth:`release_request` to the allocator facade."""

    def _bind_request_path(self) -> None:
        """Bind the native fused calls when no collaborator needs to see the request."""
        allocator = cast("FacadeView", self)
        engine = allocator._engine
        core = fused_core(engine)
        if core is None or allocator._track_changes:
            return
        self.allocate_block_ids = core.allocate  # type: ignore[method-assign]
        self.release_request = core.release_request  # type: ignore[method-assign]
        if not allocator.verify_prefix_hits and allocator.enable_prefix_caching:
            self.admit_request = core.admit_request  # type: ignore[method-assign]

    def allocate_block_ids(self, num_blocks: int) -> Any:
        """Hand out ``num_blocks`` fresh blocks as a compact int32 buffer, not a tensor.

        As :meth:`allocate_memory_blocks` (evicting when needed, ``None`` when
        even eviction cannot free enough), for a scheduler that keeps IDs on
        the host: the result supports ``len``, indexing, ``tolist()`` and the
        buffer protocol (``np.frombuffer(ids, np.int32)`` and
        ``torch.frombuffer(ids, dtype=torch.int32)`` wrap it without a copy),
        and every method taking block IDs takes it back. On the native engine
        it is the extension's ``BlockIds``, created without numpy or torch.

        Raises:
            InvalidArgumentError: ``num_blocks`` is not a non-negative int.

        Complexity: O(num_blocks), plus O(log n) per evicted block.
        """
        block_ids = cast("FacadeView", self).allocate_memory_blocks(num_blocks)
        return None if block_ids is None else block_ids.numpy()

    def admit_request(self, tokens: Any, out_row: Any) -> int:
        """Admit one request: pin its cached prefix, allocate the rest, register, fill its row.

        Hashes the full blocks of ``tokens`` (:meth:`hash_tokens`), matches
        and acquires the longest cached prefix of at most
        ``(len(tokens) - 1) // block_size_tokens`` blocks (the last token is
        always computed), allocates the remaining blocks (evicting through the
        policy), registers the new full blocks under their hashes and writes
        the request's ``ceil(len(tokens) / block_size_tokens)`` block IDs,
        cached prefix first, into ``out_row``. Equivalent to ``match_prefix(...,
        acquire=True)``, ``allocate_memory_blocks``, ``register_kv_block_hashes``.

        Args:
            tokens: the prompt's token IDs (1-D integer array, CPU tensor or list).
            out_row: a writable 1-D C-contiguous int32 array or CPU tensor (a
                row of a block table), at least as long as the request's blocks.

        Returns:
            How many leading blocks came from the cache.

        Raises:
            InvalidArgumentError, InvalidTensorError: malformed tokens or row.
            CapacityError: the pool cannot hold the request even after
                eviction; nothing changes (``out_row`` included).

        Complexity: O(len(tokens)) hashing, O(1) per block, plus O(log n) per
        evicted block.
        """
        allocator = cast("FacadeView", self)
        hashes = allocator.hash_tokens(tokens)
        row = _row_array(out_row)
        num_tokens = _num_tokens(tokens)
        size = allocator.block_size_tokens
        num_blocks = -(-num_tokens // size)
        num_matchable = (num_tokens - 1) // size if num_tokens else 0
        if len(row) < num_blocks:
            raise InvalidArgumentError(
                f"out_row holds {len(row)} IDs; the request needs {num_blocks}"
            )
        checks = allocator.fingerprint_tokens(tokens) if allocator.verify_prefix_hits else None
        engine = allocator._engine
        hit = np.empty(0, dtype=np.int32)
        num_rejected = allocator._num_rejected
        if allocator.enable_prefix_caching:
            hit = engine.lookup(hashes[:num_matchable])
            if checks is not None:
                hit = allocator._verified_prefix(hit, checks[:num_matchable])
        num_hit = len(hit)
        needed = num_blocks - num_hit
        active, paused = engine.reference_counts(hit.astype(np.intp))
        cached_hits = len(np.unique(hit[(active + paused) == 0]))
        room = room_beside(engine, needed, hit, cached_hits)
        if needed > room:
            allocator._num_rejected = num_rejected
            if allocator._yield_hints(needed, hit):  # withdrew scheduler hints: room now
                return self.admit_request(tokens, out_row)
            raise CapacityError(f"request needs {needed} blocks; {room} can be freed")
        if allocator.enable_prefix_caching:
            engine.take_hit(hit, num_matchable, acquire=True)
        new_ids = allocator.allocate_memory_blocks(needed)
        assert new_ids is not None  # the capacity check above guarantees room
        new = new_ids.numpy()
        num_full = len(hashes)
        if num_full > num_hit:
            allocator.register_kv_block_hashes(
                new[: num_full - num_hit],
                hashes[num_hit:num_full],
                parent_hash=hashes[num_hit - 1] if num_hit else None,
                # Routers (llm-d, NVIDIA Dynamo) key their index by these tokens.
                token_ids=_event_tokens(allocator, tokens, num_hit * size, num_full * size),
                fingerprints=None if checks is None else checks[num_hit:num_full],
            )
        row[:num_hit] = hit
        row[num_hit:num_blocks] = new
        return num_hit

    def release_request(self, block_ids: BlockIdsLike) -> None:
        """Drop the request's reference on each of its blocks (``release_memory_blocks``).

        Raises:
            InvalidTensorError, InvalidBlockIdError: malformed IDs.
            ReferenceCountError: a block holds fewer references than released.

        Complexity: O(k), plus O(log n) policy work per newly cached leaf.
        """
        cast("FacadeView", self).release_memory_blocks(block_ids)
