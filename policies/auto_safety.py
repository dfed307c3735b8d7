"""``auto``'s safety net: plain LRU simulated beside it, and a hand-over when LRU leads.

Why: the duels compare the experts only where they disagree and only until a
duel expires, so an expert can lose to LRU in ways no duel sees (reuse gaps
longer than the duel window: the chat families at large capacity). The net
measures what the bound is about directly: it replays plain LRU over the same
stream of uses, in a *shadow* that holds hashes only (as many as the real
cache holds blocks), and compares the shadow's hits with ``auto``'s real hits,
use for use:

- a registration (:meth:`on_register`) is a real miss: ``+1`` for LRU if the
  shadow holds the hash (LRU would have hit);
- a hit (:meth:`on_hit`: every block of the matched prefix) is a real hit:
  ``-1`` for LRU if the shadow lacks the hash (LRU would have missed).

Uses on which both hit or both miss count nothing. ``gap`` (LRU's lead) and
``volume`` (the uses counted) decay with the charges' half-life (the policy's
``_weight`` clock). The net hands eviction to the ``lru`` expert when
``gap`` >= 1 miss and ``gap > safety_z x sqrt(volume)`` (a one-sided
sequential test: under "auto is no worse than LRU" each counted use is a +-1
of mean <= 0, so at one look the gap exceeds ``safety_z`` standard
deviations by chance with probability about ``1 - Phi(safety_z)``; looking at
every eviction raises that, which the hold below limits the cost of). A trip
resets the gap and volume to 0 and holds eviction for 1 x pool registered
blocks; then ``auto``'s leader evicts again and the test starts afresh.

Bound: while ``auto`` evicts by its own leader, its decayed deficit against the
shadow stays under ``max(1, safety_z x sqrt(volume))`` misses, plus the uses
of one step; ``volume`` is at most the uses in the window (half-life
``half_life_ratio`` x pool registrations, so at most about 1.44 x that many
decayed uses per registration), so the regret against LRU per window is
O(sqrt(uses per window)): a vanishing share of them as the window grows. Once
the net trips, ``auto`` evicts exactly as LRU does for the hold; what it can
still lose then is the turnover of the cache the other expert shaped (at most
one cache of misses a hold). A false trip costs at most one hold of LRU's
choices. What it is not: a bound against LRU's hits on the whole trace (the
window decays), nor exact where the hit stream is incomplete (an engine that
does not call :meth:`on_hit`: the net stays off there, see ``_sees_hits``).

Memory: per shadow entry a hash and a stamp (two 64-bit words), at most one
entry per cached block, plus a heap of (stamp, hash) pairs at most 2 x entries
+ 64 long: about 48 bytes per pool block in a native port. Integer and double
arithmetic only. A mixin of :class:`~prefixcache.policies.auto.AutoPolicy`;
every change is recorded with its inverse in the policy's undo log.
"""

from __future__ import annotations

import heapq
import math
from typing import Any


class LruShadow:
    """Plain LRU over the uses, by hash, and LRU's decayed lead (see the module)."""

    _safety_z: float
    _safety_on: bool  # False: the net never trips (the shadow is still kept)
    _sees_hits: bool  # on_hit was called: the shadow sees every use
    _shadow: dict[int, int]  # hash -> stamp of its last use
    _shadow_heap: list[tuple[int, int]]  # (stamp, hash), some stale
    _shadow_stamp: int  # never taken back: a stale heap entry must stay stale
    _shadow_size: int  # the most hashes the shadow holds: registered minus evicted blocks
    _net: tuple[float, float]  # (gap, volume), in units of _weight
    _fallback: bool  # eviction is handed to the lru expert
    _registered: int  # blocks registered since clear: the hold's clock
    _hold_until: int  # while _fallback: _registered at which eviction is given back
    _pool: int
    _hold_ratio: float  # registered blocks per pool block that one trip holds eviction
    _weight: float
    _txn_undo: list[Any] | None

    def _clear_shadow(self) -> None:
        self._shadow = {}
        self._shadow_heap = []
        self._shadow_size = 1
        self._sees_hits = False
        self._net = (0.0, 0.0)
        self._fallback = False
        self._registered = 0
        self._hold_until = 0

    def _refresh(self, block_hash: int, undo: list[Any] | None) -> bool:
        """Use ``block_hash`` in the shadow (most recent now); whether the shadow held it."""
        shadow = self._shadow
        old = shadow.get(block_hash)
        self._shadow_stamp += 1
        stamp = self._shadow_stamp
        shadow[block_hash] = stamp
        heap = self._shadow_heap
        heapq.heappush(heap, (stamp, block_hash))
        if undo is not None:
            undo.append((self._unrefresh, block_hash, old))
        if old is None and len(shadow) > self._shadow_size:
            self._drop_oldest(undo)
        if len(heap) > 2 * len(shadow) + 64:
            self._shadow_heap = [(stamp, key) for key, stamp in shadow.items()]
            heapq.heapify(self._shadow_heap)
        return old is not None

    def _drop_oldest(self, undo: list[Any] | None) -> None:
        """Evict the least recently used hash from the shadow (it holds at least one)."""
        shadow, heap = self._shadow, self._shadow_heap
        while True:
            stamp, block_hash = heapq.heappop(heap)
            if shadow.get(block_hash) == stamp:
                break
        del shadow[block_hash]
        if undo is not None:
            undo.append((self._unrefresh, block_hash, stamp))

    def _unrefresh(self, block_hash: int, old: int | None) -> None:
        if old is None:
            del self._shadow[block_hash]
        else:
            self._shadow[block_hash] = old
            heapq.heappush(self._shadow_heap, (old, block_hash))

    def _resize_shadow(self, change: int, undo: list[Any] | None) -> None:
        """The real cache gained (registrations) or lost (evictions) ``change`` blocks.

        The shadow is as large as the real cache is now (in-use blocks
        included, as LRU's would be), so it drops its oldest hashes when the
        real cache shrinks. Complexity: O(1) amortised per dropped hash.
        """
        if undo is not None:
            undo.append((setattr, self, "_shadow_size", self._shadow_size))
        self._shadow_size = size = max(1, self._shadow_size + change)
        while len(self._shadow) > size:
            self._drop_oldest(undo)

    def _score(self, lru_lead: int, counted: int, undo: list[Any] | None) -> None:
        """Add ``lru_lead`` misses to LRU's lead over ``counted`` uses, weighted now."""
        if counted == 0:
            return
        if undo is not None:
            undo.append((setattr, self, "_net", self._net))
        weight, (gap, volume) = self._weight, self._net
        self._net = (gap + lru_lead * weight, volume + counted * weight)

    def _shadow_misses(self, block_hashes: list[int], undo: list[Any] | None) -> None:
        """A run of registrations (real misses): +1 for LRU per hash the shadow holds."""
        self._registered += len(block_hashes)
        if undo is not None:
            undo.append((setattr, self, "_registered", self._registered - len(block_hashes)))
        held = 0
        # Deepest first, so that the run's head ends most recent: LRU drops leaves first.
        for index in range(len(block_hashes) - 1, -1, -1):
            held += self._refresh(block_hashes[index], undo)
        self._score(held, held, undo)

    def on_hit(self, block_hashes: list[int]) -> None:
        """A request took the cached prefix ``block_hashes``: -1 for LRU per hash the shadow lacks.

        Complexity: O(len(block_hashes) log pool).
        """
        undo = self._txn_undo
        if not self._sees_hits:
            if undo is not None:
                undo.append((setattr, self, "_sees_hits", False))
            self._sees_hits = True
        missed = 0
        for index in range(len(block_hashes) - 1, -1, -1):  # leaf first: the root ends newest
            missed += not self._refresh(block_hashes[index], undo)
        self._score(-missed, missed, undo)

    def on_end(self, block_hashes: list[int]) -> None:
        """A conversation's end freed ``block_hashes``: LRU, told the same, frees them too.

        Without this the shadow kept those hashes and the real cache's lost
        room: a simulated LRU larger than the real cache, whose extra hits
        read as LRU's lead and tripped the net (multi_tenant_mix, test side,
        mid capacity: 17 trips instead of 1, 0.83 -> 0.77 of the optimum).

        Complexity: O(len(block_hashes)).
        """
        undo = self._txn_undo
        shadow = self._shadow
        for block_hash in block_hashes:
            stamp = shadow.pop(block_hash, None)
            if stamp is not None and undo is not None:
                undo.append((self._unrefresh, block_hash, stamp))
        self._resize_shadow(-len(block_hashes), undo)

    def _next_fallback(self) -> bool:
        """Whether the net holds eviction after this step (the test of the module). No change."""
        if not (self._safety_on and self._sees_hits):
            return False
        if self._fallback:
            return self._registered < self._hold_until
        gap, volume = self._net
        weight = self._weight
        return gap >= weight and gap > self._safety_z * math.sqrt(volume * weight)

    def _set_fallback(self, fallback: bool, undo: list[Any] | None) -> None:
        """Trip or release the net. Tripping starts a fresh test (the gap and volume go to 0)
        and holds eviction for 1 x pool registered blocks (a quarter of the charges' half-life:
        4 x pool held too long after a false trip, -0.018 on train documents at mid capacity)."""
        if fallback == self._fallback:
            return
        if undo is not None:
            undo.append((self._set_net_state, self._fallback, self._net, self._hold_until))
        self._fallback = fallback
        if fallback:
            self._net = (0.0, 0.0)
            self._hold_until = self._registered + max(1, int(self._hold_ratio * self._pool))

    def _set_net_state(self, fallback: bool, net: tuple[float, float], hold_until: int) -> None:
        self._fallback, self._net, self._hold_until = fallback, net, hold_until
