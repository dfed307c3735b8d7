"""ARC eviction (Megiddo and Modha, FAST 2003) adapted to the cached leaves of a prefix cache."""

from __future__ import annotations

from collections import OrderedDict

from sortedcontainers import SortedList


class ARCPolicy:
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

    retains_unreferenced = True

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
        self._b1: OrderedDict[int, None] = OrderedDict()  # hashes evicted from T1, oldest first
        self._b2: OrderedDict[int, None] = OrderedDict()  # hashes evicted from T2, oldest first

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        """Track ``block_id`` in T1 or T2, adapting ``p`` on a ghost hit. Complexity: O(log n)."""
        stay = self._stays.get(block_id)
        if stay is not None and stay[0] == block_hash and stay[1] <= num_accesses:
            frequent = stay[2] or num_accesses > stay[1]
        else:
            frequent = num_accesses > 1 or self._ghost_hit(block_hash)
        self._stays[block_id] = (block_hash, num_accesses, frequent)
        self._place(block_id, last_access, frequent)

    def _ghost_hit(self, block_hash: int) -> bool:
        """Adapt ``p`` if ``block_hash`` is a ghost and drop it from its list; return if it was."""
        scale = max(len(self._key_of), 1)
        if block_hash in self._b1:
            step = max(1.0, len(self._b2) / len(self._b1))
            self._recency_share = min(1.0, self._recency_share + step / scale)
            del self._b1[block_hash]
            return True
        if block_hash in self._b2:
            step = max(1.0, len(self._b1) / len(self._b2))
            self._recency_share = max(0.0, self._recency_share - step / scale)
            del self._b2[block_hash]
            return True
        return False

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
        key = self._key_of.pop(block_id)
        (self._t2 if self._in_t2.pop(block_id) else self._t1).remove(key)

    def touch(self, block_id: int, now: int) -> None:
        """Record a use at ``now``: the leaf moves to T2. Complexity: O(log n).

        Raises:
            KeyError: ``block_id`` is not tracked.
        """
        self.discard(block_id)
        block_hash, num_accesses, _ = self._stays[block_id]
        self._stays[block_id] = (block_hash, num_accesses, True)
        self._place(block_id, now, True)

    def evict(self, num_blocks: int) -> list[int]:
        """Remove up to ``num_blocks`` leaves by ARC's rule. Complexity: O(k log n)."""
        victims: list[int] = []
        while len(victims) < num_blocks and self._key_of:
            t1_over_share = len(self._t1) > self._recency_share * len(self._key_of)
            from_t1 = bool(self._t1) and (t1_over_share or not self._t2)
            _, block_id = (self._t1 if from_t1 else self._t2).pop(0)
            del self._key_of[block_id], self._in_t2[block_id]
            block_hash = self._stays.pop(block_id)[0]
            self._remember(self._b1 if from_t1 else self._b2, block_hash)
            victims.append(block_id)
        return victims

    def _remember(self, ghosts: OrderedDict[int, None], block_hash: int) -> None:
        if self._ghost_capacity:
            ghosts[block_hash] = None
            if len(ghosts) > self._ghost_capacity:
                ghosts.popitem(last=False)

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

    @property
    def recency_share(self) -> float:
        """ARC's adapted target ``p``: the share of tracked leaves kept for T1."""
        return self._recency_share

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._key_of
