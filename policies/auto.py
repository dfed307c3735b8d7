"""``auto``: an eviction policy that follows, online, whichever of two experts loses fewer hits."""

from __future__ import annotations

import heapq
import math
import random
from typing import Any

from prefixcache.policies.base import EvictionPolicy

EXPERTS = ("lru", "frequent")
"""The experts, by index: how each orders the tracked leaves (see :class:`AutoPolicy`)."""

_ROWS = 4  # count-min sketch rows
_MAX_COUNT = 15  # sketch counters saturate here (4 bits' worth, as in TinyLFU)
_FREQUENCY_CAP = 3  # "frequent" ranks by min(uses, 3): more classes made it worse on chat
_MIN_POOL = 64  # the pool estimate never goes below this (tiny pools, tests)
_MASK64 = (1 << 64) - 1
_HALVE = bytes(value >> 1 for value in range(256))  # bytearray.translate table: every count / 2

_Entry = tuple[Any, ...]
"""A tracked leaf: (version, then its heap key for each expert)."""


def _check_number(name: str, value: object, minimum: float, *, integer: bool = False) -> None:
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or float(value) < minimum:  # type: ignore[arg-type]
        kind = "an int" if integer else "a number"
        raise ValueError(f"{name} must be {kind} >= {minimum}, got {value!r}")


class AutoPolicy(EvictionPolicy):
    """Two experts order the leaves; the one whose choices lost fewest hits lately evicts.

    The experts (:data:`EXPERTS`), each a heap of keys over the same tracked leaves:

    - ``lru``: oldest last access first. Best where a first use predicts the
      next as well as a second does (multi-turn chat: every turn is extended).
    - ``frequent``: fewest uses first (counts capped at 3), LRU among equals.
      Its admission rule is W-TinyLFU's: a block used once is evicted before
      any reused one, so a scan of one-hit blocks cannot push reused
      prefixes out. Best on scans of one-off prompts (documents, the
      Mooncake trace) and on a Zipf mix of shared system prompts.

    Use counts live in a count-min sketch of the block hashes (4 rows of
    counters saturating at 15, conservative update, every count halved each
    ``sample_ratio`` x pool uses), so a prefix that was reused, evicted and
    computed again is still known as reused, in bounded memory. A use is a
    registration (:meth:`on_register`), a hand-out seen at :meth:`insert`
    or a :meth:`touch`.

    Choosing the expert (counterfactual duels): at each eviction both
    experts name a candidate and the leader's goes. Where they differ, a
    *duel* opens between the victim's hash and the kept candidate's hash;
    the first of the two to be used again (a hit on the kept leaf, or the
    victim's prefix registered again: a miss) shows which choice was wrong,
    and the expert that named that block is charged one miss. A duel not
    decided within ``duel_ratio`` x pool later duels is dropped. Charges
    decay with a half-life of ``half_life_ratio`` x pool registered blocks
    (each registration is, in a full cache, one eviction to come; counting
    registrations keeps the clock the same whether or not the engine took
    the :meth:`evicts_first` shortcut), lazily (see ``_age``). The lead
    passes to the other expert once its charge is one miss and ``1 -
    switch_margin`` times below the leader's, and the gap passes a
    sequential test: leader's minus challenger's > ``switch_z`` x the
    square root of their sum (the charges as counts of misses, the gap in
    standard deviations of a fair coin's). Switching costs, since the cache
    was shaped by the old leader, so a gap of a few duels that chance
    explains does not move the lead (on chats at 1,000 blocks a fixed 20%
    margin flipped the lead on noise and lost 0.011). ``frequent`` leads
    at first.
    Each duel compares one victim with one kept block, so an expert that
    evicts a whole chain while the other keeps naming one leaf is compared
    block for block, which keeps the charges unbiased toward either side.

    Bounded metadata, as fractions of the pool (estimated as the highest
    block ID seen + 1, at least 64): open duels <= ``duel_ratio`` x pool;
    sketch counters = 4 x the power of two >= ``sketch_ratio`` x pool, one
    byte each; stays <= the pool. :meth:`metadata` reports them.

    Transactions: every change is recorded with its inverse (the undo log of
    :class:`EvictionPolicy`): tracked entries, stays, duels (with the mark
    of the oldest), sketch counters, charges, the leader and the pool estimate.
    Heap entries are never taken back: an entry whose version is not its
    block's current one is stale and skipped.

    Deterministic: ``seed`` picks the sketch's hash multipliers; nothing else
    is random, and ties go to the lower block ID.

    >>> policy = AutoPolicy()
    >>> policy.insert(1, block_hash=10, last_access=1, num_accesses=2, depth=0)
    >>> policy.insert(2, block_hash=20, last_access=5, num_accesses=1, depth=0)
    >>> policy.evict(1)  # "frequent" leads: block 2, used once, goes first
    [2]
    >>> policy.leader
    'frequent'

    Args:
        seed: picks the sketch's hash functions (>= 0).
        duel_ratio: open duels per pool block (> 0).
        sketch_ratio: sketch width per pool block (> 0).
        sample_ratio: uses counted, per pool block, between two halvings of
            the sketch (> 0).
        half_life_ratio: half-life of the charges, in registered blocks per
            pool block (> 0).
        switch_margin: share by which a challenger's charge must be below
            the leader's, in ``[0, 1)``.
        switch_z: standard deviations the gap between the charges must
            exceed before the lead moves (>= 0; 0 turns the test off).

    Raises:
        ValueError: an argument is out of range.

    Chain evictions: :meth:`evicts_first` answers whether the leader would
    evict an exposed parent next and, if so, books that eviction (its new
    uses, its duel), so the engine skips the insert-and-evict round trip
    and the policy learns exactly what the round trip would have taught it
    (tests/policies/test_auto_evicts_first.py replays both ways).

    Complexity: ``insert``, ``touch`` O(log n) (two ``heapq`` pushes);
    ``discard`` O(1) amortised; ``evict(k)`` O(k log n) amortised;
    ``evicts_first`` O(1) amortised;
    ``on_register`` O(1) amortised per hash; a sketch halving O(pool) every
    ``sample_ratio`` x pool uses. Memory: O(pool). Not thread-safe.
    """

    # Set by clear(), which __init__ calls.
    _lru: list[tuple[int, int, int]]  # (last access, block ID, version), some stale
    _frequent: list[tuple[int, int, int, int]]  # (uses class, last access, ID, version)
    _tracked: dict[int, _Entry]  # block ID -> its live entry
    _stays: dict[int, tuple[int, int]]  # block ID -> (hash, hand-outs seen)
    _duels: dict[int, tuple[int, int, int, int]]  # open duels by ID
    _oldest: int  # no open duel has a lower ID
    _by_hash: dict[int, set[int]]
    _charges: tuple[float, float]  # in units of _weight (see _age)
    _weight: float
    _growth: float
    _leader: int
    _pool: int
    _width: int
    _sketch: bytearray
    _shift: int
    _added: int
    _sample: int
    _max_duels: int

    def __init__(
        self,
        seed: int = 0,
        duel_ratio: float = 1.0,
        sketch_ratio: float = 8.0,
        sample_ratio: float = 16.0,
        half_life_ratio: float = 4.0,
        switch_margin: float = 0.0,
        switch_z: float = 1.5,
    ) -> None:
        _check_number("seed", seed, 0, integer=True)
        for name, value in (
            ("duel_ratio", duel_ratio),
            ("sketch_ratio", sketch_ratio),
            ("sample_ratio", sample_ratio),
            ("half_life_ratio", half_life_ratio),
        ):
            _check_number(name, value, 0)
            if not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        _check_number("switch_margin", switch_margin, 0)
        _check_number("switch_z", switch_z, 0)
        if not switch_margin < 1:
            raise ValueError(f"switch_margin must lie in [0, 1), got {switch_margin!r}")
        self._seed = seed
        self._duel_ratio = float(duel_ratio)
        self._sketch_ratio = float(sketch_ratio)
        self._sample_ratio = float(sample_ratio)
        self._half_life_ratio = float(half_life_ratio)
        self._keep = 1.0 - float(switch_margin)
        self._z = float(switch_z)
        rng = random.Random(seed)
        self._multipliers = tuple(rng.getrandbits(64) | 1 for _ in range(_ROWS))
        self._version = 0  # never taken back: a stale heap entry must stay stale
        self._next_duel = 0  # never taken back either
        self.clear()

    # ------------------------------------------------------------------ sketch

    def _resize_sketch(self, pool: int) -> None:
        """Size the sketch for ``pool`` blocks, keeping every count (a wider row repeats them)."""
        width = 1
        while width < self._sketch_ratio * pool:
            width *= 2
        self._sample = max(1, int(self._sample_ratio * pool))
        self._max_duels = max(1, int(self._duel_ratio * pool))
        self._growth = 2.0 ** (1.0 / (self._half_life_ratio * pool))
        if width <= self._width:
            return
        factor, old, old_width = width // self._width, self._sketch, self._width
        # Indices are the top bits of a 64-bit product: one more bit splits each old counter
        # in two, so each new counter starts at the count of the old one it came from.
        sketch = bytearray(_ROWS * width)
        for row in range(_ROWS):
            counters = old[row * old_width : (row + 1) * old_width]
            for offset in range(factor):  # strided slice assignment: C speed
                sketch[row * width + offset : (row + 1) * width : factor] = counters
        self._sketch, self._width = sketch, width
        self._shift = 64 - (width.bit_length() - 1)

    def _indices(self, block_hash: int) -> tuple[int, int, int, int]:
        """The hash's counter in each of the four rows (unrolled: it runs once per use)."""
        value, shift, width = block_hash & _MASK64, self._shift, self._width
        m0, m1, m2, m3 = self._multipliers
        return (
            ((value * m0) & _MASK64) >> shift,
            width + (((value * m1) & _MASK64) >> shift),
            2 * width + (((value * m2) & _MASK64) >> shift),
            3 * width + (((value * m3) & _MASK64) >> shift),
        )

    def uses(self, block_hash: int) -> int:
        """Estimated uses of ``block_hash`` (never below the truth before halvings). O(1)."""
        sketch = self._sketch
        i0, i1, i2, i3 = self._indices(block_hash)
        return min(sketch[i0], sketch[i1], sketch[i2], sketch[i3])

    def _count(self, block_hash: int, num_uses: int, undo: list[Any] | None) -> int:
        """Add ``num_uses`` to the hash's count (conservative update); halve all when due.

        Returns the hash's estimated uses afterwards.
        """
        sketch, indices = self._sketch, self._indices(block_hash)
        i0, i1, i2, i3 = indices
        target = min(sketch[i0], sketch[i1], sketch[i2], sketch[i3]) + num_uses
        if target > _MAX_COUNT:
            target = _MAX_COUNT
        changed = [(index, sketch[index]) for index in indices if sketch[index] < target]
        for index, _ in changed:
            sketch[index] = target
        added = self._added
        self._added = added + num_uses
        halved = None
        if self._added >= self._sample:
            halved = sketch
            self._sketch = sketch.translate(_HALVE)
            self._added //= 2
            target >>= 1  # the minimum of halved counters is the halved minimum
        if undo is not None:
            undo.append((self._uncount, changed, added, halved))
        return target

    def _uncount(
        self, changed: list[tuple[int, int]], added: int, halved: bytearray | None
    ) -> None:
        if halved is not None:
            self._sketch = halved
        for index, value in changed:
            self._sketch[index] = value
        self._added = added

    def _uncount_run(self, changed: list[int], added: int) -> None:
        """Take back a run of counter changes, ``changed`` = (index, old value, ...)."""
        sketch = self._sketch
        for position in range(len(changed) - 2, -1, -2):
            sketch[changed[position]] = changed[position + 1]
        self._added = added

    def _unhalve(self, sketch: bytearray, added: int) -> None:
        """Take back a halving: the counters and the uses count as they were before it."""
        self._sketch, self._added = sketch, added

    # ------------------------------------------------------------------ charges

    def _age(self, num_registered: int, undo: list[Any] | None) -> None:
        """Let time pass by ``num_registered`` registrations: charges decay.

        Decay is lazy: a miss charged now weighs ``_weight``, which grows by
        ``_growth`` per registration, so older charges shrink relative to
        new ones without touching them. Both are scaled back to 1 when the
        weight grows large. Complexity: O(1).
        """
        weight, charges = self._weight, self._charges
        self._weight = weight * self._growth**num_registered
        if self._weight > 1e100:
            scale = self._weight
            self._charges = (charges[0] / scale, charges[1] / scale)
            self._weight = 1.0
        if undo is not None:
            undo.append((self._set_charges, charges, weight))

    def _set_charges(self, charges: tuple[float, float], weight: float) -> None:
        self._charges, self._weight = charges, weight

    def _next_leader(self) -> int:
        """The leader once a challenger ahead by the margin has taken over. O(1), no change."""
        charges, leader = self._charges, self._leader
        lead, challenger = charges[leader], charges[1 - leader]
        if challenger < self._keep * lead - self._weight and lead - challenger > self._z * (
            math.sqrt((lead + challenger) * self._weight)
        ):
            return 1 - leader
        return leader

    # ------------------------------------------------------------------ tracking

    def _push(self, block_id: int, last_access: int, uses: int) -> None:
        """Track ``block_id`` under a new version, keyed for each expert (``uses`` for frequent)."""
        self._version += 1
        version = self._version
        lru_key = (last_access, block_id, version)
        frequent_key = (uses if uses < _FREQUENCY_CAP else _FREQUENCY_CAP, *lru_key)
        self._tracked[block_id] = (version, lru_key, frequent_key)
        heapq.heappush(self._lru, lru_key)
        heapq.heappush(self._frequent, frequent_key)
        if len(self._lru) > 2 * len(self._tracked) + 64:
            self._compact()

    def _put_back(self, block_id: int, entry: _Entry) -> None:
        """Track ``block_id`` again with ``entry`` (the inverse of a removal)."""
        self._tracked[block_id] = entry
        heapq.heappush(self._lru, entry[1])
        heapq.heappush(self._frequent, entry[2])

    def _compact(self) -> None:
        """Rebuild the heaps from the live entries: memory O(tracked leaves). O(n)."""
        entries = list(self._tracked.values())
        self._lru = [entry[1] for entry in entries]
        self._frequent = [entry[2] for entry in entries]
        heapq.heapify(self._lru)
        heapq.heapify(self._frequent)

    def _grow_pool(self, block_id: int, undo: list[Any] | None) -> None:
        if undo is not None:
            undo.append(
                (self._set_sizes, self._pool, self._sketch, self._width, self._sample, self._growth)
            )
        self._pool = block_id + 1
        self._resize_sketch(self._pool)

    def _set_sizes(
        self, pool: int, sketch: bytearray, width: int, sample: int, growth: float
    ) -> None:
        self._pool, self._sketch, self._width, self._sample = pool, sketch, width, sample
        self._max_duels = max(1, int(self._duel_ratio * pool))
        self._growth = growth
        self._shift = 64 - (width.bit_length() - 1)

    def _new_uses(self, block_id: int, block_hash: int, num_accesses: int) -> int:
        """Hand-outs of a block being inserted that were not counted yet."""
        stay = self._stays.get(block_id)
        if stay is not None and stay[0] == block_hash and stay[1] <= num_accesses:
            return num_accesses - stay[1]  # back from a hit: the hand-outs since
        return num_accesses - 1  # the first use was counted at registration

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        """Track ``block_id`` and count its new uses. Complexity: O(log n)."""
        undo = self._txn_undo
        if block_id >= self._pool:
            self._grow_pool(block_id, undo)
        new_uses = self._new_uses(block_id, block_hash, num_accesses)
        stay = self._stays.get(block_id)
        self._stays[block_id] = (block_hash, num_accesses)
        uses = self._count(block_hash, new_uses, undo) if new_uses > 0 else self.uses(block_hash)
        self._push(block_id, last_access, uses)
        if undo is not None:
            undo.append((self._uninsert, block_id, stay))

    def _uninsert(self, block_id: int, stay: tuple[int, int] | None) -> None:
        del self._tracked[block_id]
        if stay is None:
            del self._stays[block_id]
        else:
            self._stays[block_id] = stay

    def on_register(self, block_hashes: list[int], first_depth: int) -> None:
        """Count one use of each registered hash; a watched one charges who named it.

        Registrations are also the policy's clock: charges decay per
        registered block.

        Args:
            block_hashes: one run of newly registered hashes (not kept).
            first_depth: chain position of the first; not used.

        Complexity: O(len(block_hashes)).
        """
        undo = self._txn_undo
        by_hash = self._by_hash
        m0, m1, m2, m3 = self._multipliers
        shift, width, sketch, sample = self._shift, self._width, self._sketch, self._sample
        # _count(block_hash, 1, undo), inlined: this loop runs once per registered block.
        # One undo entry per run: the changed counters, flat (index, old value, ...).
        added = first_added = self._added
        changed: list[int] = []
        for block_hash in block_hashes:
            if block_hash in by_hash:
                self._reused(block_hash, undo)
            value = block_hash & _MASK64
            i0 = ((value * m0) & _MASK64) >> shift
            i1 = width + (((value * m1) & _MASK64) >> shift)
            i2 = 2 * width + (((value * m2) & _MASK64) >> shift)
            i3 = 3 * width + (((value * m3) & _MASK64) >> shift)
            c0, c1, c2, c3 = sketch[i0], sketch[i1], sketch[i2], sketch[i3]
            target = min(c0, c1, c2, c3) + 1
            if target <= _MAX_COUNT:
                if c0 < target:
                    sketch[i0] = target
                    changed += (i0, c0)
                if c1 < target:
                    sketch[i1] = target
                    changed += (i1, c1)
                if c2 < target:
                    sketch[i2] = target
                    changed += (i2, c2)
                if c3 < target:
                    sketch[i3] = target
                    changed += (i3, c3)
            added += 1
            if added >= sample:  # halve every count; the undo entries so far go first
                if undo is not None:
                    undo.append((self._uncount_run, changed, first_added))
                    undo.append((self._unhalve, sketch, added))
                changed = []
                self._sketch = sketch = sketch.translate(_HALVE)
                added = first_added = added // 2
        self._added = added
        if undo is not None and changed:
            undo.append((self._uncount_run, changed, first_added))
        self._age(len(block_hashes), undo)

    def _reused(self, block_hash: int, undo: list[Any] | None) -> None:
        """``block_hash`` is used again: it wins every open duel it is in.

        In each duel the expert that named this side for eviction is charged
        one miss, and the duel closes.
        """
        ids = self._by_hash.get(block_hash)
        if not ids:
            return
        closed = [(duel_id, self._close(duel_id)) for duel_id in sorted(ids)]
        misses = [0, 0]
        for _, duel in closed:
            named = duel[1] if duel[0] == block_hash else duel[3]
            misses[0] += named & 1
            misses[1] += (named >> 1) & 1
        if undo is not None:
            undo.append((self._reopen_all, closed))
            undo.append((self._set_charges, self._charges, self._weight))
        weight, charges = self._weight, self._charges
        self._charges = (charges[0] + misses[0] * weight, charges[1] + misses[1] * weight)

    def _open(self, duel: tuple[int, int, int, int], undo: list[Any] | None) -> None:
        """Open ``duel`` = (victim hash, its namers, kept hash, its namers); drop the oldest.

        The two hashes differ (the callers check: two blocks under one hash
        are one prefix). Duel IDs grow by one per duel, so the oldest open
        duel is the lowest open ID at or above ``_oldest`` (every lower one is
        closed).
        """
        self._next_duel += 1  # never taken back: an ID is never reused
        duel_id = self._next_duel
        duels, by_hash = self._duels, self._by_hash
        duels[duel_id] = duel
        ids = by_hash.get(duel[0])  # both sides, unrolled (the hashes differ: see callers)
        if ids is None:
            by_hash[duel[0]] = {duel_id}
        else:
            ids.add(duel_id)
        ids = by_hash.get(duel[2])
        if ids is None:
            by_hash[duel[2]] = {duel_id}
        else:
            ids.add(duel_id)
        if undo is not None:
            undo.append((self._close, duel_id))
        if len(duels) > self._max_duels:
            first = oldest = self._oldest
            while oldest not in duels:
                oldest += 1
            dropped = self._close(oldest)
            self._oldest = oldest + 1
            if undo is not None:
                undo.append((self._reopen_oldest, oldest, dropped, first))

    def _close(self, duel_id: int) -> tuple[int, int, int, int]:
        """Remove the open duel ``duel_id``; return it."""
        duel = self._duels.pop(duel_id)
        by_hash = self._by_hash
        ids = by_hash[duel[0]]
        ids.discard(duel_id)
        if not ids:
            del by_hash[duel[0]]
        ids = by_hash[duel[2]]
        ids.discard(duel_id)
        if not ids:
            del by_hash[duel[2]]
        return duel

    def _reopen(self, duel_id: int, duel: tuple[int, int, int, int]) -> None:
        """Put back a duel :meth:`_close` removed."""
        self._duels[duel_id] = duel
        self._by_hash.setdefault(duel[0], set()).add(duel_id)
        self._by_hash.setdefault(duel[2], set()).add(duel_id)

    def _reopen_oldest(self, duel_id: int, duel: tuple[int, int, int, int], oldest: int) -> None:
        """Take back the drop of the oldest duel: the duel and the ``_oldest`` mark."""
        self._reopen(duel_id, duel)
        self._oldest = oldest

    def _reopen_all(self, closed: list[tuple[int, tuple[int, int, int, int]]]) -> None:
        for duel_id, duel in reversed(closed):
            self._reopen(duel_id, duel)

    def _untrack_use(self, block_id: int) -> tuple[int, list[tuple[Any, ...]] | None]:
        """Stop tracking ``block_id`` for a use of its hash; its hash and the open undo log."""
        entry = self._tracked.pop(block_id)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._put_back, block_id, entry))
        block_hash = self._stays[block_id][0]
        if block_hash in self._by_hash:
            self._reused(block_hash, undo)
        return block_hash, undo

    def discard(self, block_id: int) -> None:
        """Stop tracking ``block_id`` (a hit): a use of its hash. Complexity: O(1).

        Raises:
            KeyError: ``block_id`` is not tracked.
        """
        self._untrack_use(block_id)

    def touch(self, block_id: int, now: int) -> None:
        """Record a use at ``now``. Complexity: O(log n).

        Raises:
            KeyError: ``block_id`` is not tracked.
        """
        block_hash, undo = self._untrack_use(block_id)
        self._push(block_id, now, self._count(block_hash, 1, undo))
        if undo is not None:
            undo.append((self._tracked.__delitem__, block_id))

    # ------------------------------------------------------------------ eviction

    def _tops(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The live top key of each expert's heap, stale entries dropped (tracked non-empty)."""
        tracked, lru, frequent = self._tracked, self._lru, self._frequent
        while True:
            lru_key = lru[0]
            entry = tracked.get(lru_key[1])
            if entry is not None and entry[0] == lru_key[2]:
                break
            heapq.heappop(lru)
        while True:
            frequent_key = frequent[0]
            entry = tracked.get(frequent_key[2])
            if entry is not None and entry[0] == frequent_key[3]:
                break
            heapq.heappop(frequent)
        return lru_key, frequent_key

    def evict(self, num_blocks: int) -> list[int]:
        """Remove up to ``num_blocks`` leaves, each the leading expert's candidate.

        Complexity: O(k log n) amortised.
        """
        victims: list[int] = []
        undo = self._txn_undo
        tracked, stays = self._tracked, self._stays
        while len(victims) < num_blocks and tracked:
            lru_key, frequent_key = self._tops()
            candidates = (lru_key[1], frequent_key[2])
            leader = self._leader
            new_leader = self._next_leader()
            self._leader = new_leader
            victim = candidates[new_leader]
            entry = tracked.pop(victim)
            stay = stays.pop(victim)
            kept = candidates[1 - new_leader]
            if kept != victim:
                kept_hash = stays[kept][0]
                # Two blocks under one hash are one prefix: a duel between them decides nothing.
                if kept_hash != stay[0]:
                    self._open((stay[0], 1 << new_leader, kept_hash, 2 >> new_leader), undo)
            victims.append(victim)
            if undo is not None:
                undo.append((self._unevict, victim, entry, stay, leader))
        return victims

    def evicts_first(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> bool:
        """Whether ``evict(1)`` would return ``block_id`` right after inserting it; if so, book it.

        The engine evicts a block this answers ``True`` for without the
        insert-and-evict round trip (the parent a chain eviction exposes).
        So that the policy learns exactly what the round trip would have
        taught it, a ``True`` answer also books that eviction's statistics:
        the block's new uses in the sketch and the duel against the other
        expert's candidate. It never changes the tracked leaves or their
        order (the contract of the hook); the bookkeeping is in the undo log
        like every change. ``False`` where the pool estimate would grow.
        Complexity: O(1) amortised.
        """
        tracked, stays = self._tracked, self._stays
        if block_id >= self._pool:
            return False
        stay = stays.get(block_id)
        if stay is not None and stay[0] == block_hash and stay[1] <= num_accesses:
            new_uses = num_accesses - stay[1]  # as in _new_uses, inlined
        else:
            new_uses = num_accesses - 1
        undo = self._txn_undo
        if not tracked:
            if new_uses > 0:
                self._count(block_hash, new_uses, undo)
            return True
        leader = self._next_leader()
        lru, frequent = self._lru, self._frequent  # the live tops, as in _tops
        while True:
            lru_key = lru[0]
            entry = tracked.get(lru_key[1])
            if entry is not None and entry[0] == lru_key[2]:
                break
            heapq.heappop(lru)
        lru_first = last_access < lru_key[0] or (
            last_access == lru_key[0] and block_id < lru_key[1]
        )
        if not lru_first and leader == 0:
            return False
        while True:
            frequent_key = frequent[0]
            entry = tracked.get(frequent_key[2])
            if entry is not None and entry[0] == frequent_key[3]:
                break
            heapq.heappop(frequent)
        sketch, shift, width = self._sketch, self._shift, self._width  # as in uses(), inlined
        value = block_hash & _MASK64
        m0, m1, m2, m3 = self._multipliers
        uses = min(
            sketch[((value * m0) & _MASK64) >> shift],
            sketch[width + (((value * m1) & _MASK64) >> shift)],
            sketch[2 * width + (((value * m2) & _MASK64) >> shift)],
            sketch[3 * width + (((value * m3) & _MASK64) >> shift)],
        )
        if new_uses > 0:
            uses = min(uses + new_uses, _MAX_COUNT)
            if self._added + new_uses >= self._sample:
                uses >>= 1
        if uses > _FREQUENCY_CAP:
            uses = _FREQUENCY_CAP
        frequent_first = uses < frequent_key[0] or (
            uses == frequent_key[0]
            and (
                last_access < frequent_key[1]
                or (last_access == frequent_key[1] and block_id < frequent_key[2])
            )
        )
        if not frequent_first and leader == 1:
            return False
        # Booked as evict(1) would: the leader, the new uses, the stay, the duel.
        if leader != self._leader:
            if undo is not None:
                undo.append((setattr, self, "_leader", self._leader))
            self._leader = leader
        if new_uses > 0:
            self._count(block_hash, new_uses, undo)
        if stay is not None:
            del stays[block_id]
            if undo is not None:
                undo.append((stays.__setitem__, block_id, stay))
        if not (lru_first and frequent_first):
            kept = frequent_key[2] if leader == 0 else lru_key[1]
            kept_hash = stays[kept][0]
            if kept_hash != block_hash:
                self._open((block_hash, 1 << leader, kept_hash, 2 >> leader), undo)
        return True

    def _unevict(self, victim: int, entry: _Entry, stay: tuple[int, int], leader: int) -> None:
        """Take one eviction back: the leader and the victim."""
        self._leader = leader
        self._stays[victim] = stay
        self._put_back(victim, entry)

    # ------------------------------------------------------------------ the rest

    def clear(self) -> None:
        """Forget every tracked leaf, stay, duel, count and charge. Complexity: O(pool)."""
        self._lru = []
        self._frequent = []
        self._tracked = {}
        self._stays = {}  # tracked or out for a hit
        # Open duels, oldest first: ID -> (victim hash, experts that named it, kept hash,
        # experts that named it). The first of the two hashes used again wins.
        self._duels = {}
        self._by_hash = {}  # hash -> IDs of the open duels it is in
        self._oldest = self._next_duel + 1
        self._charges = (0.0, 0.0)
        self._weight = 1.0  # what one miss charged now weighs (see _age)
        self._leader = EXPERTS.index("frequent")
        self._pool = _MIN_POOL
        self._width = 1
        self._sketch = bytearray(_ROWS)
        self._shift = 64
        self._added = 0  # uses counted since the last halving
        self._resize_sketch(self._pool)
        self._txn_undo = None

    @property
    def leader(self) -> str:
        """The name of the expert that evicts now (:data:`EXPERTS`). Complexity: O(1)."""
        return EXPERTS[self._leader]

    def charges(self) -> dict[str, float]:
        """Each expert's decayed count of hits its choices cost. Complexity: O(1)."""
        weight = self._weight
        return {name: charge / weight for name, charge in zip(EXPERTS, self._charges, strict=True)}

    def metadata(self) -> dict[str, int]:
        """What the policy holds beside its tracked leaves, for the bounds. Complexity: O(1).

        Returns:
            ``pool`` (the estimate the bounds scale with), ``duels`` (open),
            ``sketch_counters`` (bytes) and ``stays``.
        """
        return {
            "pool": self._pool,
            "duels": len(self._duels),
            "sketch_counters": len(self._sketch),
            "stays": len(self._stays),
        }

    def __len__(self) -> int:
        return len(self._tracked)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._tracked
