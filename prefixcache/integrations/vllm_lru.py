"""The vLLM plugin's fast path for ``policy="lru"``: the same order, fewer Python calls.

:class:`~prefixcache.integrations.vllm_queue.PolicyFreeBlockQueue` asks its policy object for
every victim and hands it a hash, a use count and a depth on every insert. LRU reads none
of those: it orders the free cached leaves by ``(last_access, block_id)``, where
``last_access`` is the queue's own free-order clock. :class:`LruFreeBlockQueue` keeps
that order itself, in a binary heap (``heapq``, in C) with lazy deletion, and inlines
victim selection and parent exposure into :meth:`LruFreeBlockQueue.popleft_n`; no
hashing, no policy calls. The order is :class:`prefixcache.policies.LRUPolicy`'s exactly
(``tests/integrations/test_vllm_plugin.py`` replays the two side by side), so ``"lru"``
still reproduces vLLM's own order. :func:`~prefixcache.integrations.vllm.install` picks
this queue whenever the policy it is given builds a plain ``LRUPolicy``.
"""

from __future__ import annotations

from collections.abc import Iterable
from heapq import heapify, heappop, heappush
from typing import Any

from prefixcache.errors import InvariantError
from prefixcache.integrations.vllm_queue import PolicyFreeBlockQueue
from prefixcache.integrations.vllm_queue_views import _HINTED, _INNER, _LEAF
from prefixcache.policies import EvictionPolicy

__all__ = ["LeafHeap", "LruFreeBlockQueue"]


class LeafHeap(EvictionPolicy):
    """LRU over the free leaves, ``(last_access, block_id)`` keys, as the queue's state.

    ``heap`` holds keys, some stale; ``live`` maps each tracked leaf to its current
    ``last_access``; an entry is live when ``live`` still holds its key. The heap is
    rebuilt (in place: :class:`LruFreeBlockQueue` holds references to both) when stale
    entries outnumber live ones. No transactions (the queue opens none).

    Complexity: ``insert``/``touch`` O(log n); ``discard`` O(1) amortised; ``evict(k)``
    O(k log n) amortised. Not thread-safe.
    """

    def __init__(self) -> None:
        self.heap: list[tuple[int, int]] = []
        self.live: dict[int, int] = {}

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        self.live[block_id] = last_access
        heappush(self.heap, (last_access, block_id))

    def discard(self, block_id: int) -> None:
        del self.live[block_id]
        self.compact_if_stale()

    def touch(self, block_id: int, now: int) -> None:
        if block_id not in self.live:
            raise KeyError(block_id)
        self.insert(block_id, 0, now, 1, 0)

    def evict(self, num_blocks: int) -> list[int]:
        heap, live = self.heap, self.live
        victims: list[int] = []
        while heap and len(victims) < num_blocks:
            last_access, block_id = heappop(heap)
            if live.get(block_id) == last_access:
                del live[block_id]
                victims.append(block_id)
        return victims

    def clear(self) -> None:
        self.heap.clear()
        self.live.clear()

    def compact_if_stale(self) -> None:
        """Drop stale heap entries once they outnumber live ones. O(n) then, else O(1)."""
        if len(self.heap) > 2 * len(self.live) + 64:
            self.heap[:] = [(stamp, block_id) for block_id, stamp in self.live.items()]
            heapify(self.heap)

    def __len__(self) -> int:
        return len(self.live)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self.live


class LruFreeBlockQueue(PolicyFreeBlockQueue):
    """:class:`PolicyFreeBlockQueue` under LRU, with the leaf order kept inline.

    Same interface, same sections and the same hand-out order as the base class with
    an ``LRUPolicy``; ``policy`` is the :class:`LeafHeap` it updates directly.
    Per evicted block: one ``heappop`` (plus one ``heappush`` when it exposes its
    parent) and a few dict operations, in one loop. Not thread-safe.
    """

    def __init__(self, blocks: Iterable[Any]) -> None:
        self._leaves = LeafHeap()
        super().__init__(blocks, self._leaves)

    def popleft_n(self, n: int) -> list[Any]:
        """Hand out ``n`` blocks: hash-less first, then the oldest free leaf each time
        (then inner blocks, then hinted ones, as the base class).

        Raises:
            ValueError: fewer than ``n`` blocks are free (nothing changes).

        Complexity: O(n log n).
        """
        if n > self.num_free_blocks:
            raise ValueError(f"cannot take {n} free blocks: {self.num_free_blocks} are free")
        taken: list[Any] = []
        first, where = self._first, self._where
        while first and len(taken) < n:
            block_id, block = first.popitem(last=False)
            del where[block_id]
            taken.append(block)
        heap, live = self._leaves.heap, self._leaves.live
        inner, blocks, stamps = self._inner, self._blocks, self._stamp
        parents, children = self._parent, self._children
        depth, accesses = self._depth, self._accesses
        while len(taken) < n:
            while heap:
                stamp, block_id = heappop(heap)
                if live.get(block_id) == stamp:
                    del live[block_id]
                    break
            else:  # no leaf: the oldest freed block whose children are all in use
                if inner:
                    block_id = next(iter(inner))
                    del inner[block_id]
                elif self._hinted:  # only queued prefixes left: the newest hint first
                    block_id = self._hinted.popitem(last=True)[0]
                else:
                    raise InvariantError(f"{self.num_free_blocks} blocks counted free, none found")
            del where[block_id]
            parent = parents.pop(block_id, None)
            if parent is not None:
                siblings = children[parent]
                siblings.discard(block_id)
                if not siblings:  # the parent is a leaf now
                    del children[parent]
                    if where.get(parent) == _INNER:
                        del inner[parent]
                        where[parent] = _LEAF
                        stamp = stamps.get(parent, 0)
                        live[parent] = stamp
                        heappush(heap, (stamp, parent))
            for child in children.pop(block_id, ()):
                del parents[child]
            depth.pop(block_id, None)
            accesses.pop(block_id, None)
            stamps.pop(block_id, None)
            taken.append(blocks[block_id])
        self.num_free_blocks -= n
        return taken

    def remove(self, block: Any) -> None:
        """Take ``block`` out of the free blocks (a prefix hit on it). O(1) amortised.

        Raises:
            RuntimeError: ``block`` is not free (as vLLM's queue).
        """
        block_id = block.block_id
        section = self._where.pop(block_id, None)
        if section == _LEAF:
            del self._leaves.live[block_id]
            self._leaves.compact_if_stale()
        elif section is None:
            raise RuntimeError(f"remove() called on an invalid block: {block}")
        elif section == _INNER:
            del self._inner[block_id]
        elif section == _HINTED:
            del self._hinted[block_id]
        else:
            del self._first[block_id]
        self.num_free_blocks -= 1

    def _insert_leaf(self, block: Any) -> None:
        block_id = block.block_id
        self._where[block_id] = _LEAF
        stamp = self._stamp.get(block_id, 0)
        self._leaves.live[block_id] = stamp
        heappush(self._leaves.heap, (stamp, block_id))
