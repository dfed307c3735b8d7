"""LRU that lets reused prefixes stay longer, with reuse counts that outlive eviction."""

from __future__ import annotations

from typing import Any

from prefixcache.policies.base import EvictionPolicy
from prefixcache.policies.linked_map import LinkedMap
from sortedcontainers import SortedList

_Stay = tuple[int, int, int]
_Remembered = tuple[int | None, tuple[int, list[Any]] | None]
"""What takes a history put back: the hash's old count (None: not there), the dropped entry."""
"""(hash, hand-outs last seen, hand-outs of earlier stays)."""


class ReuseLRUPolicy(EvictionPolicy):
    """Evicts by last access plus a bonus for blocks reused before; scale-free.

    On prefix traces a block that was reused is several times more likely to
    be used again than a block computed once (on the shared Mooncake trace
    about 0.8 against 0.4), but recency still matters: a plain frequency
    order (LFU, or SLRU that evicts every one-hit block first) loses to LRU
    there. This policy orders leaves by ``last_access + bonus``, where a block
    whose prefix was handed out more than once gets ``bonus = reuse_weight x
    eviction age``. The eviction age is a running mean of how long victims
    sat since their last access (the cache's characteristic time), so the
    bonus follows the cache size and the clock rate without tuning: with the
    default weight of 1, a reused block outlives a one-hit block of the same
    age by about one cache lifetime.

    What it uses: ``last_access``, ``num_accesses``, and ``block_hash`` to
    carry the hand-out count across evictions (a bounded history of
    ``history_capacity`` hashes, most recently evicted kept), because a hot
    prefix that was evicted once would otherwise come back as a one-hit
    block. Stays are remembered by block ID while a block is out of the
    policy for a hit (bounded by the pool), so the history is not counted
    twice.

    Transactions: each change is recorded with what it replaced (a key, a
    stay, a history entry removed in place, the eviction age), so an abort
    restores all of it: an evicted leaf put back keeps its key and leaves
    the eviction age and the history as they were.

    >>> policy = ReuseLRUPolicy(age_smoothing=1.0)
    >>> policy.insert(1, block_hash=10, last_access=1, num_accesses=1, depth=0)
    >>> policy.insert(2, block_hash=20, last_access=9, num_accesses=1, depth=0)
    >>> policy.evict(1)  # block 1 sat 8 ticks: the eviction age is now 8
    [1]
    >>> policy.insert(3, block_hash=30, last_access=10, num_accesses=3, depth=0)
    >>> policy.insert(4, block_hash=40, last_access=12, num_accesses=1, depth=0)
    >>> policy.evict(2)  # block 3 is older than block 4 but was reused: key 10 + 8
    [2, 4]

    Args:
        reuse_weight: bonus of a reused block, in eviction ages (>= 0; 0 is LRU).
        history_capacity: hashes whose hand-out counts are kept after
            eviction (>= 0).
        age_smoothing: weight of the newest victim in the running eviction
            age, in ``(0, 1]``.

    Raises:
        ValueError: an argument is out of range.

    Complexity: ``insert``, ``discard`` and ``touch`` O(log n); ``evict(k)``
    O(k log n). Memory: O(pool size + history_capacity). Not thread-safe.
    """

    def __init__(
        self,
        reuse_weight: float = 1.0,
        history_capacity: int = 100_000,
        age_smoothing: float = 0.01,
    ) -> None:
        if isinstance(reuse_weight, bool) or not (
            isinstance(reuse_weight, (int, float)) and reuse_weight >= 0
        ):
            raise ValueError(f"reuse_weight must be a number >= 0, got {reuse_weight!r}")
        if (
            isinstance(history_capacity, bool)
            or not isinstance(history_capacity, int)
            or history_capacity < 0
        ):
            raise ValueError(f"history_capacity must be an int >= 0, got {history_capacity!r}")
        if isinstance(age_smoothing, bool) or not (
            isinstance(age_smoothing, (int, float)) and 0 < age_smoothing <= 1
        ):
            raise ValueError(f"age_smoothing must lie in (0, 1], got {age_smoothing!r}")
        self._reuse_weight = float(reuse_weight)
        self._history_capacity = history_capacity
        self._smoothing = float(age_smoothing)
        self._eviction_age = 0.0  # running mean of (now - last access) of victims
        self._now = 0  # the largest clock value seen
        # (last access + bonus, block ID): the smallest is the next victim.
        self._order: SortedList = SortedList()
        self._key_of: dict[int, tuple[float, int]] = {}
        self._last_access: dict[int, int] = {}  # tracked block ID -> last access
        # block ID -> (hash, hand-outs last seen, hand-outs of earlier stays), tracked or hit.
        self._stays: dict[int, tuple[int, int, int]] = {}
        self._history: LinkedMap[int] = LinkedMap()  # evicted hash -> hand-outs

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        """Track ``block_id`` at its last access, plus the bonus if reused. Complexity: O(log n)."""
        stay = self._stays.get(block_id)
        history = None
        if stay is None or stay[0] != block_hash or stay[1] > num_accesses:
            link = self._history.unlink(block_hash)
            earlier = 0 if link is None else link[2]
            history = None if link is None else (block_hash, link)
        else:
            earlier = stay[2]
        self._stays[block_id] = (block_hash, num_accesses, earlier)
        now = self._now
        self._place(block_id, last_access, earlier + num_accesses)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._uninsert, block_id, stay, history, now))

    def _uninsert(
        self,
        block_id: int,
        stay: _Stay | None,
        history: tuple[int, list[Any]] | None,
        now: int,
    ) -> None:
        """Take an insert back: untrack, the stay and clock as before, the history entry back."""
        self._remove(block_id)
        self._now = now
        if stay is None:
            del self._stays[block_id]
        else:
            self._stays[block_id] = stay
        if history is not None:
            self._history.relink(*history)

    def _place(self, block_id: int, last_access: int, num_uses: int) -> None:
        self._now = max(self._now, last_access)
        bonus = self._reuse_weight * self._eviction_age if num_uses > 1 else 0.0
        key = (last_access + bonus, block_id)
        self._key_of[block_id] = key
        self._last_access[block_id] = last_access
        self._order.add(key)

    def _put_back(self, block_id: int, key: tuple[float, int], last_access: int) -> None:
        self._key_of[block_id] = key
        self._last_access[block_id] = last_access
        self._order.add(key)

    def discard(self, block_id: int) -> None:
        """Stop tracking ``block_id``; its stay is remembered. Complexity: O(log n).

        Raises:
            KeyError: ``block_id`` is not tracked.
        """
        key, last_access = self._remove(block_id)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._put_back, block_id, key, last_access))

    def _remove(self, block_id: int) -> tuple[tuple[float, int], int]:
        """Untrack ``block_id``; return its key and last access."""
        key = self._key_of.pop(block_id)
        self._order.remove(key)
        return key, self._last_access.pop(block_id)

    def touch(self, block_id: int, now: int) -> None:
        """Record a use at ``now``; the block counts as reused. Complexity: O(log n)."""
        stay = self._stays[block_id]
        key, last_access = self._remove(block_id)
        block_hash, num_accesses, earlier = stay
        self._stays[block_id] = (block_hash, num_accesses, earlier + 1)
        old_now = self._now
        self._place(block_id, now, earlier + 1 + num_accesses)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._untouch, block_id, key, last_access, stay, old_now))

    def _untouch(
        self, block_id: int, key: tuple[float, int], last_access: int, stay: _Stay, now: int
    ) -> None:
        self._remove(block_id)
        self._stays[block_id] = stay
        self._now = now
        self._put_back(block_id, key, last_access)

    def evict(self, num_blocks: int) -> list[int]:
        """Remove up to ``num_blocks`` leaves, smallest key first. Complexity: O(k log n)."""
        victims: list[int] = []
        undo = self._txn_undo
        while len(victims) < num_blocks and self._order:
            key = self._order.pop(0)
            block_id = key[1]
            del self._key_of[block_id]
            last_access = self._last_access.pop(block_id)
            eviction_age = self._eviction_age
            self._age(last_access)
            stay = self._stays.pop(block_id)
            block_hash, num_accesses, earlier = stay
            history = self._remember(block_hash, earlier + num_accesses)
            victims.append(block_id)
            if undo is not None:
                undo.append((self._unevict, key, last_access, eviction_age, stay, history))
        return victims

    def _unevict(
        self,
        key: tuple[float, int],
        last_access: int,
        eviction_age: float,
        stay: _Stay,
        history: _Remembered | None,
    ) -> None:
        """Take an eviction back: the age and history as before, the victim at its key."""
        block_id = key[1]
        self._eviction_age = eviction_age
        self._stays[block_id] = stay
        self._unremember(stay[0], history)
        self._put_back(block_id, key, last_access)

    def _age(self, last_access: int) -> None:
        """A victim last accessed at ``last_access`` moves the running eviction age."""
        self._eviction_age += (self._now - last_access - self._eviction_age) * self._smoothing

    def _remember(self, block_hash: int, num_uses: int) -> _Remembered | None:
        """Put a victim's hand-outs in the history (an entry already there keeps its place),
        the oldest dropped past capacity; what takes it back (None: no history is kept)."""
        if not self._history_capacity:
            return None
        history = self._history
        old = history.get(block_hash)  # None: not there
        history.put(block_hash, num_uses)
        dropped = history.unlink_oldest() if len(history) > self._history_capacity else None
        return old, dropped

    def _unremember(self, block_hash: int, remembered: _Remembered | None) -> None:
        """Take :meth:`_remember` back."""
        if remembered is None:
            return
        old, dropped = remembered
        history = self._history
        if dropped is not None:
            history.relink(*dropped)
        if old is None:
            history.unlink(block_hash)
        else:
            history.put(block_hash, old)

    def evicts_first(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> bool:
        """Whether ``evict(1)`` would return ``block_id`` right after inserting it; if so, book it.

        The engine evicts a block this answers ``True`` for (the parent a chain
        eviction exposes) without the insert-and-evict round trip, so a ``True``
        answer makes every change that round trip would: the clock, the eviction
        age, the stay ended and the hash's hand-outs remembered in the history (a
        new stay's entry taken out first, as insert takes it). The tracked leaves
        and their order never change; the changes are in the undo log like every
        other. ``False`` changes nothing. Complexity: O(log n).
        """
        stay = self._stays.get(block_id)
        history = self._history
        fresh = stay is None or stay[0] != block_hash or stay[1] > num_accesses
        if fresh:
            earlier = history.get(block_hash) or 0
        else:
            assert stay is not None
            earlier = stay[2]
        bonus = self._reuse_weight * self._eviction_age if earlier + num_accesses > 1 else 0.0
        order = self._order
        if order and order[0] < (last_access + bonus, block_id):
            return False
        # Booked as insert then evict(1): the history entry taken, the clock, the age, the
        # stay ended, the hand-outs remembered (an existing entry keeps its place).
        taken = (block_hash, history.unlink(block_hash)) if fresh else None
        old_now, eviction_age = self._now, self._eviction_age
        self._now = max(old_now, last_access)
        self._age(last_access)
        if stay is not None:
            del self._stays[block_id]
        remembered = self._remember(block_hash, earlier + num_accesses)
        undo = self._txn_undo
        if undo is not None:
            undo.append(
                (self._unbook, block_id, block_hash, stay, taken, old_now, eviction_age, remembered)
            )
        return True

    def _unbook(
        self,
        block_id: int,
        block_hash: int,
        stay: _Stay | None,
        taken: tuple[int, list[Any] | None] | None,
        now: int,
        eviction_age: float,
        remembered: _Remembered | None,
    ) -> None:
        """Take back what :meth:`evicts_first` booked, last change first."""
        self._unremember(block_hash, remembered)
        if stay is not None:
            self._stays[block_id] = stay
        self._now, self._eviction_age = now, eviction_age
        if taken is not None and taken[1] is not None:
            self._history.relink(block_hash, taken[1])

    def clear(self) -> None:
        """Forget every tracked leaf, stay and history. Complexity: O(n)."""
        self._order.clear()
        self._key_of.clear()
        self._last_access.clear()
        self._stays.clear()
        self._history.clear()
        self._eviction_age = 0.0
        self._now = 0
        self._txn_undo = None

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._key_of
