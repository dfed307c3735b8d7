"""S3-FIFO eviction (Yang et al., SOSP 2023) over the cached leaves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixcache.policies.base import EvictionPolicy
from prefixcache.policies.linked_map import LinkedMap
from sortedcontainers import SortedList

_MAX_FREQUENCY = 3  # S3-FIFO's two-bit counter


@dataclass(slots=True)
class _Stay:
    """One block's stay in the cache; kept while it is out of the policy for a hit.

    Attributes:
        block_hash: the hash the block holds during this stay.
        key: its queue place (entry clock, sequence number, block ID).
        in_main: whether the place is in the main queue (else the small one).
        frequency: reuses since the block entered its queue, capped at 3.
        num_accesses: the allocator's hand-out count last seen, to count new hits.
    """

    block_hash: int
    key: tuple[int, int, int]
    in_main: bool
    frequency: int
    num_accesses: int


class S3FIFOPolicy(EvictionPolicy):
    """Small and main FIFO queues with a ghost list of recently evicted hashes.

    New blocks enter the small queue, which holds about ``small_fraction``
    of the tracked leaves. Most blocks used once leave from there quickly and
    their hashes go to the ghost list; a block reused while in the small
    queue moves to the main queue when it reaches the head. A block whose
    hash is on the ghost list when it comes back enters main directly. Main
    is a FIFO with second chances: a head block reused since it was queued
    goes to the back with one reuse fewer (at most three), otherwise it is
    evicted. So one-hit blocks are filtered out fast while reused prefixes
    stay, and no access ever reorders a queue (hits only bump a counter).

    Mapping to the allocator's protocol: a prefix hit discards the block and
    its release inserts it again; the policy remembers the stay by block ID
    (bounded by the pool) and recognises the return by the same hash and a
    hand-out count that did not drop, so the block keeps its queue place and
    the new hand-outs count as reuses. A block first seen with more than one
    hand-out (a parent exposed by evicting its child, hit before) starts
    with that many reuses. A :meth:`touch` is a reuse. Queue places are clock
    values, so an exposed parent takes the place of its own last hand-out.

    The ghost list holds hashes only, never blocks; it keeps the most recent
    ``ghost_capacity`` of them.

    Transactions: each change is recorded with what it replaced (a stay, a
    ghost removed in place, the queue moves an eviction made before its
    victim, the clocks), so an abort restores all of it: an evicted leaf
    put back returns to its old queue place with its old count, and its
    ghost goes.

    >>> policy = S3FIFOPolicy()
    >>> policy.insert(1, block_hash=10, last_access=1, num_accesses=1, depth=0)
    >>> policy.evict(1)
    [1]
    >>> policy.insert(2, block_hash=10, last_access=5, num_accesses=1, depth=0)
    >>> policy.insert(3, block_hash=30, last_access=6, num_accesses=1, depth=0)
    >>> policy.evict(1)  # block 2 came back from the ghost list into main
    [3]

    Args:
        small_fraction: share of the tracked leaves the small queue holds
            before it must give up a block, in ``(0, 1)``.
        ghost_capacity: hashes kept on the ghost list (>= 0).
        promote_after: reuses in the small queue that earn a block its move
            to main (>= 1).

    Raises:
        ValueError: an argument is out of range.

    Complexity: ``insert``, ``discard`` and ``touch`` O(log n); ``evict(k)``
    amortised O(k log n) (each re-queue spends a reuse that an earlier event
    paid for). Memory: O(pool size + ghost_capacity). Not thread-safe.
    """

    def __init__(
        self, small_fraction: float = 0.1, ghost_capacity: int = 50_000, promote_after: int = 1
    ) -> None:
        if isinstance(small_fraction, bool) or not (
            isinstance(small_fraction, (int, float)) and 0 < small_fraction < 1
        ):
            raise ValueError(f"small_fraction must lie in (0, 1), got {small_fraction!r}")
        for name, value, minimum in (
            ("ghost_capacity", ghost_capacity, 0),
            ("promote_after", promote_after, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        self._small_fraction = float(small_fraction)
        self._ghost_capacity = ghost_capacity
        self._promote_after = promote_after
        self._small: SortedList = SortedList()  # keys of tracked leaves in the small queue
        self._main: SortedList = SortedList()  # keys of tracked leaves in the main queue
        self._tracked: set[int] = set()
        self._stays: dict[int, _Stay] = {}  # block ID -> its stay, tracked or out for a hit
        self._ghost: LinkedMap[None] = LinkedMap()  # evicted hashes, oldest first
        self._now = 0  # the largest clock value seen
        self._sequence = 0  # tie-break of equal clock values, in queueing order
        # In a transaction: (block ID, old key, old queue, old count) per queue move of the
        # current eviction.
        self._moves: list[tuple[int, tuple[int, int, int], bool, int]] = []

    def _next_key(self, clock: int, block_id: int) -> tuple[int, int, int]:
        self._sequence += 1
        return (clock, self._sequence, block_id)

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        """Queue ``block_id``: back to its old place, to main if a ghost, else small.

        Complexity: O(log n).
        """
        stay = self._stays.get(block_id)
        previous, counts = stay, None  # what the insert replaces or changes
        now, sequence, ghost = self._now, self._sequence, None
        self._now = max(now, last_access)
        if stay is None or stay.block_hash != block_hash or stay.num_accesses > num_accesses:
            ghost = self._ghost.unlink(block_hash)
            in_main = ghost is not None
            reuses = 0 if in_main else num_accesses - 1
            stay = _Stay(
                block_hash,
                self._next_key(last_access, block_id),
                in_main,
                min(reuses, _MAX_FREQUENCY),
                num_accesses,
            )
            self._stays[block_id] = stay
        else:
            counts = (stay.frequency, stay.num_accesses)
            reuses = num_accesses - stay.num_accesses
            stay.frequency = min(stay.frequency + reuses, _MAX_FREQUENCY)
            stay.num_accesses = num_accesses
        self._tracked.add(block_id)
        (self._main if stay.in_main else self._small).add(stay.key)
        undo = self._txn_undo
        if undo is not None:
            ghost_hit = None if ghost is None else (block_hash, ghost)
            undo.append((self._uninsert, block_id, now, sequence, previous, counts, ghost_hit))

    def _uninsert(
        self,
        block_id: int,
        now: int,
        sequence: int,
        previous: _Stay | None,
        counts: tuple[int, int] | None,
        ghost_hit: tuple[int, list[Any]] | None,
    ) -> None:
        """Take an insert back: untrack, the clocks and the stay as before, the ghost back."""
        self._untrack(block_id)
        self._now, self._sequence = now, sequence
        if counts is not None:  # the stay came back and was updated in place
            assert previous is not None
            previous.frequency, previous.num_accesses = counts
        elif previous is None:
            del self._stays[block_id]
        else:
            self._stays[block_id] = previous
        if ghost_hit is not None:
            self._ghost.relink(*ghost_hit)

    def discard(self, block_id: int) -> None:
        """Stop tracking ``block_id``; its stay is remembered. Complexity: O(log n).

        Raises:
            KeyError: ``block_id`` is not tracked.
        """
        if block_id not in self._tracked:
            raise KeyError(block_id)
        self._untrack(block_id)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._track, block_id))

    def _untrack(self, block_id: int) -> None:
        stay = self._stays[block_id]
        (self._main if stay.in_main else self._small).remove(stay.key)
        self._tracked.remove(block_id)

    def _track(self, block_id: int) -> None:
        stay = self._stays[block_id]
        (self._main if stay.in_main else self._small).add(stay.key)
        self._tracked.add(block_id)

    def touch(self, block_id: int, now: int) -> None:
        """Count a reuse; nothing moves. Raises KeyError if untracked. Complexity: O(1)."""
        if block_id not in self._tracked:
            raise KeyError(block_id)
        stay = self._stays[block_id]
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._untouch, stay, self._now, stay.frequency))
        self._now = max(self._now, now)
        stay.frequency = min(stay.frequency + 1, _MAX_FREQUENCY)

    def _untouch(self, stay: _Stay, now: int, frequency: int) -> None:
        self._now, stay.frequency = now, frequency

    def evict(self, num_blocks: int) -> list[int]:
        """Remove up to ``num_blocks`` leaves by the S3-FIFO rules.

        Complexity: amortised O(k log n).
        """
        victims: list[int] = []
        sequence = self._sequence
        while len(victims) < num_blocks and self._tracked:
            if not self._moves:
                sequence = self._sequence
            small_is_full = len(self._small) > self._small_fraction * len(self._tracked)
            if self._small and (small_is_full or not self._main):
                victim = self._pop_small()
            else:
                victim = self._pop_main()
            if victim is not None:
                victims.append(victim[0])
                undo = self._txn_undo
                if undo is not None:
                    undo.append((self._unevict, *victim, self._moves, sequence))
                    self._moves = []
        return victims

    def _unevict(
        self,
        block_id: int,
        stay: _Stay,
        ghost: tuple[bool, tuple[int, list[Any]] | None] | None,
        moves: list[tuple[int, tuple[int, int, int], bool, int]],
        sequence: int,
    ) -> None:
        """Take an eviction back: the ghost entry, the victim, then the queue moves before it."""
        self._sequence = sequence
        if ghost is not None:
            is_new, dropped = ghost
            if dropped is not None:
                self._ghost.relink(*dropped)
            if is_new:
                self._ghost.unlink(stay.block_hash)
        self._stays[block_id] = stay
        self._track(block_id)
        for moved_id, key, in_main, frequency in reversed(moves):
            moved = self._stays[moved_id]
            self._main.remove(moved.key)
            moved.key, moved.in_main, moved.frequency = key, in_main, frequency
            (self._main if in_main else self._small).add(key)

    def _pop_small(self) -> tuple[int, _Stay, Any] | None:
        """Evict the small queue's head to the ghost list, or move it to main if reused.

        Returns the victim, its stay and what its ghost entry changed; None after a move.
        """
        _, _, block_id = self._small.pop(0)
        stay = self._stays[block_id]
        if stay.frequency >= self._promote_after:
            self._move(block_id, stay, True, 0)
            return None
        self._forget(block_id)
        ghost: tuple[bool, tuple[int, list[Any]] | None] | None = None
        if self._ghost_capacity:
            ghost = stay.block_hash not in self._ghost, None
            self._ghost.put(stay.block_hash, None)
            if len(self._ghost) > self._ghost_capacity:
                ghost = ghost[0], self._ghost.unlink_oldest()
        return block_id, stay, ghost

    def _pop_main(self) -> tuple[int, _Stay, Any] | None:
        """Evict the main queue's head, or give it a second chance if reused."""
        _, _, block_id = self._main.pop(0)
        stay = self._stays[block_id]
        if stay.frequency:
            self._move(block_id, stay, True, stay.frequency - 1)
            return None
        self._forget(block_id)
        return block_id, stay, None

    def _move(self, block_id: int, stay: _Stay, in_main: bool, frequency: int) -> None:
        """Queue a popped head again at the back of main, noting the move in a transaction."""
        if self._txn_undo is not None:
            self._moves.append((block_id, stay.key, stay.in_main, stay.frequency))
        stay.in_main, stay.frequency = in_main, frequency
        stay.key = self._next_key(self._now, block_id)
        self._main.add(stay.key)

    def _forget(self, block_id: int) -> None:
        self._tracked.remove(block_id)
        del self._stays[block_id]

    def clear(self) -> None:
        """Forget every tracked leaf, stay and ghost. Complexity: O(n)."""
        self._small.clear()
        self._main.clear()
        self._tracked.clear()
        self._stays.clear()
        self._ghost.clear()
        self._now = self._sequence = 0
        self._moves = []
        self._txn_undo = None

    def __len__(self) -> int:
        return len(self._tracked)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._tracked
