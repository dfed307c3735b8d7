"""First-in, first-out eviction over the cached leaves."""

from __future__ import annotations

from prefixcache.policies.base import EvictionPolicy
from sortedcontainers import SortedList


class FIFOPolicy(EvictionPolicy):
    """Evicts the leaf that entered the cache first; touches do not reorder.

    A block enters the cache when its last reference is released; its place
    in the queue is the clock of its last hand-out (``last_access`` at
    :meth:`insert`), ties to the lower block ID. Unlike LRU, :meth:`touch`
    leaves the place unchanged. A prefix hit takes the block out of the cache
    (the allocator discards it) and its release re-enters it at the back, so
    under the allocator's protocol FIFO and LRU differ only in touches; FIFO
    is here as the cheapest baseline (SGLang offers it too).

    A parent exposed by evicting its child keeps the place of its own last
    hand-out, which is never later than its child's, so a chain leaves the
    queue from its end rather than being re-queued at the back.

    Transactions: an insert is undone by dropping its key, a removal by
    queueing the removed key again; a touch changes nothing.

    >>> policy = FIFOPolicy()
    >>> policy.insert(7, block_hash=70, last_access=1, num_accesses=1, depth=0)
    >>> policy.insert(8, block_hash=80, last_access=2, num_accesses=1, depth=0)
    >>> policy.touch(7, now=3)
    >>> policy.evict(1)
    [7]

    Complexity: ``insert`` and ``discard`` O(log n), ``touch`` O(1),
    ``evict(k)`` O(k log n). Not thread-safe.
    """

    def __init__(self) -> None:
        self._order: SortedList = SortedList()  # (entry clock, block ID), first out first
        self._key_of: dict[int, tuple[int, int]] = {}

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        """Queue ``block_id`` at its last hand-out. Complexity: O(log n)."""
        key = (last_access, block_id)
        self._key_of[block_id] = key
        self._order.add(key)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._unqueue, block_id))

    def discard(self, block_id: int) -> None:
        """Stop tracking ``block_id``. Raises KeyError if untracked. Complexity: O(log n)."""
        self._unqueue(block_id)

    def _unqueue(self, block_id: int) -> None:
        key = self._key_of.pop(block_id)
        self._order.remove(key)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._queue, key))

    def _queue(self, key: tuple[int, int]) -> None:
        """Track ``key``'s block at ``key`` again (the inverse of a removal)."""
        self._key_of[key[1]] = key
        self._order.add(key)

    def touch(self, block_id: int, now: int) -> None:
        """Nothing moves in a FIFO. Raises KeyError if untracked. Complexity: O(1)."""
        if block_id not in self._key_of:
            raise KeyError(block_id)

    def evict(self, num_blocks: int) -> list[int]:
        """Remove and return up to ``num_blocks`` leaves, first in first. Complexity: O(k log n)."""
        victims: list[int] = []
        undo = self._txn_undo
        while len(victims) < num_blocks and self._order:
            key = self._order.pop(0)
            block_id = key[1]
            del self._key_of[block_id]
            victims.append(block_id)
            if undo is not None:
                undo.append((self._queue, key))
        return victims

    def evicts_first(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> bool:
        """Whether a leaf queued now at ``last_access`` would leave first. Complexity: O(1)."""
        return not self._order or (last_access, block_id) < self._order[0]

    def clear(self) -> None:
        """Forget every tracked leaf. Complexity: O(n)."""
        self._order.clear()
        self._key_of.clear()
        self._txn_undo = None

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._key_of
