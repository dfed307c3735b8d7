"""Belady's offline optimum over the cached leaves, for trace replay only."""

from __future__ import annotations

from collections.abc import Callable

from prefixcache.policies.base import EvictionPolicy
from sortedcontainers import SortedList


class BeladyPolicy(EvictionPolicy):
    """Evicts the leaf whose next use lies furthest in the future.

    The ceiling that online policies are measured against: it needs the
    future, so only a replay of a known trace can run it (``prefixcache
    compare`` reports every policy as a fraction of it). The future comes
    through ``next_use``, a callable that maps a block ID to the index of the
    next request that will use the block (any number larger than every
    request index for "never"); the replay that owns the trace supplies it,
    so this class stays ignorant of the allocator.

    ``next_use`` is asked once when a block becomes a tracked leaf and again
    when it is touched. The answer must not change while the block stays
    cached and untouched, which holds in a replay: the next request that uses
    a cached block hits it, and the hit makes it active (the allocator
    discards it from the policy) before it would change.

    Order: furthest next use first; on a tie (typically two blocks never used
    again) the deeper block of a chain first, so a chain is eaten from its
    end as the model of the traces README does, then the higher block ID.
    Because a chain's blocks are used together, a parent is never used later
    than its child, so this leaf-only order equals Belady's order over every
    cached block, provided victims are taken one at a time (``evict(k)``
    ranks only the current leaves, not the parents its victims expose).

    >>> future = {3: 10, 4: 7, 5: 10}
    >>> policy = BeladyPolicy(future.__getitem__)
    >>> policy.insert(3, block_hash=1003, last_access=1, num_accesses=1, depth=0)
    >>> policy.insert(4, block_hash=1004, last_access=1, num_accesses=1, depth=5)
    >>> policy.insert(5, block_hash=1005, last_access=1, num_accesses=1, depth=2)
    >>> policy.evict(2)
    [5, 3]

    Args:
        next_use: block ID -> index of its next use (larger = later).

    Transactions: a key is removed or put back as an undo of each change;
    ``next_use`` is not asked again on abort.

    Complexity: ``insert``, ``discard`` and ``touch`` O(log n) plus one
    ``next_use`` call; ``evict(k)`` O(k log n). Not thread-safe.
    """

    def __init__(self, next_use: Callable[[int], int]) -> None:
        if not callable(next_use):
            raise TypeError(f"next_use must be callable, got {next_use!r}")
        self._next_use = next_use
        # Keys (next use, depth, block ID): the largest is the next victim.
        self._order: SortedList = SortedList()
        self._key_of: dict[int, tuple[int, int, int]] = {}

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        """Track ``block_id`` by its next use and its depth. O(log n)."""
        key = (self._next_use(block_id), depth, block_id)
        self._put(key)
        self.record_undo(self._remove, block_id)

    def _put(self, key: tuple[int, int, int]) -> None:
        self._key_of[key[2]] = key
        self._order.add(key)

    def _remove(self, block_id: int) -> tuple[int, int, int]:
        key = self._key_of.pop(block_id)
        self._order.remove(key)
        return key

    def discard(self, block_id: int) -> None:
        """Stop tracking ``block_id``. O(log n)."""
        self.record_undo(self._put, self._remove(block_id))

    def touch(self, block_id: int, now: int) -> None:
        """A touch is a use, so ask ``next_use`` again and re-rank. O(log n)."""
        _, depth, _ = old = self._key_of[block_id]
        key = (self._next_use(block_id), depth, block_id)
        self._remove(block_id)
        self._put(key)
        self.record_undo(self._retouch, key, old)

    def _retouch(self, key: tuple[int, int, int], old: tuple[int, int, int]) -> None:
        self._remove(key[2])
        self._put(old)

    def evict(self, num_blocks: int) -> list[int]:
        """Remove and return up to ``num_blocks`` leaves, furthest next use first. O(k log n)."""
        if num_blocks <= 0:
            return []
        start = max(0, len(self._order) - num_blocks)
        victims = self._order[start:]
        del self._order[start:]
        key_of = self._key_of
        for key in victims:
            del key_of[key[2]]
            self.record_undo(self._put, key)
        return [block_id for _, _, block_id in reversed(victims)]

    def clear(self) -> None:
        """Forget every tracked leaf. O(n)."""
        self._order.clear()
        self._key_of.clear()
        self._txn_undo = None

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._key_of
