"""Where a prefix-aware router learns which worker holds which prefix.

:class:`OverlapIndex` is the interface; :class:`PrefixIndex` is the
in-process one, fed only by the KV cache events the workers record, as a
real router's index would be. NVIDIA Dynamo's indexer is the other
implementation (:class:`~prefixcache.cluster.dynamo.DynamoPrefixIndex`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from prefixcache.engine.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    wire_hash,
)

__all__ = ["OverlapIndex", "PrefixIndex"]


class OverlapIndex(Protocol):
    """Where a prefix-aware router learns which worker holds which prefix."""

    def apply(self, worker: int, events: Sequence[KVCacheEvent]) -> None:
        """Fold worker ``worker``'s events into the index."""
        ...

    def overlaps(self, block_hashes: Sequence[int], num_workers: int) -> list[int]:
        """Per worker, how many leading ``block_hashes`` it holds."""
        ...


class PrefixIndex:
    """In-process index of resident hashes per worker, fed only by KV cache events.

    Keeps, per wire hash, the set of workers holding it. The overlap of a
    query with a worker is the number of leading hashes the worker holds, the
    quantity Dynamo's indexer reports. Not thread-safe.

    >>> index = PrefixIndex()
    >>> index.apply(0, [BlockStored((1, 2), None, (), 4)])
    >>> index.apply(1, [BlockStored((1,), None, (), 4)])
    >>> index.overlaps([1, 2, 3], num_workers=3)
    [2, 1, 0]
    """

    def __init__(self) -> None:
        self._workers_of: dict[int, set[int]] = {}
        self._hashes_of: dict[int, set[int]] = {}

    def apply(self, worker: int, events: Sequence[KVCacheEvent]) -> None:
        """Fold events into the index.

        Complexity: O(hashes in the events).
        """
        held = self._hashes_of.setdefault(worker, set())
        for event in events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    self._workers_of.setdefault(block_hash, set()).add(worker)
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._forget(worker, block_hash)
                held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                for block_hash in held:
                    self._forget(worker, block_hash)
                held.clear()

    def _forget(self, worker: int, block_hash: int) -> None:
        workers = self._workers_of.get(block_hash)
        if workers is not None:
            workers.discard(worker)
            if not workers:
                del self._workers_of[block_hash]

    def overlaps(self, block_hashes: Sequence[int], num_workers: int) -> list[int]:
        """Per worker, how many leading ``block_hashes`` it holds.

        Complexity: O(length of the longest overlap).
        """
        result = [0] * num_workers
        alive = set(range(num_workers))
        for depth, block_hash in enumerate(block_hashes):
            holders = self._workers_of.get(wire_hash(block_hash), set())
            for worker in alive - holders:
                result[worker] = depth
            alive &= holders
            if not alive:
                return result
        for worker in alive:
            result[worker] = len(block_hashes)
        return result

    def num_hashes(self, worker: int) -> int:
        """Hashes the index believes ``worker`` holds. O(1)."""
        return len(self._hashes_of.get(worker, ()))
