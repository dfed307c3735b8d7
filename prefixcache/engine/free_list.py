"""SortedFreeList: a free list that hands out the lowest free IDs first, page by page.

The default free list is :class:`~prefixcache.engine.pool.BlockPool`'s LIFO
stack: O(1) per block, and recently freed (cache-warm) blocks go out first,
but the live blocks end up scattered over the whole pool. This free list keeps
the live blocks packed at the low end instead (DESIGN.md, "Locality"), at
O(log n) per block: ``AllocatorConfig(free_list="lowest")``.

Hand-out order, with ``page_size`` P blocks to a page (page ``p`` holds IDs
``p*P .. p*P + P - 1``; the last page may be shorter when P does not divide
the usable count, and then never counts as whole):

1. ``n // P`` *whole pages* (pages whose blocks are all free), the lowest
   first, each page's blocks in ascending order: a request of ``n >= P``
   blocks starts at a page boundary whenever a whole page is free;
2. the ``n % P`` remaining blocks (and any whole pages that were missing) from
   the lowest free blocks of *partly used* pages, so a small request fills
   holes instead of breaking a whole page;
3. only when those run out, blocks of the lowest whole pages, ascending.

With ``P == 1`` every free block is a whole page and the order is simply the
``n`` lowest free IDs, ascending. The native engine's ``LowestFreeList``
(``native/free_set.h``) hands out the same IDs in both modes, which the
differential test checks.

:meth:`free_ids` lists the free IDs in descending order (the lowest, the
next to go out, last), matching the stack's "bottom first".
"""

from __future__ import annotations

import heapq

import numpy as np
import torch
from sortedcontainers import SortedList

from prefixcache.engine.pool import resolve_device
from prefixcache.engine.validation import is_int
from prefixcache.errors import CapacityError, ConfigError, InvalidArgumentError


class SortedFreeList:
    """Free block IDs handed out lowest first, whole pages before partly used ones.

    Same interface as :class:`~prefixcache.engine.pool.BlockPool` (the engine
    swaps one for the other): :meth:`acquire`, :meth:`release`,
    :meth:`reset`, :meth:`free_ids`, :meth:`rebuild`, ``num_free``. Like the
    pool it does not validate released IDs (the allocator does). It keeps no
    device mirror (``device_free_ids`` is None).

    State, for pages of several blocks: ``_whole``, a sorted list of whole
    free pages; ``_partial``, a sorted list of the free blocks of pages that
    are not whole; ``_free_in_page``, the count of free blocks per page. With
    one block a page, ``_heap`` alone: a binary min-heap of the free IDs
    (``heapq``, in C: about 5x cheaper per block than a ``SortedList``).

    Complexity: O(log n) per block handed out or released. Not thread-safe.

    Args:
        total_count: blocks including the dummy block (>= 2).
        device: accepted for the pool's signature; nothing is mirrored.
        page_size: blocks per page, >= 1.
    """

    def __init__(
        self, total_count: int, device: str | torch.device | None = None, *, page_size: int = 1
    ) -> None:
        if not is_int(total_count) or total_count < 2:
            raise ConfigError(
                f"total_count must be an int >= 2 (one is the dummy), got {total_count!r}"
            )
        if not is_int(page_size) or page_size < 1:
            raise ConfigError(f"page_size must be an int >= 1, got {page_size!r}")
        self.total_count = int(total_count)
        self.num_usable = self.total_count - 1
        self.dummy_block_id = self.num_usable
        self.device = resolve_device(device)
        self.page_size = int(page_size)
        self._num_pages = -(-self.num_usable // self.page_size)
        # Blocks in each page: page_size, except a shorter last page.
        self._page_len = np.full(self._num_pages, self.page_size, dtype=np.int64)
        self._page_len[-1] = self.num_usable - (self._num_pages - 1) * self.page_size
        self._free_in_page = np.zeros(self._num_pages, dtype=np.int64)
        self._whole: SortedList = SortedList()
        self._partial: SortedList = SortedList()
        self._heap: list[int] = []
        self.num_free = 0
        self.reset()

    @property
    def device_free_ids(self) -> None:
        """No device mirror: a sorted free list is a host structure."""
        return None

    def _is_whole(self, page: int) -> bool:
        """Whether every block of ``page`` may count as one whole page (a full-size page)."""
        return bool(self._page_len[page] == self.page_size)

    def reset(self) -> None:
        """Every usable block free. Complexity: O(total_count)."""
        self.rebuild(np.arange(self.num_usable, dtype=np.int32))

    def rebuild(self, free_ids: np.ndarray) -> None:
        """Make exactly ``free_ids`` (distinct, in range, any order) the free blocks.

        Used by reset and by defragmentation, which changes the free set at
        once. Complexity: O(total_count + k log k).
        """
        ids = np.asarray(free_ids, dtype=np.int64)
        self.num_free = len(ids)
        if self.page_size == 1:
            self._heap = np.sort(ids).tolist()  # a sorted list is a heap
            return
        counts = np.bincount(ids // self.page_size, minlength=self._num_pages)
        whole_mask = (counts == self._page_len) & (self._page_len == self.page_size)
        self._free_in_page = counts.astype(np.int64)
        self._whole = SortedList(np.flatnonzero(whole_mask).tolist())
        self._partial = SortedList(ids[~whole_mask[ids // self.page_size]].tolist())

    def acquire(self, num_blocks: int) -> np.ndarray:
        """Take ``num_blocks`` IDs in the order of the module docstring (int32 array).

        Raises:
            InvalidArgumentError: ``num_blocks`` is negative or not an integer.
            CapacityError: fewer than ``num_blocks`` blocks are free.

        Complexity: O(num_blocks log n).
        """
        if type(num_blocks) is not int:
            if not is_int(num_blocks):
                raise InvalidArgumentError(
                    f"num_blocks must be an int, got {type(num_blocks).__name__}"
                )
            num_blocks = int(num_blocks)
        if num_blocks < 0:
            raise InvalidArgumentError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free:
            raise CapacityError(f"asked for {num_blocks} blocks, {self.num_free} free")
        size = self.page_size
        if size == 1:  # the lowest IDs, ascending, off the heap
            heap, pop = self._heap, heapq.heappop
            lowest = [pop(heap) for _ in range(num_blocks)]
            self.num_free -= num_blocks
            return np.asarray(lowest, dtype=np.int32)
        taken: list[int] = []
        num_pages = min(num_blocks // size, len(self._whole))
        if num_pages:
            pages = self._whole[:num_pages]
            del self._whole[:num_pages]
            for page in pages:
                taken.extend(range(page * size, page * size + size))
            self._free_in_page[pages] = 0
        rest = num_blocks - len(taken)
        from_partial = min(rest, len(self._partial))
        if from_partial:
            ids = self._partial[:from_partial]
            del self._partial[:from_partial]
            np.subtract.at(self._free_in_page, np.asarray(ids) // size, 1)
            taken.extend(ids)
        while len(taken) < num_blocks:  # break the lowest whole page
            page = self._whole.pop(0)
            need = num_blocks - len(taken)
            taken.extend(range(page * size, page * size + need))
            self._partial.update(range(page * size + need, page * size + size))
            self._free_in_page[page] = size - need
        self.num_free -= num_blocks
        return np.asarray(taken, dtype=np.int32)

    def release(self, block_ids: np.ndarray) -> None:
        """Put ``block_ids`` (held, distinct, unchecked) back. Complexity: O(k log n).

        Raises:
            InvalidArgumentError: more IDs than are handed out; nothing changes.
        """
        count = len(block_ids)
        if count > self.num_usable - self.num_free:
            raise InvalidArgumentError(
                f"releasing {count} blocks, but only {self.num_usable - self.num_free} "
                "are handed out"
            )
        if self.page_size == 1:
            heap, push = self._heap, heapq.heappush
            for block_id in np.asarray(block_ids).tolist():
                push(heap, block_id)
            self.num_free += count
            return
        size, free_in_page = self.page_size, self._free_in_page
        for block_id in np.asarray(block_ids).tolist():
            page = block_id // size
            free_in_page[page] += 1
            if free_in_page[page] == size and self._is_whole(page):
                start = page * size
                for other in range(start, start + size):
                    if other != block_id:
                        self._partial.remove(other)
                self._whole.add(page)
            else:
                self._partial.add(block_id)
        self.num_free += count

    def free_ids(self) -> np.ndarray:
        """The free IDs, descending (the next to go out last). Complexity: O(n log n), n free."""
        if self.page_size == 1:
            out1: np.ndarray = np.sort(np.asarray(self._heap, dtype=np.int32))[::-1].copy()
            return out1
        size = self.page_size
        pages = np.asarray(self._whole, dtype=np.int64)
        whole = (pages[:, None] * size + np.arange(size)).ravel()
        ids = np.concatenate((whole, np.asarray(self._partial, dtype=np.int64)))
        ids.sort()
        out: np.ndarray = ids[::-1].astype(np.int32)
        return out

    def free_in_page(self, page: int) -> int:
        """Free blocks in ``page`` (pages of several blocks). Complexity: O(1)."""
        if self.page_size == 1:
            raise InvalidArgumentError("free_in_page needs pages of several blocks")
        return int(self._free_in_page[page])

    def page_length(self, page: int) -> int:
        """Blocks in ``page``: ``page_size``, or fewer for a short last page. O(1)."""
        return int(self._page_len[page])

    def free_pages(self) -> int:
        """How many whole pages are free (memory a paged KV store could unmap). O(1)."""
        return len(self._heap) if self.page_size == 1 else len(self._whole)


def bind_page_policy(policy: object, pool: object, active: np.ndarray, paused: np.ndarray) -> None:
    """Give a page-aware policy (one with ``bind_free_counts``) each page's block counts.

    Free counts and lengths come from the free list; held counts (blocks
    with any reference) from the engine's ``active`` and ``paused`` arrays,
    which keep their identity for the engine's lifetime.

    Raises:
        ConfigError: the policy is page-aware but the free list is not a
            :class:`SortedFreeList` with pages of the policy's ``page_size``.
    """
    bind = getattr(policy, "bind_free_counts", None)
    if not callable(bind):
        return
    page_size = getattr(policy, "page_size", None)
    if not isinstance(pool, SortedFreeList) or pool.page_size != page_size or page_size == 1:
        raise ConfigError(
            f"{type(policy).__name__}(page_size={page_size}) needs free_list='lowest' "
            f"and page_size_blocks={page_size} (> 1)"
        )
    size = pool.page_size

    def held_in_page(page: int) -> int:
        start = page * size
        return int(np.count_nonzero(active[start : start + size] | paused[start : start + size]))

    bind(pool.free_in_page, pool.page_length, held_in_page)
