"""ARC eviction (Megiddo and Modha, FAST 2003) adapted to the cached leaves of a prefix cache."""

from __future__ import annotations

from typing import Any

from prefixcache.policies.base import EvictionPolicy
from prefixcache.policies.linked_map import LinkedMap
from sortedcontainers import SortedList

_Ghost = tuple[LinkedMap[None], int, list[Any], float]
"""A ghost hit, as taken back: the list it left, the hash, its link and ``p`` before."""


class ARCPolicy(EvictionPolicy):
    """Adaptive replacement: a recency list, a frequency list and a ghost list for each.

    Leaves used once sit in ``T1``; leaves used at least twice (hit while
    cached, touched, or come back while their hash was on a ghost list) sit
    in ``T2``; both are ordered by last access. Evicted hashes go to the
    ghost list of the list they left, ``B1`` or ``B2``. ARC keeps a target
    share ``p`` of ``T1``: a returning hash found in ``B1`` says recency
    lists are too short and raises ``p``; one found in ``B2`` lowers it, by
    ARC's steps (``max(1, |B2| / |B1|)`` and the reverse, over the number of
    tracked leaves). The victim is the oldest leaf of ``T1`` while ``T1``
    holds more than its share, else the oldest of ``T2``.

    Adaptation to the allocator's protocol: ARC sizes lists in cache
    entries, but a policy here sees only the evictable leaves, so ``p`` is a
    fraction of the tracked leaves rather than a count. A hit discards the
    block and its release inserts it again; the policy remembers the stay by
    block ID (bounded by the pool) and recognises the return by the same
    hash and a hand-out count that did not drop. A block first seen with
    more than one hand-out (a parent exposed after its child was evicted,
    hit before) goes to ``T2``. Ghost lists hold hashes only, never blocks,
    each its ``ghost_capacity`` most recent.

    Transactions: each change is recorded with what it replaced (a ghost
    removed in place, ``p``, a stay, a key), so an abort restores all of it:
    an evicted leaf put back returns to its list and its ghost entry goes.

    What it uses: ``last_access``, ``num_accesses`` and ``block_hash``.

    >>> policy = ARCPolicy()
    >>> policy.insert(1, block_hash=10, last_access=1, num_accesses=1, depth=0)
    >>> policy.insert(2, block_hash=20, last_access=2, num_accesses=3, depth=0)
    >>> policy.insert(3, block_hash=30, last_access=3, num_accesses=1, depth=0)
    >>> policy.evict(1)  # T1 (blocks 1 and 3) holds more than p = 1/2: its oldest goes
    [1]
    >>> policy.insert(4, block_hash=10, last_access=4, num_accesses=1, depth=0)
    >>> policy.evict(1)  # hash 10 came back from B1 into T2 and raised p; T1 = {3} is in share
    [2]

    Args:
        ghost_capacity: hashes kept on each ghost list (>= 0).
        initial_recency_share: starting value of ``p``, in ``[0, 1]``.

    Raises:
        ValueError: an argument is out of range.

    Complexity: ``insert``, ``discard`` and ``touch`` O(log n); ``evict(k)``
    O(k log n). Memory: O(pool size + 2 x ghost_capacity). Not thread-safe.
    """

    def __init__(self, ghost_capacity: int = 50_000, initial_recency_share: float = 0.5) -> None:
        if (
            isinstance(ghost_capacity, bool)
            or not isinstance(ghost_capacity, int)
            or ghost_capacity < 0
        ):
            raise ValueError(f"ghost_capacity must be an int >= 0, got {ghost_capacity!r}")
        if isinstance(initial_recency_share, bool) or not (
            isinstance(initial_recency_share, (int, float)) and 0 <= initial_recency_share <= 1
        ):
            raise ValueError(
                f"initial_recency_share must lie in [0, 1], got {initial_recency_share!r}"
            )
        self._ghost_capacity = ghost_capacity
        self._initial_share = float(initial_recency_share)
        self._recency_share = self._initial_share  # ARC's p, as a share of tracked leaves
        self._t1: SortedList = SortedList()  # (last access, block ID) of leaves used once
        self._t2: SortedList = SortedList()  # (last access, block ID) of leaves used again
        self._key_of: dict[int, tuple[int, int]] = {}  # tracked block ID -> its key
        self._in_t2: dict[int, bool] = {}  # tracked block ID -> whether it sits in T2
        # block ID -> (hash, hand-outs last seen, frequent), tracked or out for a hit.
        self._stays: dict[int, tuple[int, int, bool]] = {}
        self._b1: LinkedMap[None] = LinkedMap()  # hashes evicted from T1, oldest first
        self._b2: LinkedMap[None] = LinkedMap()  # hashes evicted from T2, oldest first

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        """Track ``block_id`` in T1 or T2, adapting ``p`` on a ghost hit. Complexity: O(log n)."""
        stay = self._stays.get(block_id)
        frequent, ghosts, share = self._goes_to_t2(stay, block_hash, num_accesses)
        ghost = self._take_ghost(ghosts, block_hash, share)
        self._stays[block_id] = (block_hash, num_accesses, frequent)
        self._place(block_id, last_access, frequent)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._uninsert, block_id, stay, ghost))

    def _uninsert(
        self, block_id: int, stay: tuple[int, int, bool] | None, ghost: _Ghost | None
    ) -> None:
        """Take an insert back: untrack, the stay as before, a ghost hit undone."""
        self._remove(block_id)
        if stay is None:
            del self._stays[block_id]
        else:
            self._stays[block_id] = stay
        if ghost is not None:
            ghosts, block_hash, link, self._recency_share = ghost
            ghosts.relink(block_hash, link)

    def _goes_to_t2(
        self, stay: tuple[int, int, bool] | None, block_hash: int, num_accesses: int
    ) -> tuple[bool, LinkedMap[None] | None, float]:
        """Whether inserting the leaf puts it on T2, the ghost list holding its hash (None: no
        ghost hit) and ``p`` after the hit. Changes nothing.

        T2 when its stay goes on (a hit) and it was frequent or handed out since, when it
        was handed out twice, or when its hash is a ghost.
        """
        if stay is not None and stay[0] == block_hash and stay[1] <= num_accesses:
            return stay[2] or num_accesses > stay[1], None, self._recency_share
        if num_accesses > 1:
            return True, None, self._recency_share
        ghosts, share = self._ghost_share(block_hash)
        return ghosts is not None, ghosts, share

    def _take_ghost(
        self, ghosts: LinkedMap[None] | None, block_hash: int, share: float
    ) -> _Ghost | None:
        """Apply a ghost hit :meth:`_goes_to_t2` found: ``p`` set to ``share``, the hash off
        ``ghosts``. Returns what puts it back (its list, the hash, its link, the old ``p``),
        or None if there was no hit."""
        if ghosts is None:
            return None
        link = ghosts.unlink(block_hash)
        assert link is not None
        ghost = (ghosts, block_hash, link, self._recency_share)
        self._recency_share = share
        return ghost

    def _ghost_share(self, block_hash: int) -> tuple[LinkedMap[None] | None, float]:
        """The ghost list holding ``block_hash`` (None: neither) and ``p`` after its hit.

        ARC's steps: ``max(1, |B2| / |B1|)`` up for B1, the reverse down for B2, over the
        tracked leaves. Changes nothing.
        """
        scale = max(len(self._key_of), 1)
        share = self._recency_share
        if block_hash in self._b1:
            step = max(1.0, len(self._b2) / len(self._b1))
            return self._b1, min(1.0, share + step / scale)
        if block_hash in self._b2:
            step = max(1.0, len(self._b1) / len(self._b2))
            return self._b2, max(0.0, share - step / scale)
        return None, share

    def _place(self, block_id: int, last_access: int, frequent: bool) -> None:
        key = (last_access, block_id)
        self._key_of[block_id] = key
        self._in_t2[block_id] = frequent
        (self._t2 if frequent else self._t1).add(key)

    def discard(self, block_id: int) -> None:
        """Stop tracking ``block_id``; its stay is remembered. Complexity: O(log n).

        Raises:
            KeyError: ``block_id`` is not tracked.
        """
        key, in_t2 = self._remove(block_id)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._put_back, block_id, key, in_t2))

    def _remove(self, block_id: int) -> tuple[tuple[int, int], bool]:
        """Untrack ``block_id``; return its key and whether it sat in T2."""
        key = self._key_of.pop(block_id)
        in_t2 = self._in_t2.pop(block_id)
        (self._t2 if in_t2 else self._t1).remove(key)
        return key, in_t2

    def _put_back(self, block_id: int, key: tuple[int, int], in_t2: bool) -> None:
        """Track ``block_id`` at ``key`` in its old list again."""
        self._key_of[block_id] = key
        self._in_t2[block_id] = in_t2
        (self._t2 if in_t2 else self._t1).add(key)

    def touch(self, block_id: int, now: int) -> None:
        """Record a use at ``now``: the leaf moves to T2. Complexity: O(log n).

        Raises:
            KeyError: ``block_id`` is not tracked.
        """
        key, in_t2 = self._remove(block_id)
        stay = self._stays[block_id]
        self._stays[block_id] = (stay[0], stay[1], True)
        self._place(block_id, now, True)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._untouch, block_id, key, in_t2, stay))

    def _untouch(
        self, block_id: int, key: tuple[int, int], in_t2: bool, stay: tuple[int, int, bool]
    ) -> None:
        self._remove(block_id)
        self._stays[block_id] = stay
        self._put_back(block_id, key, in_t2)

    def evict(self, num_blocks: int) -> list[int]:
        """Remove up to ``num_blocks`` leaves by ARC's rule. Complexity: O(k log n)."""
        victims: list[int] = []
        undo = self._txn_undo
        while len(victims) < num_blocks and self._key_of:
            t1_over_share = len(self._t1) > self._recency_share * len(self._key_of)
            from_t1 = bool(self._t1) and (t1_over_share or not self._t2)
            key = (self._t1 if from_t1 else self._t2).pop(0)
            block_id = key[1]
            del self._key_of[block_id], self._in_t2[block_id]
            stay = self._stays.pop(block_id)
            ghosts = self._b1 if from_t1 else self._b2
            remembered = self._remember(ghosts, stay[0])
            victims.append(block_id)
            if undo is not None:
                undo.append((self._unevict, key, not from_t1, stay, ghosts, remembered))
        return victims

    def _unevict(
        self,
        key: tuple[int, int],
        in_t2: bool,
        stay: tuple[int, int, bool],
        ghosts: LinkedMap[None],
        remembered: tuple[bool, tuple[int, list[Any]] | None],
    ) -> None:
        """Take an eviction back: the ghost entry as before, the victim in its list."""
        block_id = key[1]
        is_new, dropped = remembered
        if dropped is not None:
            ghosts.relink(*dropped)
        if is_new:
            ghosts.unlink(stay[0])
        self._stays[block_id] = stay
        self._put_back(block_id, key, in_t2)

    def _remember(
        self, ghosts: LinkedMap[None], block_hash: int
    ) -> tuple[bool, tuple[int, list[Any]] | None]:
        """Put ``block_hash`` on ``ghosts``; return whether it is new there and what was dropped."""
        if not self._ghost_capacity:
            return False, None
        is_new = block_hash not in ghosts
        ghosts.put(block_hash, None)
        dropped = ghosts.unlink_oldest() if len(ghosts) > self._ghost_capacity else None
        return is_new, dropped

    def evicts_first(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> bool:
        """Whether ``evict(1)`` would return ``block_id`` right after inserting it; if so, book it.

        The engine evicts a block this answers ``True`` for (the parent a chain
        eviction exposes) without the insert-and-evict round trip, so a ``True``
        answer makes every change that round trip would: a ghost hit taken (the
        hash off its list, ``p`` adapted), the stay ended, the hash remembered on
        the ghost list of the list the block would have left. The tracked leaves
        and their order never change; the changes are in the undo log like every
        other. ``False`` changes nothing. Complexity: O(log n).
        """
        stay = self._stays.get(block_id)
        frequent, ghosts, share = self._goes_to_t2(stay, block_hash, num_accesses)
        # evict's rule with the block tracked: T1 goes first while over its share, or alone.
        t1, t2 = self._t1, self._t2
        tracked = len(self._key_of) + 1
        if frequent:
            if (t1 and len(t1) > share * tracked) or (t2 and t2[0] < (last_access, block_id)):
                return False
        elif not (len(t1) + 1 > share * tracked or not t2) or (
            t1 and t1[0] < (last_access, block_id)
        ):
            return False
        ghost = self._take_ghost(ghosts, block_hash, share)  # the ghost hit insert takes
        if stay is not None:
            del self._stays[block_id]
        target = self._b2 if frequent else self._b1
        remembered = self._remember(target, block_hash)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._unbook, block_id, block_hash, stay, ghost, target, remembered))
        return True

    def _unbook(
        self,
        block_id: int,
        block_hash: int,
        stay: tuple[int, int, bool] | None,
        ghost: tuple[LinkedMap[None], int, list[Any] | None, float] | None,
        target: LinkedMap[None],
        remembered: tuple[bool, tuple[int, list[Any]] | None],
    ) -> None:
        """Take back what :meth:`evicts_first` booked, last change first."""
        is_new, dropped = remembered
        if dropped is not None:
            target.relink(*dropped)
        if is_new:
            target.unlink(block_hash)
        if stay is not None:
            self._stays[block_id] = stay
        if ghost is not None:
            ghosts, _, link, self._recency_share = ghost
            assert link is not None
            ghosts.relink(block_hash, link)

    def clear(self) -> None:
        """Forget every tracked leaf, stay and ghost. Complexity: O(n)."""
        self._t1.clear()
        self._t2.clear()
        self._key_of.clear()
        self._in_t2.clear()
        self._stays.clear()
        self._b1.clear()
        self._b2.clear()
        self._recency_share = self._initial_share
        self._txn_undo = None

    @property
    def recency_share(self) -> float:
        """ARC's adapted target ``p``: the share of tracked leaves kept for T1."""
        return self._recency_share

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._key_of
