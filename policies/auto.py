"""``auto``: an eviction policy that follows, online, whichever of two experts loses fewer hits."""

from __future__ import annotations

import heapq
import random
from typing import Any

from prefixcache.policies.base import EvictionPolicy
from prefixcache.policies.linked_map import LinkedMap

EXPERTS = ("lru", "frequent")
"""The experts, by index: how each orders the tracked leaves (see :class:`AutoPolicy`)."""

_NUM_EXPERTS = len(EXPERTS)
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
    decay with a half-life of ``half_life_ratio`` x pool evictions; the lead
    passes to the other expert once its charge is below ``1 -
    switch_margin`` times the leader's (hysteresis: switching costs, since
    the cache was shaped by the old leader). ``frequent`` leads at first.
    Each duel compares one victim with one kept block, so an expert that
    evicts a whole chain while the other keeps naming one leaf is compared
    block for block, which keeps the charges unbiased toward either side.

    Bounded metadata, as fractions of the pool (estimated as the highest
    block ID seen + 1, at least 64): open duels <= ``duel_ratio`` x pool;
    sketch counters = 4 x the power of two >= ``sketch_ratio`` x pool, one
    byte each; stays <= the pool. :meth:`metadata` reports them.

    Transactions: every change is recorded with its inverse (the undo log of
    :class:`EvictionPolicy`): tracked entries, stays, duels (put back in
    place), sketch counters, charges, the leader and the pool estimate.
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
        half_life_ratio: half-life of the charges, in evictions per pool
            block (> 0).
        switch_margin: share by which a challenger's charge must be below
            the leader's, in ``[0, 1)``.

    Raises:
        ValueError: an argument is out of range.

    Complexity: ``insert``, ``touch`` O(log n) (two ``heapq`` pushes);
    ``discard`` O(1) amortised; ``evict(k)`` O(k log n) amortised;
    ``on_register`` O(1) amortised per hash; a sketch halving O(pool) every
    ``sample_ratio`` x pool uses. Memory: O(pool). Not thread-safe.
    """

    # Set by clear(), which __init__ calls.
    _heaps: list[list[tuple[Any, ...]]]
    _tracked: dict[int, _Entry]  # block ID -> its live entry
    _stays: dict[int, tuple[int, int, int]]  # block ID -> (hash, hand-outs seen, depth)
    _duels: LinkedMap[tuple[int, int, int, int]]
    _by_hash: dict[int, set[int]]
    _charges: tuple[float, ...]
    _leader: int
    _pool: int
    _width: int
    _sketch: bytearray
    _shift: int
    _added: int
    _sample: int

    def __init__(
        self,
        seed: int = 0,
        duel_ratio: float = 1.0,
        sketch_ratio: float = 8.0,
        sample_ratio: float = 16.0,
        half_life_ratio: float = 4.0,
        switch_margin: float = 0.2,
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
        if not switch_margin < 1:
            raise ValueError(f"switch_margin must lie in [0, 1), got {switch_margin!r}")
        self._seed = seed
        self._duel_ratio = float(duel_ratio)
        self._sketch_ratio = float(sketch_ratio)
        self._sample_ratio = float(sample_ratio)
        self._half_life_ratio = float(half_life_ratio)
        self._switch_margin = float(switch_margin)
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
        if width <= self._width:
            return
        factor, old, old_width = width // self._width, self._sketch, self._width
        # Indices are the top bits of a 64-bit product: one more bit splits each old counter
        # in two, so each new counter starts at the count of the old one it came from.
        sketch = bytearray()
        for row in range(_ROWS):
            for value in old[row * old_width : (row + 1) * old_width]:
                sketch += bytes((value,)) * factor
        self._sketch, self._width = sketch, width
        self._shift = 64 - (width.bit_length() - 1)

    def _indices(self, block_hash: int) -> list[int]:
        value, shift, width = block_hash & _MASK64, self._shift, self._width
        return [
            row * width + (((value * multiplier) & _MASK64) >> shift)
            for row, multiplier in enumerate(self._multipliers)
        ]

    def uses(self, block_hash: int) -> int:
        """Estimated uses of ``block_hash`` (never below the truth before halvings). O(1)."""
        sketch = self._sketch
        return min(sketch[index] for index in self._indices(block_hash))

    def _count(self, block_hash: int, num_uses: int, undo: list[Any] | None) -> None:
        """Add ``num_uses`` to the hash's count (conservative update); halve all when due."""
        sketch, indices = self._sketch, self._indices(block_hash)
        target = min(min(sketch[index] for index in indices) + num_uses, _MAX_COUNT)
        changed = [(index, sketch[index]) for index in indices if sketch[index] < target]
        for index, _ in changed:
            sketch[index] = target
        added = self._added
        self._added += num_uses
        halved = None
        if self._added >= self._sample:
            halved = self._sketch
            self._sketch = self._sketch.translate(_HALVE)
            self._added //= 2
        if undo is not None:
            undo.append((self._uncount, changed, added, halved))

    def _uncount(
        self, changed: list[tuple[int, int]], added: int, halved: bytearray | None
    ) -> None:
        if halved is not None:
            self._sketch = halved
        for index, value in changed:
            self._sketch[index] = value
        self._added = added

    # ------------------------------------------------------------------ charges

    def _charge(self, misses: tuple[int, ...], undo: list[Any] | None) -> None:
        """Charge ``misses[e]`` misses to expert ``e``."""
        if undo is not None:
            undo.append((self._set_charges, self._charges))
        self._charges = tuple(map(float.__add__, self._charges, map(float, misses)))

    def _set_charges(self, charges: tuple[float, ...]) -> None:
        self._charges = charges

    # ------------------------------------------------------------------ tracking

    def _push(self, block_id: int, last_access: int, block_hash: int) -> None:
        """Track ``block_id`` under a new version, keyed for every expert by its count now."""
        self._version += 1
        version, uses = self._version, self.uses(block_hash)
        entry = (
            version,
            (last_access, block_id, version),
            (min(uses, _FREQUENCY_CAP), last_access, block_id, version),
        )
        self._tracked[block_id] = entry
        for heap, key in zip(self._heaps, entry[1:], strict=True):
            heapq.heappush(heap, key)
        if len(self._heaps[0]) > 2 * len(self._tracked) + 64:
            self._compact()

    def _put_back(self, block_id: int, entry: _Entry) -> None:
        """Track ``block_id`` again with ``entry`` (the inverse of a removal)."""
        self._tracked[block_id] = entry
        for heap, key in zip(self._heaps, entry[1:], strict=True):
            heapq.heappush(heap, key)

    def _compact(self) -> None:
        """Rebuild the heaps from the live entries: memory O(tracked leaves). O(n)."""
        entries = list(self._tracked.values())
        for expert, heap in enumerate(self._heaps):
            heap[:] = [entry[expert + 1] for entry in entries]
            heapq.heapify(heap)

    def _grow_pool(self, block_id: int, undo: list[Any] | None) -> None:
        if block_id < self._pool:
            return
        if undo is not None:
            undo.append((self._set_sizes, self._pool, self._sketch, self._width, self._sample))
        self._pool = block_id + 1
        self._resize_sketch(self._pool)

    def _set_sizes(self, pool: int, sketch: bytearray, width: int, sample: int) -> None:
        self._pool, self._sketch, self._width, self._sample = pool, sketch, width, sample
        self._shift = 64 - (width.bit_length() - 1)

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        """Track ``block_id`` and count its new uses. Complexity: O(log n)."""
        undo = self._txn_undo
        self._grow_pool(block_id, undo)
        stay = self._stays.get(block_id)
        if stay is not None and stay[0] == block_hash and stay[1] <= num_accesses:
            new_uses = num_accesses - stay[1]  # back from a hit: the hand-outs since
        else:
            new_uses = num_accesses - 1  # the first use was counted at registration
        self._stays[block_id] = (block_hash, num_accesses, depth)
        if new_uses > 0:
            self._count(block_hash, new_uses, undo)
        self._push(block_id, last_access, block_hash)
        if undo is not None:
            undo.append((self._uninsert, block_id, stay))

    def _uninsert(self, block_id: int, stay: tuple[int, int, int] | None) -> None:
        del self._tracked[block_id]
        if stay is None:
            del self._stays[block_id]
        else:
            self._stays[block_id] = stay

    def on_register(self, block_hashes: list[int], first_depth: int) -> None:
        """Count one use of each registered hash; a watched one charges who named it.

        Args:
            block_hashes: one run of newly registered hashes (not kept).
            first_depth: chain position of the first; not used.

        Complexity: O(len(block_hashes)).
        """
        undo = self._txn_undo
        for block_hash in block_hashes:
            self._reused(block_hash, undo)
            self._count(block_hash, 1, undo)

    def _reused(self, block_hash: int, undo: list[Any] | None) -> None:
        """``block_hash`` is used again: it wins every open duel it is in.

        In each duel the expert(s) that named this side for eviction are
        charged one miss, and the duel closes.
        """
        ids = self._by_hash.get(block_hash)
        if not ids:
            return
        closed = [(duel_id, self._close(duel_id)) for duel_id in sorted(ids)]
        misses = [0] * _NUM_EXPERTS
        for _, link in closed:
            duel = link[2]
            named = duel[1] if duel[0] == block_hash else duel[3]
            for expert in range(_NUM_EXPERTS):
                misses[expert] += (named >> expert) & 1
        if undo is not None:
            undo.append((self._reopen_all, closed))
        self._charge(tuple(misses), undo)

    def _open(self, duel: tuple[int, int, int, int], undo: list[Any] | None) -> None:
        """Open ``duel`` = (victim hash, its namers, kept hash, its namers); drop the oldest."""
        self._next_duel += 1  # never taken back: an ID is never reused
        duel_id = self._next_duel
        self._duels.put(duel_id, duel)
        for side in (duel[0], duel[2]):
            self._by_hash.setdefault(side, set()).add(duel_id)
        if undo is not None:
            undo.append((self._close, duel_id))
        if len(self._duels) > max(1, int(self._duel_ratio * self._pool)):
            oldest = next(iter(self._duels))
            dropped = self._close(oldest)
            if undo is not None:
                undo.append((self._reopen, oldest, dropped))

    def _close(self, duel_id: int) -> list[Any]:
        """Remove the open duel ``duel_id``; return its link (value at ``[2]``)."""
        link = self._duels.unlink(duel_id)
        assert link is not None
        for side in {link[2][0], link[2][2]}:
            ids = self._by_hash[side]
            ids.discard(duel_id)
            if not ids:
                del self._by_hash[side]
        return link

    def _reopen(self, duel_id: int, link: list[Any]) -> None:
        """Put back a duel :meth:`_close` removed, in its place."""
        self._duels.relink(duel_id, link)
        for side in {link[2][0], link[2][2]}:
            self._by_hash.setdefault(side, set()).add(duel_id)

    def _reopen_all(self, closed: list[tuple[int, list[Any]]]) -> None:
        for duel_id, link in reversed(closed):
            self._reopen(duel_id, link)

    def discard(self, block_id: int) -> None:
        """Stop tracking ``block_id`` (a hit): a use of its hash. Complexity: O(1).

        Raises:
            KeyError: ``block_id`` is not tracked.
        """
        entry = self._tracked.pop(block_id)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._put_back, block_id, entry))
        self._reused(self._stays[block_id][0], undo)

    def touch(self, block_id: int, now: int) -> None:
        """Record a use at ``now``. Complexity: O(log n).

        Raises:
            KeyError: ``block_id`` is not tracked.
        """
        entry = self._tracked.pop(block_id)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._put_back, block_id, entry))
        block_hash = self._stays[block_id][0]
        self._reused(block_hash, undo)
        self._count(block_hash, 1, undo)
        self._push(block_id, now, block_hash)
        if undo is not None:
            undo.append((self._tracked.__delitem__, block_id))

    # ------------------------------------------------------------------ eviction

    def _candidate(self, expert: int) -> int:
        """The block ID at the live top of ``expert``'s heap, stale entries dropped."""
        heap, tracked = self._heaps[expert], self._tracked
        while True:
            key = heap[0]
            entry = tracked.get(key[-2])
            if entry is not None and entry[0] == key[-1]:
                return int(key[-2])
            heapq.heappop(heap)

    def _lead(self) -> int:
        """The leader, after a challenger that is ahead by the margin takes over."""
        charges, leader = self._charges, self._leader
        best = min(range(_NUM_EXPERTS), key=charges.__getitem__)
        if charges[best] < (1.0 - self._switch_margin) * charges[leader] - 1.0:
            self._leader = best
        return self._leader

    def evict(self, num_blocks: int) -> list[int]:
        """Remove up to ``num_blocks`` leaves, each the leading expert's candidate.

        Complexity: O(k log n) amortised.
        """
        victims: list[int] = []
        undo = self._txn_undo
        tracked = self._tracked
        while len(victims) < num_blocks and tracked:
            charges, leader = self._charges, self._leader
            candidates = [self._candidate(expert) for expert in range(_NUM_EXPERTS)]
            victim = candidates[self._lead()]
            self._open_duels(victim, candidates, undo)
            entry = tracked.pop(victim)
            stay = self._stays.pop(victim)
            decay = 0.5 ** (1.0 / (self._half_life_ratio * self._pool))
            self._charges = tuple(charge * decay for charge in self._charges)
            victims.append(victim)
            if undo is not None:
                undo.append((self._unevict, victim, entry, stay, charges, leader))
        return victims

    def _open_duels(self, victim: int, candidates: list[int], undo: list[Any] | None) -> None:
        """Open a duel between the victim and each other block an expert named."""
        victim_hash = self._stays[victim][0]
        victim_namers = sum(1 << e for e, block in enumerate(candidates) if block == victim)
        for block_id in dict.fromkeys(candidates):
            # Two blocks under one hash are one prefix: a duel between them decides nothing.
            if block_id != victim and self._stays[block_id][0] != victim_hash:
                namers = sum(1 << e for e, block in enumerate(candidates) if block == block_id)
                self._open((victim_hash, victim_namers, self._stays[block_id][0], namers), undo)

    def _unevict(
        self,
        victim: int,
        entry: _Entry,
        stay: tuple[int, int, int],
        charges: tuple[float, ...],
        leader: int,
    ) -> None:
        """Take one eviction back: charges, leader and the victim."""
        self._charges, self._leader = charges, leader
        self._stays[victim] = stay
        self._put_back(victim, entry)

    # ------------------------------------------------------------------ the rest

    def clear(self) -> None:
        """Forget every tracked leaf, stay, duel, count and charge. Complexity: O(pool)."""
        self._heaps = [[] for _ in range(_NUM_EXPERTS)]
        self._tracked = {}
        self._stays = {}  # tracked or out for a hit
        # Open duels, oldest first: ID -> (victim hash, experts that named it, kept hash,
        # experts that named it). The first of the two hashes used again wins.
        self._duels = LinkedMap()
        self._by_hash = {}  # hash -> IDs of the open duels it is in
        self._charges = (0.0,) * _NUM_EXPERTS
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
        return dict(zip(EXPERTS, self._charges, strict=True))

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
