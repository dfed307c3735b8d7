"""Least-recently-used eviction over the cached leaves."""

from __future__ import annotations

import heapq


class LRUPolicy:
    """Evicts the leaf with the oldest last access; ties go to the lower block ID.

    Leaves are ordered by ``(last_access, block_id)`` keys, so a leaf that
    becomes evictable long after its last access (a parent exposed by
    evicting its child) still takes its place by age rather than by insertion
    order. The keys live in a binary heap (``heapq``, implemented in C) with
    lazy deletion: discarding or touching a leaf only forgets its current key
    in ``_key_of``, and stale heap entries are skipped when popped. The heap
    is rebuilt when stale entries outnumber live ones, so memory stays O(n)
    and every operation amortised O(log n). Heap operations run in C, which
    makes an evict-and-insert cycle about a quarter cheaper than with a
    ``SortedList`` (per-event costs: ``benchmarks/bench_policies.py``).

    Complexity: ``insert``, ``touch`` O(log n); ``discard`` O(1) amortised;
    ``evict(k)`` O(k log n) amortised; ``evicts_first`` O(1) amortised. Not
    thread-safe.
    """

    retains_unreferenced = True

    def __init__(self) -> None:
        self._heap: list[tuple[int, int]] = []  # (last_access, block_id), some stale
        self._key_of: dict[int, tuple[int, int]] = {}  # the live key of each tracked leaf

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        key = (last_access, block_id)
        self._key_of[block_id] = key
        heapq.heappush(self._heap, key)

    def discard(self, block_id: int) -> None:
        del self._key_of[block_id]
        self._compact_if_stale()

    def touch(self, block_id: int, now: int) -> None:
        if block_id not in self._key_of:
            raise KeyError(block_id)
        self.insert(block_id, 0, now, 0, 0)
        self._compact_if_stale()

    def evict(self, num_blocks: int) -> list[int]:
        heap, key_of = self._heap, self._key_of
        victims: list[int] = []
        while heap and len(victims) < num_blocks:
            key = heapq.heappop(heap)
            block_id = key[1]
            if key_of.get(block_id) == key:
                del key_of[block_id]
                victims.append(block_id)
        return victims

    def evicts_first(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> bool:
        """Whether a leaf inserted now with ``last_access`` would be the next victim.

        Drops stale entries from the top of the heap (invisible: they are
        skipped by :meth:`evict` anyway). Complexity: O(1) amortised.
        """
        heap, key_of = self._heap, self._key_of
        while heap and key_of.get(heap[0][1]) != heap[0]:
            heapq.heappop(heap)
        return not heap or (last_access, block_id) < heap[0]

    def clear(self) -> None:
        self._heap.clear()
        self._key_of.clear()

    def eviction_order(self) -> list[int]:
        """Tracked leaves, next victim first (for tests and debugging). O(n log n)."""
        return [block_id for _, block_id in sorted(self._key_of.values())]

    def _compact_if_stale(self) -> None:
        if len(self._heap) > 2 * len(self._key_of) + 64:
            self._heap = list(self._key_of.values())
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._key_of
