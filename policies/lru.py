"""Least-recently-used eviction over the cached leaves."""

from __future__ import annotations

import heapq

from prefixcache.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
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

    Transactions: every change is recorded with its inverse (forget a key,
    or put an old key back); a key put back is pushed again, so the heap
    may hold it twice, which lazy deletion already tolerates.

    Complexity: ``insert``, ``touch`` O(log n); ``discard`` O(1) amortised;
    ``evict(k)`` O(k log n) amortised; ``evicts_first`` O(1) amortised. Not
    thread-safe.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int]] = []  # (last_access, block_id), some stale
        self._key_of: dict[int, tuple[int, int]] = {}  # the live key of each tracked leaf

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        key = (last_access, block_id)
        self._key_of[block_id] = key
        heapq.heappush(self._heap, key)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._forget, block_id))

    def discard(self, block_id: int) -> None:
        key = self._key_of.pop(block_id)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._put_back, key))
        self._compact_if_stale()

    def touch(self, block_id: int, now: int) -> None:
        old = self._key_of[block_id]
        key = self._key_of[block_id] = (now, block_id)
        heapq.heappush(self._heap, key)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._put_back, old))
        self._compact_if_stale()

    def evict(self, num_blocks: int) -> list[int]:
        heap, key_of, undo = self._heap, self._key_of, self._txn_undo
        victims: list[int] = []
        while heap and len(victims) < num_blocks:
            key = heapq.heappop(heap)
            block_id = key[1]
            if key_of.get(block_id) == key:
                del key_of[block_id]
                victims.append(block_id)
                if undo is not None:
                    undo.append((self._put_back, key))
        return victims

    def _forget(self, block_id: int) -> None:
        """Stop tracking ``block_id`` (the inverse of an insert); its heap entry goes stale."""
        del self._key_of[block_id]

    def _put_back(self, key: tuple[int, int]) -> None:
        """Track ``key``'s block at ``key`` again (the inverse of a removal or a touch)."""
        self._key_of[key[1]] = key
        heapq.heappush(self._heap, key)

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
        self._txn_undo = None

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
