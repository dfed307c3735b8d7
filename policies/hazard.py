"""Eviction by a learned reuse hazard: the chance a leaf is reused within a few cache lifetimes."""

from __future__ import annotations

import heapq
from dataclasses import replace
from typing import Any

from prefixcache.policies.base import EvictionPolicy
from prefixcache.policies.hazard_learning import NUM_CLASSES, HazardLearning, Stay, class_of
from prefixcache.policies.linked_map import LinkedMap


class HazardPolicy(HazardLearning, EvictionPolicy):
    """Evicts the leaf least likely to be reused within the next cache lifetime.

    Blocks fall into classes by how often their prefix was used (1, 2, 3-4,
    5+ hand-outs, counted across evictions by hash) and by their depth in the
    chain (log2 buckets). For each class the policy learns online the
    distribution of *reuse ages*, the idle time between a use and the next
    one, from hits on cached leaves and from hashes that come back after
    eviction (a bounded history of evicted hashes). With ``n`` blocks that
    entered the class and ``R(a, b)`` reuses seen at ages in ``[a, b)``, a
    leaf idle for ``a`` ticks scores

        ``R(a, a + W) / (n - R(0, a))``

    the empirical hazard of being reused within ``W`` (``window`` cache
    lifetimes, a lifetime being the running mean idle age of victims), given
    it was not reused so far.
    Blocks that are never reused stay in the denominator, so a class of
    one-off documents scores near zero while a class of shared prefixes or
    chat turns whose reuse comes back after a long but regular gap scores
    high exactly around that gap. The lowest score is evicted, ties going to
    the oldest leaf. A few pseudo-events of the pooled statistics of all
    classes smooth a class that has seen little; with no statistics at all
    the order is LRU.

    The victim is chosen among the oldest leaf of each class (a per-class
    LRU heap), so the cost per eviction is bounded by the number of classes
    (32), a constant. Counts decay with a half-life of ``half_life`` events,
    so the policy follows a workload that changes.

    Mapping to the allocator's protocol: a hit discards the block and its
    release inserts it again with a larger hand-out count; the policy
    remembers the stay by block ID (bounded by the pool) and records the
    reuse at the age since the previous access. What it uses:
    ``last_access``, ``num_accesses``, ``depth`` and ``block_hash``.

    What it uses the registration hook for (:meth:`on_register`): an evicted
    hash registered again is a reuse of its prefix, and most such returns are
    inner blocks of a longer request, which become leaves late or never.
    Without the hook their reuses are learned late or not at all, and reuse
    chances of multi-turn chains come out too low. The hook records the reuse
    when the hash is registered (its age measured against the latest clock
    seen, as the hook carries none) and keeps the earlier use count by hash
    (bounded like the history) until the block is inserted.

    Transactions: each change is recorded with what it replaced (a stay,
    history entries removed in place, the learned counts, and the score
    tables when it refreshed them), so an abort restores all of it, what
    :meth:`on_register` learned included. Outside a transaction nothing of
    that is kept.

    >>> policy = HazardPolicy()
    >>> policy.insert(1, block_hash=10, last_access=1, num_accesses=1, depth=0)
    >>> policy.insert(2, block_hash=20, last_access=2, num_accesses=1, depth=0)
    >>> policy.evict(1)  # nothing learned yet: LRU
    [1]

    Args:
        history_capacity: evicted hashes whose use counts and last access are
            kept, so a returning prefix is recognised (>= 0).
        half_life: events (inserts, hits, evictions) after which learned
            counts weigh half (>= 1).
        prior_weight: pseudo-events of the pooled statistics added to each
            class (> 0).
        age_smoothing: weight of the newest victim in the running cache
            lifetime, in ``(0, 1]``.
        window: the horizon ``W`` in cache lifetimes (> 0).

    Raises:
        ValueError: an argument is out of range.

    Complexity: ``insert``, ``discard`` and ``touch`` O(log n) amortised;
    ``evict(k)`` O(k (C + log n)) amortised with C = 32 classes; every 256
    events an O(C x 128) refresh of the score tables; ``on_register`` O(1) per
    hash. Memory: O(pool size + history_capacity). Not thread-safe.
    """

    # Set by clear(), which __init__ calls.
    _heaps: list[list[tuple[int, int, int]]]
    _now: int
    _events: int

    def __init__(
        self,
        history_capacity: int = 100_000,
        half_life: int = 200_000,
        prior_weight: float = 8.0,
        age_smoothing: float = 0.01,
        window: float = 4.0,
    ) -> None:
        for name, value, minimum in (
            ("history_capacity", history_capacity, 0),
            ("half_life", half_life, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        if isinstance(prior_weight, bool) or not (
            isinstance(prior_weight, (int, float)) and prior_weight > 0
        ):
            raise ValueError(f"prior_weight must be a number > 0, got {prior_weight!r}")
        if isinstance(age_smoothing, bool) or not (
            isinstance(age_smoothing, (int, float)) and 0 < age_smoothing <= 1
        ):
            raise ValueError(f"age_smoothing must lie in (0, 1], got {age_smoothing!r}")
        if isinstance(window, bool) or not (isinstance(window, (int, float)) and window > 0):
            raise ValueError(f"window must be a number > 0, got {window!r}")
        self._history_capacity = history_capacity
        self._window = float(window)
        self._decay = 0.5 ** (self._REFRESH_EVENTS / half_life)
        self._prior_weight = float(prior_weight)
        self._smoothing = float(age_smoothing)
        self.clear()

    # -- protocol -----------------------------------------------------------------

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        """Track ``block_id``, learning from a hit or a returning hash. Complexity: O(log n)."""
        undo = self._txn_undo
        now, events = self._now, self._events
        learned: list[Any] | None = None if undo is None else []
        links: list[tuple[LinkedMap[Any], int, list[Any]]] = []
        self._now = max(now, last_access)
        stay = self._stays.get(block_id)
        old_stay = stay
        if stay is not None and stay.block_hash == block_hash and stay.num_accesses <= num_accesses:
            if undo is not None:
                old_stay = replace(stay)
            new_uses = num_accesses - stay.num_accesses
            if new_uses:
                self._record_reuse(stay.klass, last_access - stay.last_access, learned)
                stay.num_uses += new_uses
                stay.num_accesses = num_accesses
                stay.klass = class_of(stay.num_uses, depth)
                self._enter(stay.klass, learned)
            stay.last_access = last_access
        else:
            num_uses = num_accesses
            returned = self._returned.unlink(block_hash)
            if returned is not None:  # its reuse was recorded at registration
                links.append((self._returned, block_hash, returned))
                num_uses += returned[2]
            elif (ghost := self._history.unlink(block_hash)) is not None:
                links.append((self._history, block_hash, ghost))
                earlier_uses, earlier_access, earlier_class = ghost[2]
                self._record_reuse(earlier_class, last_access - earlier_access, learned)
                num_uses += earlier_uses
            klass = class_of(num_uses, depth)
            stay = Stay(block_hash, num_accesses, num_uses, depth, last_access, klass)
            self._stays[block_id] = stay
            self._enter(klass, learned)
        self._push(block_id, stay)
        if undo is not None:
            undo.append((self._uninsert, block_id, old_stay, now, events, learned, links))

    def _uninsert(
        self,
        block_id: int,
        stay: Stay | None,
        now: int,
        events: int,
        learned: list[Any],
        links: list[tuple[LinkedMap[Any], int, list[Any]]],
    ) -> None:
        """Take an insert back: untrack, the stay, clock and counts as before, entries back."""
        del self._tracked[block_id]
        self._now = now
        if stay is None:
            del self._stays[block_id]
        else:
            self._stays[block_id] = stay
        self._unlearn(learned, events)
        for ghosts, block_hash, link in links:
            ghosts.relink(block_hash, link)

    def on_register(self, block_hashes: list[int], first_depth: int) -> None:
        """Learn the reuse of every remembered hash that was just registered again.

        The reuse is recorded in the class the hash was evicted from, and its
        earlier use count is kept for the insert of its block.

        Args:
            block_hashes: one run of newly registered hashes (not kept).
            first_depth: chain position of the first; not used.

        Complexity: O(len(block_hashes)).
        """
        undo = self._txn_undo
        returned = self._returned
        for block_hash in block_hashes:
            ghost = self._history.unlink(block_hash)
            if ghost is None:
                continue
            earlier_uses, earlier_access, earlier_class = ghost[2]
            learned: list[Any] | None = None if undo is None else []
            self._record_reuse(earlier_class, self._now - earlier_access, learned)
            old = returned.get(block_hash)  # None: not there
            returned.put(block_hash, earlier_uses)
            dropped = returned.unlink_oldest() if len(returned) > self._history_capacity else None
            if undo is not None:
                undo.append((self._unregister, block_hash, ghost, learned, old, dropped))

    def _unregister(
        self,
        block_hash: int,
        ghost: list[Any],
        learned: list[Any],
        old: int | None,
        dropped: tuple[int, list[Any]] | None,
    ) -> None:
        """Take back what :meth:`on_register` did for ``block_hash``."""
        if dropped is not None:
            self._returned.relink(*dropped)
        if old is None:
            self._returned.unlink(block_hash)
        else:
            self._returned.put(block_hash, old)
        self._unlearn(learned, self._events)
        self._history.relink(block_hash, ghost)

    def _push(self, block_id: int, stay: Stay) -> None:
        key = (stay.last_access, -stay.depth, block_id)
        self._tracked[block_id] = key
        heapq.heappush(self._heaps[stay.klass], key)
        self._num_keys += 1
        if self._num_keys > 2 * len(self._tracked) + 64:
            self._compact()

    def _compact(self) -> None:
        """Drop stale heap keys so memory stays O(tracked leaves). O(n)."""
        self._heaps = [[] for _ in self._heaps]
        for block_id, key in self._tracked.items():
            self._heaps[self._stays[block_id].klass].append(key)
        for heap in self._heaps:
            heapq.heapify(heap)
        self._num_keys = len(self._tracked)

    def discard(self, block_id: int) -> None:
        """Stop tracking ``block_id``; its stay is remembered. Complexity: O(1) amortised.

        Raises:
            KeyError: ``block_id`` is not tracked.
        """
        del self._tracked[block_id]
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._retrack, block_id))

    def _retrack(self, block_id: int) -> None:
        """Track ``block_id`` again at the key its stay gives (the inverse of a discard)."""
        self._push(block_id, self._stays[block_id])

    def touch(self, block_id: int, now: int) -> None:
        """Record a reuse at ``now``. Complexity: O(log n) amortised.

        Raises:
            KeyError: ``block_id`` is not tracked.
        """
        del self._tracked[block_id]
        stay = self._stays[block_id]
        undo = self._txn_undo
        learned: list[Any] | None = None
        if undo is not None:
            learned = []
            undo.append((self._untouch, block_id, replace(stay), self._now, self._events, learned))
        self._now = max(self._now, now)
        self._record_reuse(stay.klass, now - stay.last_access, learned)
        stay.num_uses += 1
        stay.last_access = now
        stay.klass = class_of(stay.num_uses, stay.depth)
        self._enter(stay.klass, learned)
        self._push(block_id, stay)

    def _untouch(
        self, block_id: int, stay: Stay, now: int, events: int, learned: list[Any]
    ) -> None:
        del self._tracked[block_id]
        self._stays[block_id] = stay
        self._now = now
        self._unlearn(learned, events)
        self._push(block_id, stay)

    def evict(self, num_blocks: int) -> list[int]:
        """Remove up to ``num_blocks`` leaves, lowest hazard first.

        Complexity: O(k (C + log n)) amortised.
        """
        victims: list[int] = []
        while len(victims) < num_blocks and self._tracked:
            best: tuple[float, tuple[int, int, int], int] | None = None
            for klass, heap in enumerate(self._heaps):
                while heap and not self._is_live(heap[0], klass):
                    heapq.heappop(heap)  # a stale key: discarded or moved since
                    self._num_keys -= 1
                if heap:
                    key = heap[0]
                    candidate = (self._score(klass, self._now - key[0]), key, klass)
                    if best is None or candidate < best:
                        best = candidate
            assert best is not None  # some heap holds a live key while anything is tracked
            _, key, klass = best
            heapq.heappop(self._heaps[klass])
            self._num_keys -= 1
            victims.append(self._forget(key))
        return victims

    def _is_live(self, key: tuple[int, int, int], klass: int) -> bool:
        """Whether ``key`` in the heap of ``klass`` is its block's current key.

        The class is checked too: a leaf discarded and inserted again with the
        same arguments gets the same key, maybe in another class, and its old
        entry must not pass for current there.
        """
        block_id = key[2]
        return self._tracked.get(block_id) == key and self._stays[block_id].klass == klass

    def _forget(self, key: tuple[int, int, int]) -> int:
        last_access, _, block_id = key
        del self._tracked[block_id]
        stay = self._stays.pop(block_id)
        undo = self._txn_undo
        lifetime, events = self._lifetime, self._events
        learned: list[Any] | None = None if undo is None else []
        self._lifetime += (self._now - last_access - lifetime) * self._smoothing
        history = None
        if self._history_capacity:
            old = self._history.get(stay.block_hash)  # None: not there
            self._history.put(stay.block_hash, (stay.num_uses, stay.last_access, stay.klass))
            dropped = None
            if len(self._history) > self._history_capacity:
                dropped = self._history.unlink_oldest()
            history = (old, dropped)
        self._tick(learned)
        if undo is not None:
            undo.append((self._unevict, block_id, stay, lifetime, events, learned, history))
        return block_id

    def _unevict(
        self,
        block_id: int,
        stay: Stay,
        lifetime: float,
        events: int,
        learned: list[Any],
        history: tuple[Any, tuple[int, list[Any]] | None] | None,
    ) -> None:
        """Take an eviction back: counts, lifetime and history as before, the victim tracked."""
        self._lifetime = lifetime
        self._unlearn(learned, events)
        if history is not None:
            old, dropped = history
            if dropped is not None:
                self._history.relink(*dropped)
            if old is None:
                self._history.unlink(stay.block_hash)
            else:
                self._history.put(stay.block_hash, old)
        self._stays[block_id] = stay
        self._push(block_id, stay)

    def clear(self) -> None:
        """Forget every tracked leaf, stay, history and statistic. Complexity: O(n)."""
        self._heaps = [[] for _ in range(NUM_CLASSES)]
        self._tracked: dict[int, tuple[int, int, int]] = {}  # block ID -> live heap key
        self._num_keys = 0  # heap entries, stale ones included
        self._stays: dict[int, Stay] = {}  # block ID -> stay, tracked or out for a hit
        # Evicted hash -> (uses, last access, class) of its last stay, oldest first.
        self._history: LinkedMap[tuple[int, int, int]] = LinkedMap()
        # Hash registered again after eviction -> uses of its earlier stays, until its
        # block is inserted; oldest first.
        self._returned: LinkedMap[int] = LinkedMap()
        self._clear_learning()
        self._now = 0
        self._txn_undo = None

    def __len__(self) -> int:
        return len(self._tracked)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._tracked
