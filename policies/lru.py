"""Least-recently-used eviction over the cached leaves."""

from __future__ import annotations

from sortedcontainers import SortedList


class LRUPolicy:
    """Evicts the leaf with the oldest last access; ties go to the lower block ID.

    The leaves are kept in a ``SortedList`` of ``(last_access, block_id)``
    keys, so a leaf that becomes evictable long after its last access (a
    parent exposed by evicting its child) still takes its place by age rather
    than by insertion order.

    Complexity: ``insert``, ``discard`` and ``touch`` O(log n); ``evict(k)``
    O(k log n). Not thread-safe.
    """

    retains_unreferenced = True

    def __init__(self) -> None:
        self._order: SortedList = SortedList()
        self._key_of: dict[int, tuple[int, int]] = {}

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        key = (last_access, block_id)
        self._key_of[block_id] = key
        self._order.add(key)

    def discard(self, block_id: int) -> None:
        self._order.remove(self._key_of.pop(block_id))

    def touch(self, block_id: int, now: int) -> None:
        self._order.remove(self._key_of[block_id])
        key = (now, block_id)
        self._key_of[block_id] = key
        self._order.add(key)

    def evict(self, num_blocks: int) -> list[int]:
        if num_blocks == 1 and self._order:  # the allocator's common call
            _, block_id = self._order.pop(0)
            del self._key_of[block_id]
            return [block_id]
        victims = self._order[:num_blocks]
        del self._order[:num_blocks]
        key_of = self._key_of
        for _, block_id in victims:
            del key_of[block_id]
        return [block_id for _, block_id in victims]

    def clear(self) -> None:
        self._order.clear()
        self._key_of.clear()

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._key_of
