"""The read-only views of the vLLM plugin's free-block queue: the hand-out order, replayed.

vLLM's tests (and a few of its callers) read the free queue as a linked list from a fake
head, or as a list (``get_all_free_blocks``, ``iter_blocks_after``). The plugin's queue
keeps no such list: its order is the policy's, decided at each hand-out. These views
replay :meth:`PolicyFreeBlockQueue.popleft_n`'s choices on a copy of the policy and of the
link counts, so they cost O(n log n) per read and never change the queue. The native
queue (:mod:`.vllm_native_queue`) replaces :meth:`FreeQueueViews._eviction_order` with its
extension's ``eviction_order()``, which replays the same steps in C++.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from prefixcache.policies import EvictionPolicy

__all__ = ["FreeQueueViews"]

_FIRST, _LEAF, _INNER, _HINTED = 1, 2, 3, 4  # where a free block is (the queue's sections)


class _End:
    """The fake head or tail of the linked view, as vLLM's queue has (``block_id`` -1)."""

    __slots__ = ("block_id", "next_free_block", "prev_free_block")

    def __init__(self) -> None:
        self.block_id = -1
        self.prev_free_block: Any = None
        self.next_free_block: Any = None


class FreeQueueViews:
    """The views of :class:`~prefixcache.integrations.vllm_queue.PolicyFreeBlockQueue`
    (its base class): the state they read is the queue's, declared here for type checks."""

    policy: EvictionPolicy
    _first: OrderedDict[int, Any]
    _inner: OrderedDict[int, Any]
    _hinted: OrderedDict[int, Any]
    _blocks: dict[int, Any]
    _where: dict[int, int]
    _parent: dict[int, int]
    _children: dict[int, set[int]]
    _head: Any
    _tail: Any

    def _leaf_args(self, block_id: int) -> tuple[int, int, int, int]:
        """What the policy's ``insert`` gets after the block ID (the queue defines it)."""
        raise NotImplementedError

    def is_free_leaf(self, block_id: int) -> bool:
        """Whether ``block_id`` is free and one of the policy's leaves (cached, no cached
        child): what a conversation's end may free (:mod:`.vllm_ends`). O(1)."""
        return self._where.get(block_id) == _LEAF

    @property
    def fake_free_list_head(self) -> Any:
        """vLLM's fake head, its ``next_free_block`` chain linked through every free
        block in hand-out order now (a view for tests: later changes do not update it).
        Complexity: O(n log n)."""
        self._link_view()
        return self._head

    @property
    def fake_free_list_tail(self) -> Any:
        """The fake tail of the view :attr:`fake_free_list_head` links. O(n log n)."""
        self._link_view()
        return self._tail

    def get_all_free_blocks(self) -> list[Any]:
        """Every free block, next handed out first (read on a copy). O(n log n)."""
        return self._eviction_order()

    def iter_blocks_after(self, cursor: Any | None) -> Iterator[Any]:
        """Free blocks in hand-out order after ``cursor`` (all when None; none when
        ``cursor`` is not free, as vLLM's queue). Complexity: O(n log n)."""
        order = self._eviction_order()
        if cursor is None:
            yield from order
            return
        for index, block in enumerate(order):
            if block is cursor:
                yield from order[index + 1 :]
                return

    def _eviction_order(self) -> list[Any]:
        """The hand-out order, replayed on a copy of the policy and the link counts:
        hash-less blocks, then the policy's leaves (an evicted leaf may expose its
        parent), the inner blocks when no leaf is left, the hinted ones last, newest
        first."""
        order = list(self._first.values())
        policy = copy.deepcopy(self.policy)
        inner = dict.fromkeys(self._inner)
        hinted = list(self._hinted)
        num_children = {parent: len(kids) for parent, kids in self._children.items()}
        while True:
            victims = policy.evict(1)
            if victims:
                block_id = victims[0]
            elif inner:
                block_id = next(iter(inner))
                del inner[block_id]
            elif hinted:
                block_id = hinted.pop()
            else:
                break
            order.append(self._blocks[block_id])
            parent = self._parent.get(block_id)
            if parent is not None:
                num_children[parent] -= 1
                if num_children[parent] == 0 and parent in inner:
                    del inner[parent]
                    policy.insert(parent, *self._leaf_args(parent))
        return order

    def _link_view(self) -> None:
        """Link the fake head, every free block in hand-out order, and the fake tail."""
        before = self._head
        for block in self._eviction_order():
            before.next_free_block, block.prev_free_block = block, before
            before = block
        before.next_free_block, self._tail.prev_free_block = self._tail, before
