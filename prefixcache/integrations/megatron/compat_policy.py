"""Megatron-core 0.19's eviction order as a prefixcache policy, for the drop-in's compat mode.

Megatron's ``evict_lru_blocks`` peels the cached forest from its leaves with
a min-heap keyed by ``(block_timestamps[b], b)``: its *own* timestamps (the
context's ``prefix_cache_lru_clock``, shared by every block touched in a
step) and its *own* block IDs break the ties. The engine's eviction planner
already asks for victims one at a time and inserts an exposed parent before
the next pick, which is Megatron's peel; this policy supplies the key.
It reads the key through a callable, because the compat drop-in renames
blocks (the engine's IDs are not Megatron's) and owns the timestamp mirror.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from prefixcache.policies.base import EvictionPolicy

_Key = tuple[int, int, int]  # (Megatron timestamp, Megatron block ID, engine block ID)


class MegatronOrderPolicy(EvictionPolicy):
    """Evicts the leaf with the smallest ``(Megatron timestamp, Megatron ID)``.

    A heap with lazy deletion, as :class:`prefixcache.policies.LRUPolicy`;
    every change is recorded with its inverse for transactions.

    Args:
        megatron_key: ``engine block ID -> (timestamp, Megatron block ID)``,
            read when a leaf is inserted or touched.

    Complexity: ``insert``, ``touch`` O(log n); ``discard`` O(1);
    ``evict(k)`` O(k log n) amortised. Not thread-safe.
    """

    def __init__(self, megatron_key: Callable[[int], tuple[int, int]]) -> None:
        self._megatron_key = megatron_key
        self._heap: list[_Key] = []
        self._key_of: dict[int, _Key] = {}

    def _track(self, block_id: int) -> _Key:
        stamp, megatron_id = self._megatron_key(block_id)
        key = self._key_of[block_id] = (stamp, megatron_id, block_id)
        heapq.heappush(self._heap, key)
        return key

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        self._track(block_id)
        self.record_undo(self._forget, block_id)

    def discard(self, block_id: int) -> None:
        key = self._key_of.pop(block_id)
        self.record_undo(self._put_back, key)

    def touch(self, block_id: int, now: int) -> None:
        old = self._key_of[block_id]
        self._track(block_id)
        self.record_undo(self._put_back, old)

    def evict(self, num_blocks: int) -> list[int]:
        heap, key_of = self._heap, self._key_of
        victims: list[int] = []
        while heap and len(victims) < num_blocks:
            key = heapq.heappop(heap)
            if key_of.get(key[2]) == key:
                del key_of[key[2]]
                victims.append(key[2])
                self.record_undo(self._put_back, key)
        if len(heap) > 2 * len(key_of) + 64:
            self._heap = list(key_of.values())
            heapq.heapify(self._heap)
        return victims

    def _forget(self, block_id: int) -> None:
        del self._key_of[block_id]

    def _put_back(self, key: _Key) -> None:
        self._key_of[key[2]] = key
        heapq.heappush(self._heap, key)

    def clear(self) -> None:
        self._heap.clear()
        self._key_of.clear()
        self._txn_undo = None

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._key_of
