"""The drop-in's mirrors: Megatron's tensors and dict, kept in step with the allocator.

The prefixcache allocator is authoritative; ``block_ref_counts``,
``block_hashes``, the LRU tensors and ``kv_hash_to_block_id`` are mirrors
updated after every call (:class:`MirrorMethods`), and the one write Megatron
makes itself, ``block_ref_counts[ids] += k``, is intercepted
(:class:`_LiveRefCounts`) and turned into allocator calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.engine.events import KVEventLog
from prefixcache.errors import InvalidArgumentError, InvariantError


class _LiveRefCounts(torch.Tensor):
    """``block_ref_counts``: an int32 CPU tensor whose subscript writes reach the allocator."""

    # Results of operations are plain tensors, so only this tensor intercepts writes.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    _owner: MirrorMethods

    def __getitem__(self, index: Any) -> torch.Tensor:
        # A copy: ``t[i] += k`` reads t[i], adds in place, then assigns. A view would take
        # the addition into the mirror before __setitem__ saw it (no delta, the allocator
        # never told); with a copy the assignment carries the change.
        return torch.Tensor.__getitem__(self, index).clone()

    def __setitem__(self, index: Any, value: Any) -> None:
        self._owner._write_ref_counts(index, value)


class _WatchedEventLog(KVEventLog):
    """The facade's event log, which also tells the drop-in which hashes lost their block."""

    def __init__(self, log: KVEventLog, on_removed: Callable[[list[int]], None], keep: bool):
        super().__init__(log.capacity, log.block_size, log.medium)
        self._on_removed = on_removed
        self._keep = keep

    def record_stored(self, *args: Any, **kwargs: Any) -> None:
        if self._keep:
            super().record_stored(*args, **kwargs)

    def record_removed(self, block_hashes: list[int]) -> None:
        self._on_removed(block_hashes)
        if self._keep:
            super().record_removed(block_hashes)

    def record_cleared(self) -> None:
        if self._keep:
            super().record_cleared()


class MirrorMethods:
    """The mirror bookkeeping of the drop-in (``MegatronKVBlockAllocator``).

    Mixed into it; the attributes below are set by its constructor.
    """

    allocator: KVBlockAllocator
    total_count: int
    enable_prefix_caching: bool
    on_blocks_deregistered: Callable[[list[int], set[int]], Any] | None
    kv_hash_to_block_id: dict[int, int]
    block_ref_counts: torch.Tensor
    block_hashes: torch.Tensor
    _core: Any
    _is_lru: bool
    _pending_removed: list[int]
    _positions: torch.Tensor
    _ref_counts: torch.Tensor
    _refs: np.ndarray
    _hashes: np.ndarray
    _stamps: np.ndarray
    _parents: np.ndarray
    _children: np.ndarray

    # ------------------------------------------------------------------ mirrors

    def _to_engine(self, block_ids: Any) -> Any:
        """The backing allocator's IDs for Megatron's (the same; compat mode renames)."""
        return block_ids

    def _run(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call the allocator, then drop what it deregistered from the mirrors."""
        try:
            return method(*args, **kwargs)
        finally:
            if self._pending_removed:
                self._deregister(self._pending_removed)
                self._pending_removed = []

    def _drain(self) -> None:
        """Mirror what the native engine deregistered since the last call (fast paths)."""
        removed = self._core.take_changes()[1]
        if removed:
            self._deregister(removed)

    def _removed(self, block_hashes: list[int]) -> None:
        self._pending_removed.extend(block_hashes)

    def _deregister(self, removed: list[int]) -> None:
        """Mirror the allocator's deregistration of ``removed`` hashes, as Megatron orders it."""
        block_ids = [self.kv_hash_to_block_id.pop(h) for h in removed]
        if self.on_blocks_deregistered is not None:
            self.on_blocks_deregistered(list(block_ids), set(removed))
        self._clear_mirrors(np.array(block_ids, dtype=np.int64))

    def _clear_mirrors(self, ids: np.ndarray) -> None:
        """Forget the hashes of ``ids`` in the mirrors (and, under LRU, their tree links)."""
        if self._is_lru:
            parents = self._parents[ids]
            np.subtract.at(self._children, parents[parents >= 0], 1)
            self._parents[ids] = -1
            self._children[ids] = 0
            self._stamps[ids] = 0
        self._hashes[ids] = -1

    def _write_ref_counts(self, index: Any, value: Any) -> None:
        """Apply a caller's ``block_ref_counts[index] = value`` as references taken or dropped."""
        refs = self._refs
        if self._core is not None and self._pinned_by_one(index, value):
            return
        try:
            if (
                isinstance(index, torch.Tensor)
                and index.dim() == 1
                and not index.is_floating_point()
            ):
                touched = np.unique(_as_array(index))  # Megatron's case: a vector of block IDs
            else:
                touched = np.unique(self._positions[index].reshape(-1).numpy())
            before = refs[touched]  # a copy (fancy indexing)
        except (IndexError, TypeError, ValueError, RuntimeError) as exc:
            raise InvalidArgumentError(f"block_ref_counts[{index!r}]: {exc}") from None
        try:
            self._ref_counts[index] = value
        except (IndexError, TypeError, ValueError, RuntimeError, OverflowError) as exc:
            refs[touched] = before
            raise InvalidArgumentError(f"block_ref_counts[...] = {value!r}: {exc}") from None
        delta = refs[touched].astype(np.int64) - before
        # np.repeat: torch.repeat_interleave takes ~15 ms per call on CPU in torch 2.13.
        taken = np.repeat(touched, np.maximum(delta, 0))
        dropped = np.repeat(touched, np.maximum(-delta, 0))
        try:
            if taken.size:
                self._run(self.allocator.acquire_blocks, self._to_engine(taken))
        except Exception:
            refs[touched] = before
            raise
        try:
            if dropped.size:
                self._run(self.allocator.release_memory_blocks, self._to_engine(dropped))
        except Exception:
            refs[touched] = before
            if taken.size:
                self._run(self.allocator.release_memory_blocks, self._to_engine(taken))
            raise

    def _pinned_by_one(self, index: Any, value: Any) -> bool:
        """Apply Megatron's ``refs[ids] += 1`` (or ``-= 1``) on distinct IDs; False if not that.

        The native engine validates the IDs and references before any change,
        so the mirror is written only after it accepted the pin or release.
        """
        if not (
            isinstance(index, torch.Tensor)
            and isinstance(value, torch.Tensor)
            and index.dim() == 1
            and index.is_cpu
            and value.is_cpu
            and value.shape == index.shape
            and not index.is_floating_point()
            and index.dtype != torch.bool
        ):
            return False
        ids, new = _as_array(index), value.numpy()
        if len(ids) == 0 or self._has_duplicates(ids):
            return False
        try:
            delta = new - self._refs[ids]
        except IndexError as exc:  # an ID past the pool (negative ones wrap: the engine refuses)
            raise InvalidArgumentError(f"block_ref_counts[{index!r}]: {exc}") from None
        if (delta == 1).all():
            self._core.acquire(ids)
            self._refs[ids] = new
        elif (delta == -1).all():
            self._core.release_request(ids)
            self._refs[ids] = new
            self._drain()  # ref-zero mode deregisters here; the counts are already down
        else:
            return False
        return True

    @staticmethod
    def _has_duplicates(ids: np.ndarray) -> bool:
        """Whether ``ids`` repeats an ID: a sorted copy, neighbours compared.

        ~3 us for 128 IDs; ``np.unique`` costs ~20 us, and marking a
        pool-sized scratch array costs cache misses at 65,536 blocks.
        """
        ordered = ids.copy()
        ordered.sort()
        return bool((ordered[1:] == ordered[:-1]).any())

    def check_consistency(self) -> None:
        """Raise InvariantError unless every mirror equals the allocator's state.

        For tests and debugging. Complexity: O(total_count).
        """
        self.allocator.check_invariants()
        if not self.enable_prefix_caching:
            return
        ids = np.arange(self.total_count - 1)
        active, paused = self.allocator.reference_counts(ids)
        problems = []
        if not torch.equal(self._ref_counts[:-1], active + paused):
            problems.append("block_ref_counts differ from the allocator's references")
        held = self.kv_hash_to_block_id
        if len(held) != self.allocator.stats().num_registered or not all(
            self.allocator.is_hash_registered(block_hash) for block_hash in held
        ):
            problems.append("kv_hash_to_block_id differs from the allocator's registry")
        hashes = torch.full((self.total_count,), -1, dtype=torch.int64)
        hashes[list(held.values())] = torch.tensor(list(held), dtype=torch.int64)
        if not torch.equal(hashes, self.block_hashes):
            problems.append("block_hashes differ from kv_hash_to_block_id")
        if problems:
            raise InvariantError("; ".join(problems))


def _as_array(block_ids: Any) -> np.ndarray:
    """Block IDs as an intp NumPy array, for indexing the mirrors.

    intp because NumPy converts any other index dtype on every fancy index
    (an int32 index costs ~3 us more per write). A CPU tensor of int64 IDs
    shares its memory.
    """
    if isinstance(block_ids, torch.Tensor):  # integer tensors never require grad
        block_ids = (block_ids if block_ids.is_cpu else block_ids.cpu()).numpy()
    return np.asarray(block_ids).astype(np.intp, copy=False)
