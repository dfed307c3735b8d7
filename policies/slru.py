"""Segmented LRU over the cached leaves: one-hit blocks go before reused ones."""

from __future__ import annotations

from prefixcache.policies.base import EvictionPolicy
from sortedcontainers import SortedList


class SLRUPolicy(EvictionPolicy):
    """Two LRU segments: probation for blocks used once, protected for reused ones.

    A block enters probation when it was handed out once (``num_accesses``
    of 1: computed for one request and never hit) and protected when it was
    hit or touched since allocation. Victims come from probation, least
    recently used first, so a stream of one-off prompts cannot flush the
    reused prefixes (the scan resistance of SLRU and 2Q). Protected may hold
    at most ``protected_fraction`` of the tracked leaves; while it holds
    more, or when probation is empty, the victim is protected's least
    recently used block instead.

    A touch counts as a reuse: it moves a probation block to protected.

    Transactions: each change is recorded with the key and segment it
    replaced, so an abort puts a block back where it was.

    >>> policy = SLRUPolicy(protected_fraction=0.5)
    >>> policy.insert(1, block_hash=10, last_access=1, num_accesses=3, depth=0)
    >>> policy.insert(2, block_hash=20, last_access=2, num_accesses=1, depth=0)
    >>> policy.insert(3, block_hash=30, last_access=3, num_accesses=1, depth=0)
    >>> policy.evict(2)  # one-hit blocks first, though block 1 is older
    [2, 3]

    Args:
        protected_fraction: share of the tracked leaves the protected segment
            may hold before it gives up victims itself, in ``[0, 1]``.

    Raises:
        ValueError: ``protected_fraction`` is outside ``[0, 1]``.

    Complexity: ``insert``, ``discard`` and ``touch`` O(log n); ``evict(k)``
    O(k log n). Not thread-safe.
    """

    def __init__(self, protected_fraction: float = 0.8) -> None:
        if isinstance(protected_fraction, bool) or not (
            isinstance(protected_fraction, (int, float)) and 0 <= protected_fraction <= 1
        ):
            raise ValueError(f"protected_fraction must lie in [0, 1], got {protected_fraction!r}")
        self._protected_fraction = float(protected_fraction)
        # (last access, block ID) per segment: the smallest is that segment's LRU block.
        self._probation: SortedList = SortedList()
        self._protected: SortedList = SortedList()
        self._key_of: dict[int, tuple[int, int]] = {}
        self._is_protected: dict[int, bool] = {}

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        """Track ``block_id`` in probation if used once, else protected. Complexity: O(log n)."""
        self._place(block_id, (last_access, block_id), num_accesses > 1)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._remove, block_id))

    def _place(self, block_id: int, key: tuple[int, int], protected: bool) -> None:
        self._key_of[block_id] = key
        self._is_protected[block_id] = protected
        (self._protected if protected else self._probation).add(key)

    def discard(self, block_id: int) -> None:
        """Stop tracking ``block_id``. Raises KeyError if untracked. Complexity: O(log n)."""
        key, protected = self._remove(block_id)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._place, block_id, key, protected))

    def _remove(self, block_id: int) -> tuple[tuple[int, int], bool]:
        """Untrack ``block_id``; return its key and segment."""
        key = self._key_of.pop(block_id)
        protected = self._is_protected.pop(block_id)
        (self._protected if protected else self._probation).remove(key)
        return key, protected

    def _replace(self, block_id: int, key: tuple[int, int], protected: bool) -> None:
        """Move the tracked ``block_id`` back to ``key`` in its old segment (undoes a touch)."""
        self._remove(block_id)
        self._place(block_id, key, protected)

    def touch(self, block_id: int, now: int) -> None:
        """Record a reuse: the block moves to protected at ``now``. Complexity: O(log n)."""
        key, protected = self._remove(block_id)
        self._place(block_id, (now, block_id), True)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._replace, block_id, key, protected))

    def evict(self, num_blocks: int) -> list[int]:
        """Remove up to ``num_blocks`` leaves, probation first. Complexity: O(k log n)."""
        victims: list[int] = []
        undo = self._txn_undo
        while len(victims) < num_blocks and self._key_of:
            over_share = len(self._protected) > self._protected_fraction * len(self._key_of)
            segment = self._protected if over_share or not self._probation else self._probation
            key = segment.pop(0)
            block_id = key[1]
            del self._key_of[block_id]
            protected = self._is_protected.pop(block_id)
            victims.append(block_id)
            if undo is not None:
                undo.append((self._place, block_id, key, protected))
        return victims

    def clear(self) -> None:
        """Forget every tracked leaf. Complexity: O(n)."""
        self._probation.clear()
        self._protected.clear()
        self._key_of.clear()
        self._is_protected.clear()
        self._txn_undo = None

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._key_of
