"""LRU with a protected class for reused prefixes, whose use counts outlive eviction."""

from __future__ import annotations

import heapq
from typing import Any

from prefixcache.policies.base import EvictionPolicy
from prefixcache.policies.linked_map import LinkedMap

_Evicted = tuple[
    tuple[int, int], tuple[int, int, int], list[Any] | None, tuple[int, list[Any]] | None
]
"""What takes an eviction back: the place, the stay, the hash's history entry it
replaced and the oldest entry it pushed out (links for ``LinkedMap.relink``)."""


class ProtectedLRUPolicy(EvictionPolicy):
    """Evicts leaves used once before any reused leaf; LRU within each class.

    A leaf is *protected* when its prefix was handed out at least twice,
    counting earlier stays of the same hash in the cache: a bounded history
    keeps the use count of the ``history_capacity`` most recently evicted
    hashes, so a prefix that was reused, evicted and computed again comes back
    protected (the admission idea of W-TinyLFU, with an exact bounded dict
    instead of a sketch). Every other leaf is *probationary*. The victim is the
    least recently used probationary leaf, or the least recently used
    protected leaf when no probationary leaf is left. Unlike ``slru`` the
    protected class has no size cap: on prefix traces a first use predicts
    little and a second use a lot (on the shared Mooncake trace a chain used
    once is reused about 0.2-0.3 of the time, a chain used twice about 0.8),
    so keeping any reused prefix over any one-off one pays, and a cap only
    lets one-off chains push reused ones out. Protected leaves still age out
    among themselves by last access, so a conversation that ended leaves
    before one that is still going.

    Where it loses: when a first use predicts reuse as well as a second (every
    chat turn is continued at the same rate), evicting fresh tails first costs
    against LRU (a few percent on the generated multi-turn chats,
    ``benchmarks/policy_tables.md``); a one-off prompt long enough to matter is
    never protected unless it comes back while its hash is remembered.

    What it uses: ``last_access`` (the order within a class), ``num_accesses``
    and ``block_hash`` (the use count, carried across evictions by hash).
    ``depth`` is ignored: on the traces measured, depth bonuses made it worse.
    Stays are remembered by block ID while a block is out of the policy for a
    hit (bounded by the pool), so a hit is counted once, not twice.

    What it uses the registration hook for (:meth:`on_register`): a remembered
    hash that is registered again (an evicted prefix computed again, often as
    the inside of a longer request) is moved to the recent end of the history.
    Such a block becomes a leaf, and has its earlier uses counted, only when
    everything registered below it is evicted, which can take longer than the
    history lasts; the refresh keeps its count until then. On the traces
    measured the default history is long enough that this changes no hit rate
    (``benchmarks/policy_tables.md``, "on_register"); it matters with a short
    history.

    Transactions: each change is recorded with what it replaced (a place, a
    stay, history entries removed in place), so an abort restores all of it:
    a victim put back takes its old place and class and leaves the history
    as it was, a touch taken back no longer counts a use, an insert taken
    back gives its hash's use count back to the history, and the history
    moves of :meth:`on_register` are undone.

    >>> policy = ProtectedLRUPolicy()
    >>> policy.insert(1, block_hash=10, last_access=1, num_accesses=2, depth=0)
    >>> policy.insert(2, block_hash=20, last_access=5, num_accesses=1, depth=0)
    >>> policy.evict(1)  # block 1 is older but was reused
    [2]
    >>> policy.evict(1), policy.remembered_uses(20)
    ([1], 1)
    >>> policy.insert(3, block_hash=20, last_access=9, num_accesses=1, depth=0)  # computed again
    >>> policy.is_protected(3)  # hash 20 comes back: its earlier use counts
    True

    Args:
        history_capacity: evicted hashes whose use counts are remembered
            (>= 0; 0 turns the history off).

    Raises:
        ValueError: ``history_capacity`` is not an int >= 0.

    Complexity: ``insert`` and ``touch`` O(log n); ``discard`` O(1)
    amortised; ``evict(k)`` O(k log n) amortised (binary heaps with lazy
    deletion, rebuilt when stale entries outnumber live ones); ``on_register``
    O(1) per hash. Memory: O(pool size + history_capacity). Not thread-safe.
    """

    def __init__(self, history_capacity: int = 100_000) -> None:
        if (
            isinstance(history_capacity, bool)
            or not isinstance(history_capacity, int)
            or history_capacity < 0
        ):
            raise ValueError(f"history_capacity must be an int >= 0, got {history_capacity!r}")
        self._history_capacity = history_capacity
        # (last access, block ID) per class, some entries stale; index 1 is protected.
        self._heaps: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])
        # tracked block ID -> (class, last access): class 0 probation, 1 protected.
        self._place_of: dict[int, tuple[int, int]] = {}
        # block ID -> (hash, hand-outs last seen, uses of earlier stays), tracked or out for a hit.
        self._stays: dict[int, tuple[int, int, int]] = {}
        # evicted hash -> uses of all its stays, the least recently evicted first.
        self._history: LinkedMap[int] = LinkedMap()

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        """Track ``block_id`` in the class its use count gives. Complexity: O(log n)."""
        stay = self._stays.get(block_id)
        link = None  # the history entry of a returning hash, taken out
        if stay is None or stay[0] != block_hash or stay[1] > num_accesses:
            link = self._history.unlink(block_hash)
            earlier = 0 if link is None else link[2]
        else:
            earlier = stay[2]
        self._stays[block_id] = (block_hash, num_accesses, earlier)
        self._place(block_id, last_access, earlier + num_accesses)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._uninsert, block_id, stay, link))

    def _uninsert(
        self, block_id: int, stay: tuple[int, int, int] | None, link: list[Any] | None
    ) -> None:
        """Take an insert back: untrack, the stay as before, the history entry back."""
        self._unplace(block_id)
        block_hash = self._stays[block_id][0]
        if stay is None:
            del self._stays[block_id]
        else:
            self._stays[block_id] = stay
        if link is not None:
            self._history.relink(block_hash, link)

    def on_register(self, block_hashes: list[int], first_depth: int) -> None:
        """Keep the use counts of remembered hashes that were just registered again.

        Each such hash moves to the recent end of the history, so its earlier
        uses are still known when its block becomes a leaf and is inserted.

        Args:
            block_hashes: one run of newly registered hashes (not kept).
            first_depth: chain position of the first; not used.

        Complexity: O(len(block_hashes)) amortised.
        """
        history, undo = self._history, self._txn_undo
        for block_hash in block_hashes:
            link = history.unlink(block_hash)
            if link is not None:
                history.put(block_hash, link[2])
                if undo is not None:
                    undo.append((self._unrefresh, block_hash, link))

    def _unrefresh(self, block_hash: int, link: list[Any]) -> None:
        """Put ``block_hash`` back where :meth:`on_register` took it from."""
        self._history.unlink(block_hash)
        self._history.relink(block_hash, link)

    def _place(self, block_id: int, last_access: int, num_uses: int) -> None:
        klass = 1 if num_uses >= 2 else 0
        self._place_of[block_id] = (klass, last_access)
        heapq.heappush(self._heaps[klass], (last_access, block_id))

    def _unplace(self, block_id: int) -> tuple[int, int]:
        """Untrack ``block_id``; return its place (class, last access)."""
        place = self._place_of.pop(block_id)
        self._compact_if_stale(place[0])
        return place

    def _put_back(self, block_id: int, place: tuple[int, int]) -> None:
        """Track ``block_id`` again at ``place``, as :meth:`_unplace` returned it."""
        self._place_of[block_id] = place
        heapq.heappush(self._heaps[place[0]], (place[1], block_id))

    def discard(self, block_id: int) -> None:
        """Stop tracking ``block_id``; its stay is remembered. Complexity: O(1) amortised.

        Raises:
            KeyError: ``block_id`` is not tracked.
        """
        place = self._unplace(block_id)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._put_back, block_id, place))

    def touch(self, block_id: int, now: int) -> None:
        """Record a use at ``now``: the leaf becomes protected. Complexity: O(log n).

        Raises:
            KeyError: ``block_id`` is not tracked.
        """
        place = self._unplace(block_id)
        stay = self._stays[block_id]
        block_hash, num_accesses, earlier = stay
        self._stays[block_id] = (block_hash, num_accesses, earlier + 1)
        self._place(block_id, now, earlier + 1 + num_accesses)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._untouch, block_id, place, stay))

    def _untouch(self, block_id: int, place: tuple[int, int], stay: tuple[int, int, int]) -> None:
        self._unplace(block_id)
        self._stays[block_id] = stay
        self._put_back(block_id, place)

    def evict(self, num_blocks: int) -> list[int]:
        """Remove up to ``num_blocks`` leaves, probation first. Complexity: O(k log n) amortised."""
        victims: list[int] = []
        undo = self._txn_undo
        for klass, heap in enumerate(self._heaps):
            while heap and len(victims) < num_blocks:
                last_access, block_id = heapq.heappop(heap)
                place = self._place_of.get(block_id)
                if place == (klass, last_access):
                    del self._place_of[block_id]
                    evicted = self._remember(block_id, place)
                    victims.append(block_id)
                    if undo is not None:
                        undo.append((self._unevict, block_id, evicted))
        return victims

    def _remember(self, block_id: int, place: tuple[int, int]) -> _Evicted:
        """Move the victim's stay to the history; return what takes the eviction back."""
        stay = self._stays.pop(block_id)
        if not self._history_capacity:
            return place, stay, None, None
        block_hash, num_accesses, earlier = stay
        return place, stay, *self._put_history(block_hash, earlier + num_accesses)

    def _unevict(self, block_id: int, evicted: _Evicted) -> None:
        """Take an eviction back: the history as before, the victim in its place."""
        place, stay, replaced, dropped = evicted
        self._take_back_history(stay[0], replaced, dropped)
        self._stays[block_id] = stay
        self._put_back(block_id, place)

    def _put_history(
        self, block_hash: int, num_uses: int
    ) -> tuple[list[Any] | None, tuple[int, list[Any]] | None]:
        """``block_hash``'s use count put last in the history, its old entry taken out and the
        oldest dropped past capacity (with no history kept, only the old entry taken out);
        returns what takes it back: the old entry's link and the dropped entry."""
        history = self._history
        replaced = history.unlink(block_hash)
        dropped = None
        if self._history_capacity:
            history.put(block_hash, num_uses)
            if len(history) > self._history_capacity:
                dropped = history.unlink_oldest()
        return replaced, dropped

    def _take_back_history(
        self,
        block_hash: int,
        replaced: list[Any] | None,
        dropped: tuple[int, list[Any]] | None,
    ) -> None:
        """Take :meth:`_put_history` back, last change first."""
        history = self._history
        if dropped is not None:
            history.relink(*dropped)
        history.unlink(block_hash)  # a no-op without a history
        if replaced is not None:
            history.relink(block_hash, replaced)

    def evicts_first(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> bool:
        """Whether ``evict(1)`` would return ``block_id`` right after inserting it; if so, book it.

        The engine evicts a block this answers ``True`` for (the parent a chain
        eviction exposes) without the insert-and-evict round trip, so a ``True``
        answer makes every change that round trip would: the stay ended and the
        hash's use count remembered at the recent end of the history. Drops
        stale entries from the heap tops (invisible: :meth:`evict` skips them).
        The tracked leaves and their order never change; the changes are in the
        undo log like every other. ``False`` changes nothing. Complexity: O(1)
        amortised.
        """
        stay = self._stays.get(block_id)
        history = self._history
        if stay is None or stay[0] != block_hash or stay[1] > num_accesses:
            earlier = history.get(block_hash) or 0
        else:
            earlier = stay[2]
        key = (last_access, block_id)
        probation = self._live_top(0)
        if earlier + num_accesses >= 2:  # protected: only after every probationary leaf
            protected = self._live_top(1)
            if probation is not None or (protected is not None and protected < key):
                return False
        elif probation is not None and probation < key:
            return False
        # Booked as insert then evict(1): the history entry taken (insert's, or evict's
        # replace), the use count put last, the oldest dropped past capacity.
        if stay is not None:
            del self._stays[block_id]
        replaced, dropped = self._put_history(block_hash, earlier + num_accesses)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._unbook, block_id, block_hash, stay, replaced, dropped))
        return True

    def _live_top(self, klass: int) -> tuple[int, int] | None:
        """The least (last access, block ID) tracked in ``klass``; stale tops are dropped."""
        heap, place_of = self._heaps[klass], self._place_of
        while heap:
            last_access, block_id = heap[0]
            if place_of.get(block_id) == (klass, last_access):
                return heap[0]
            heapq.heappop(heap)
        return None

    def _unbook(
        self,
        block_id: int,
        block_hash: int,
        stay: tuple[int, int, int] | None,
        replaced: list[Any] | None,
        dropped: tuple[int, list[Any]] | None,
    ) -> None:
        """Take back what :meth:`evicts_first` booked, last change first."""
        self._take_back_history(block_hash, replaced, dropped)
        if stay is not None:
            self._stays[block_id] = stay

    def _compact_if_stale(self, klass: int) -> None:
        heap = self._heaps[klass]
        if len(heap) > 2 * len(self._place_of) + 64:
            live = [key for key in heap if self._place_of.get(key[1]) == (klass, key[0])]
            heapq.heapify(live)
            heap[:] = live

    def clear(self) -> None:
        """Forget every tracked leaf, stay and remembered hash. Complexity: O(n)."""
        for heap in self._heaps:
            heap.clear()
        self._place_of.clear()
        self._stays.clear()
        self._history.clear()
        self._txn_undo = None

    def is_protected(self, block_id: int) -> bool:
        """Whether the tracked leaf ``block_id`` is in the protected class. Complexity: O(1).

        Raises:
            KeyError: ``block_id`` is not tracked.
        """
        return self._place_of[block_id][0] == 1

    def remembered_uses(self, block_hash: int) -> int:
        """Remembered use count of the evicted ``block_hash`` (0 if none). Complexity: O(1)."""
        return self._history.get(block_hash) or 0

    def eviction_order(self) -> list[int]:
        """Tracked leaves, next victim first (for tests and debugging). Complexity: O(n log n)."""
        ranked = sorted((place, block_id) for block_id, place in self._place_of.items())
        return [block_id for _, block_id in ranked]

    def __len__(self) -> int:
        return len(self._place_of)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._place_of
