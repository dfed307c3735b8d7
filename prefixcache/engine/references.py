"""ReferenceTable: per-block reference counts and access history, and free-group queues."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from prefixcache.errors import ReferenceCountError

_SMALL_BATCH = 256  # below this a Python set finds duplicates faster than a sort


def count_occurrences(block_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Distinct IDs and how often each occurs; counts are None when all are distinct.

    The common batch has no duplicates, and every caller has a cheaper path
    for "one each" than for an array of ones.
    """
    size = len(block_ids)
    if size < 2:
        return block_ids, None
    if size <= _SMALL_BATCH:
        if len(set(block_ids.tolist())) == size:
            return block_ids, None
    else:
        ordered = np.sort(block_ids)
        if not np.count_nonzero(ordered[1:] == ordered[:-1]):
            return block_ids, None
    unique, counts = np.unique(block_ids, return_counts=True)
    return unique, counts.astype(np.int32)


class ReferenceTable:
    """Per-block host state indexed by block ID, changed only by the Python engine.

    ``active`` and ``paused`` count the references of running and of paused
    requests. Of registered blocks, ``last_access`` is the clock of the
    registration or last hit/touch and ``num_accesses`` the hand-outs since
    registration (stale on unregistered blocks: allocation skips them).
    ``pending`` counts the active releases queued by open free groups; the
    arrays keep their identity for the engine's lifetime (``clear`` zeroes
    them in place), so the eviction planner may hold them.

    Args:
        size: number of blocks, the dummy included.
    """

    def __init__(self, size: int) -> None:
        self.active = np.zeros(size, dtype=np.int32)
        self.paused = np.zeros(size, dtype=np.int32)
        self.last_access = np.zeros(size, dtype=np.int64)
        self.num_accesses = np.zeros(size, dtype=np.int64)  # a hot prefix passes 2**31
        self.pending = np.zeros(size, dtype=np.int32)
        # Chain pins (engine/pins.py): pins on each tail, the pinned chains' ancestors (an
        # upper bound on the cached blocks they keep), and per block the stamp and the
        # accesses its pins (or its evicted descendants') still owe its ancestors.
        self.pins = np.zeros(size, dtype=np.int32)
        self.pin_bound = 0
        self.pin_stamp = np.zeros(size, dtype=np.int64)
        self.pin_pending = np.zeros(size, dtype=np.int64)
        self._pending_chunks: list[np.ndarray] = []
        self.group_depth = 0

    def is_unreferenced(self, block_ids: np.ndarray) -> np.ndarray:
        """Mask of the blocks that no request, running or paused, holds."""
        unreferenced: np.ndarray = (self.active[block_ids] + self.paused[block_ids]) == 0
        return unreferenced

    def check_can_drop(
        self,
        unique: np.ndarray,
        counts: np.ndarray | None,
        held: np.ndarray,
        partition: str,
        describe: Callable[[int], str],
    ) -> None:
        """Refuse to drop more references than ``held`` (the counts of ``unique``).

        Raises:
            ReferenceCountError: naming the first short block, its state and the counts.
        """
        short = held == 0 if counts is None else held < counts
        if np.count_nonzero(short):
            position = int(np.flatnonzero(short)[0])
            block_id = int(unique[position])
            asked = 1 if counts is None else int(counts[position])
            raise ReferenceCountError(
                f"block {block_id} ({describe(block_id)}) holds "
                f"{int(held[position])} {partition} reference(s); asked to drop {asked}"
            )

    def queue_release(self, block_ids: np.ndarray, describe: Callable[[int], str]) -> None:
        """Validate an active release inside a free group and queue it.

        Raises:
            ReferenceCountError: the release exceeds the references not yet queued.
        """
        unique, counts = count_occurrences(block_ids)
        available = self.active[unique] - self.pending[unique]
        self.check_can_drop(unique, counts, available, "active (after queued releases)", describe)
        self.pending[unique] += 1 if counts is None else counts
        self._pending_chunks.append(unique.copy())  # the caller may reuse its array

    def take_queued(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The queued releases as (distinct IDs, counts), now dequeued; None if none."""
        if not self._pending_chunks:
            return None
        touched = np.unique(np.concatenate(self._pending_chunks))
        counts = self.pending[touched].copy()
        self.pending[touched] = 0
        self._pending_chunks.clear()
        return touched, counts

    def clear(self) -> None:
        """Zero every count in place and drop queued releases."""
        for array in (
            self.active,
            self.paused,
            self.last_access,
            self.num_accesses,
            self.pending,
            self.pins,
            self.pin_stamp,
            self.pin_pending,
        ):
            array[:] = 0
        self.pin_bound = 0
        self._pending_chunks.clear()


MAX_REFERENCES = 2**31 - 1
"""Most references one block may hold in a partition (counts are int32 in both engines)."""


def check_headroom(
    unique: np.ndarray, held: np.ndarray, delta: int | np.ndarray, partition: str
) -> None:
    """Refuse references that would push a count past :data:`MAX_REFERENCES` (never wrap).

    Raises:
        ReferenceCountError: the first such block, before anything changes.
    """
    after = held.astype(np.int64) + delta
    over = after > MAX_REFERENCES
    if over.any():
        at = int(np.argmax(over))
        asked = int(np.broadcast_to(np.asarray(delta, dtype=np.int64), over.shape)[at])
        raise ReferenceCountError(
            f"block {int(unique[at])} holds {int(held[at])} {partition} reference(s); "
            f"{asked} more would pass the limit of 2**31 - 1"
        )
