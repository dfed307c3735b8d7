"""Page-aware eviction: prefer victims that complete a free page, else the inner policy's.

When the KV storage is mapped in physical pages of several blocks (as
virtual-memory-backed KV caches are), a page's memory can be given back only
once every block in it is free: evicting scattered blocks frees blocks but no
memory. This policy wraps another one (LRU by default) and, when asked for a
victim, first looks for a page that no request holds a block of (every
block free or cached) and that has a tracked leaf; of those it takes the one
with the fewest cached blocks (the lowest page among equals) and evicts its
leaves, lowest ID first, and the parents they expose there, until the page is
free or has no leaf left. With no such page it defers to the inner policy.
DESIGN.md, "Defragmentation"; measured by
``benchmarks/bench_locality.py --page-eviction``.

It needs each page's free and held (referenced) block counts, which only
the allocator knows: the Python engine binds them
(:meth:`PageAwarePolicy.bind_free_counts`) when the allocator runs
``free_list="lowest"`` with ``page_size_blocks`` equal to this policy's
``page_size``. Unbound, a page qualifies only when all its blocks are
tracked leaves.
"""

from __future__ import annotations

from collections.abc import Callable

from prefixcache.policies.base import EvictionPolicy
from prefixcache.policies.lru import LRUPolicy


class PageAwarePolicy(EvictionPolicy):
    """Evicts leaves that complete a free page first; otherwise the inner policy decides.

    Once it starts on a page it keeps evicting that page's leaves (parents
    its victims expose included) until none is left, so one eviction plan
    completes the page although its victims reach the free list only when
    the plan commits. Transactions: the inner policy's run beside this one's
    undo log (each change of the page sets and of the target page recorded
    with its inverse).

    Complexity: ``insert``, ``discard``, ``touch`` as the inner policy plus
    O(1); ``evict`` O(pages holding leaves) per victim, a scan: this option is
    for memory-bound deployments and measurement, not the fastest path.
    Not thread-safe.

    Args:
        page_size: blocks per page, >= 1 (the allocator's ``page_size_blocks``).
        inner: the policy that orders victims when no page can be completed;
            a fresh :class:`LRUPolicy` by default.
    """

    def __init__(self, page_size: int, inner: EvictionPolicy | None = None) -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.page_size = page_size
        self.inner = inner if inner is not None else LRUPolicy()
        self._leaves_in_page: dict[int, set[int]] = {}
        self._target: int | None = None  # the page being completed, until its leaves are gone
        self._free_counts: Callable[[int], int] | None = None
        self._page_lengths: Callable[[int], int] | None = None
        self._held_counts: Callable[[int], int] | None = None

    def bind_free_counts(
        self,
        free_counts: Callable[[int], int],
        page_lengths: Callable[[int], int],
        held_counts: Callable[[int], int],
    ) -> None:
        """Learn each page's free, length and held (referenced) block counts, O(page) each."""
        self._free_counts = free_counts
        self._page_lengths = page_lengths
        self._held_counts = held_counts

    # ------------------------------------------------------------------ tracking

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        self.inner.insert(block_id, block_hash, last_access, num_accesses, depth)
        self._track(block_id)
        self.record_undo(self._untrack, block_id)

    def discard(self, block_id: int) -> None:
        self.inner.discard(block_id)
        self._untrack(block_id)
        self.record_undo(self._track, block_id)

    def touch(self, block_id: int, now: int) -> None:
        self.inner.touch(block_id, now)

    def evict(self, num_blocks: int) -> list[int]:
        victims: list[int] = []
        while len(victims) < num_blocks:
            page = self._target if self._target in self._leaves_in_page else None
            if page is None:
                page = self._cheapest_completable_page()
            if page != self._target:
                self.record_undo(self._set_target, self._target)
                self._target = page
            if page is None:
                chosen = self.inner.evict(1)
                if not chosen:
                    break
                block_id = chosen[0]
            else:
                block_id = min(self._leaves_in_page[page])
                self.inner.discard(block_id)
            self._untrack(block_id)
            self.record_undo(self._track, block_id)
            victims.append(block_id)
        return victims

    def _cheapest_completable_page(self) -> int | None:
        """The unheld page with a leaf and the fewest cached blocks, or None.

        Complexity: O(pages with leaves * page_size), once per page taken on.
        """
        best: tuple[int, int] | None = None
        free_counts, lengths, held = self._free_counts, self._page_lengths, self._held_counts
        for page, leaves in self._leaves_in_page.items():
            length = lengths(page) if lengths is not None else self.page_size
            if free_counts is None or held is None:
                cached = len(leaves) if len(leaves) == length else -1
            else:
                cached = -1 if held(page) else length - free_counts(page)
            if cached >= 0 and (best is None or (cached, page) < best):
                best = (cached, page)
        return None if best is None else best[1]

    def _track(self, block_id: int) -> None:
        self._leaves_in_page.setdefault(block_id // self.page_size, set()).add(block_id)

    def _untrack(self, block_id: int) -> None:
        page = block_id // self.page_size
        leaves = self._leaves_in_page[page]
        leaves.discard(block_id)
        if not leaves:
            del self._leaves_in_page[page]

    def _set_target(self, page: int | None) -> None:
        self._target = page

    def clear(self) -> None:
        self.inner.clear()
        self._leaves_in_page.clear()
        self._target = None
        self._txn_undo = None

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self.inner

    # ------------------------------------------------------------------ transactions

    def begin(self) -> None:
        super().begin()
        self.inner.begin()

    def commit(self) -> None:
        self.inner.commit()
        super().commit()

    def abort(self) -> None:
        self.inner.abort()
        super().abort()

    def __repr__(self) -> str:
        return f"PageAwarePolicy(page_size={self.page_size}, inner={type(self.inner).__name__})"
