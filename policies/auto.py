"""``auto``: an eviction policy that follows, online, whichever of two experts loses fewer hits."""

from __future__ import annotations

import heapq
import random
from typing import Any

from prefixcache.policies.auto_duels import EXPERTS, Duels
from prefixcache.policies.auto_safety import LruShadow
from prefixcache.policies.auto_shortcut import FREQUENCY_CAP, ChainShortcut
from prefixcache.policies.auto_sketch import ROWS, UseSketch
from prefixcache.policies.base import EvictionPolicy

__all__ = ["EXPERTS", "AutoPolicy"]

_MIN_POOL = 64  # the pool estimate never goes below this (tiny pools, tests)

_Entry = tuple[Any, ...]
"""A tracked leaf: (version, then its heap key for each expert)."""


def _check_number(name: str, value: object, minimum: float, *, integer: bool = False) -> None:
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or float(value) < minimum:  # type: ignore[arg-type]
        kind = "an int" if integer else "a number"
        raise ValueError(f"{name} must be {kind} >= {minimum}, got {value!r}")


class AutoPolicy(ChainShortcut, UseSketch, Duels, LruShadow, EvictionPolicy):
    """Two experts order the leaves; the one whose choices lost fewest hits lately evicts.

    The experts (:data:`EXPERTS`), each a heap of keys over the same tracked leaves:

    - ``lru``: oldest last access first. Best where a first use predicts the
      next as well as a second does (multi-turn chat: every turn is extended).
    - ``frequent``: fewest uses first (counts capped at 3), LRU among equals.
      Its admission rule is W-TinyLFU's: a block used once is evicted before
      any reused one, so a scan of one-hit blocks cannot push reused
      prefixes out. Best on scans of one-off prompts (documents, the
      Mooncake trace) and on a Zipf mix of shared system prompts.

    Use counts by hash: a count-min sketch (:mod:`.auto_sketch`), so a
    prefix reused, evicted and computed again is still known as reused. A
    use is a registration (:meth:`on_register`), a hand-out seen at
    :meth:`insert` or a :meth:`touch`.

    Choosing the expert (:mod:`.auto_duels`): where the experts' candidates
    differ, a *duel* watches the victim's and the kept block's hashes; the
    first used again shows whose choice was wrong, and that expert is
    charged one miss. Charges decay with a half-life of ``half_life_ratio``
    x pool registered blocks; the lead moves when the challenger is one
    miss and ``switch_z`` standard deviations ahead. ``frequent`` leads at
    first.

    Safety net (:mod:`.auto_safety`): plain LRU simulated over the same
    uses (registrations and :meth:`on_hit`) in a shadow of hashes; when its
    decayed lead over the real hits passes ``safety_z`` standard
    deviations, the ``lru`` expert evicts for 1 x pool registrations. It bounds the
    loss against LRU per window by construction (the module derives it).

    Bounded metadata, as fractions of the pool (estimated as the highest
    block ID seen + 1, at least 64): open duels <= ``duel_ratio`` x pool;
    sketch counters = 4 x the power of two >= ``sketch_ratio`` x pool, one
    byte each; stays <= the pool; shadow hashes <= the cached blocks.
    :meth:`metadata` reports them.

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
        safety_z: standard deviations LRU's lead must exceed before the
            safety net hands eviction to ``lru`` (>= 0; ``None`` turns the
            net off).

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
    _pool: int  # highest block ID seen + 1, at least _MIN_POOL

    def __init__(
        self,
        seed: int = 0,
        duel_ratio: float = 1.0,
        sketch_ratio: float = 8.0,
        sample_ratio: float = 16.0,
        half_life_ratio: float = 4.0,
        switch_margin: float = 0.0,
        switch_z: float = 1.5,
        safety_z: float | None = 2.0,
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
        if safety_z is not None:
            _check_number("safety_z", safety_z, 0)
        if not switch_margin < 1:
            raise ValueError(f"switch_margin must lie in [0, 1), got {switch_margin!r}")
        self._seed = seed
        self._duel_ratio = float(duel_ratio)
        self._sketch_ratio = float(sketch_ratio)
        self._sample_ratio = float(sample_ratio)
        self._half_life_ratio = float(half_life_ratio)
        self._keep = 1.0 - float(switch_margin)
        self._z = float(switch_z)
        self._safety_on = safety_z is not None
        self._safety_z = 0.0 if safety_z is None else float(safety_z)
        self._hold_ratio = 1.0  # one trip holds for 1 x pool registrations (see auto_safety)
        self._shadow_stamp = 0  # never taken back: a stale shadow heap entry must stay stale
        rng = random.Random(seed)
        self._multipliers = tuple(rng.getrandbits(64) | 1 for _ in range(ROWS))
        self._version = 0  # never taken back: a stale heap entry must stay stale
        self._next_duel = 0  # never taken back either
        self.clear()

    def _resize(self, pool: int) -> None:
        """Scale the bounds to ``pool`` blocks: the sketch, the open duels, the decay."""
        self._resize_sketch(pool)
        self._max_duels = max(1, int(self._duel_ratio * pool))
        self._growth = 2.0 ** (1.0 / (self._half_life_ratio * pool))

    # ------------------------------------------------------------------ tracking

    def _push(self, block_id: int, last_access: int, uses: int) -> None:
        """Track ``block_id`` under a new version, keyed for each expert (``uses`` for frequent)."""
        self._version += 1
        version = self._version
        lru_key = (last_access, block_id, version)
        frequent_key = (uses if uses < FREQUENCY_CAP else FREQUENCY_CAP, *lru_key)
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
        self._resize(self._pool)

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
        if by_hash:  # duels and counts are separate state: settle the duels, then count
            for block_hash in block_hashes:
                if block_hash in by_hash:
                    self._reused(block_hash, undo)
        self._count_run(block_hashes, undo)
        self._resize_shadow(len(block_hashes), undo)
        self._shadow_misses(block_hashes, undo)
        self._age(len(block_hashes), undo)

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
        return self._lru_top(), self._frequent_top()

    def _lru_top(self) -> tuple[int, ...]:
        """The lru expert's live top key (last access, block ID, version); stale keys dropped."""
        tracked, lru = self._tracked, self._lru
        while True:
            key = lru[0]
            entry = tracked.get(key[1])
            if entry is not None and entry[0] == key[2]:
                return key
            heapq.heappop(lru)

    def _frequent_top(self) -> tuple[int, ...]:
        """The frequent expert's live top key (uses, last access, block ID, version)."""
        tracked, frequent = self._tracked, self._frequent
        while True:
            key = frequent[0]
            entry = tracked.get(key[2])
            if entry is not None and entry[0] == key[3]:
                return key
            heapq.heappop(frequent)

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
            self._leader = self._next_leader()
            fallback = self._next_fallback()
            self._set_fallback(fallback, undo)
            acting = 0 if fallback else self._leader  # the safety net hands eviction to lru
            victim = candidates[acting]
            entry = tracked.pop(victim)
            stay = stays.pop(victim)
            kept = candidates[1 - acting]
            if kept != victim:
                kept_hash = stays[kept][0]
                # Two blocks under one hash are one prefix: a duel between them decides nothing.
                if kept_hash != stay[0]:
                    self._open((stay[0], 1 << acting, kept_hash, 2 >> acting), undo)
            victims.append(victim)
            if undo is not None:
                undo.append((self._unevict, victim, entry, stay, leader))
        if victims:
            self._resize_shadow(-len(victims), undo)
        return victims

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
        self._sketch = bytearray(ROWS)
        self._shift = 64
        self._added = 0  # uses counted since the last halving
        self._clear_shadow()
        self._resize(self._pool)
        self._txn_undo = None

    def metadata(self) -> dict[str, int]:
        """What the policy holds beside its tracked leaves, for the bounds. Complexity: O(1).

        Returns:
            ``pool`` (the estimate the bounds scale with), ``duels`` (open),
            ``sketch_counters`` (bytes), ``stays`` and ``shadow`` (hashes the
            safety net's LRU shadow holds, <= pool).
        """
        return {
            "pool": self._pool,
            "duels": len(self._duels),
            "sketch_counters": len(self._sketch),
            "stays": len(self._stays),
            "shadow": len(self._shadow),
        }

    @property
    def safety_net(self) -> bool:
        """Whether the safety net holds eviction now (``lru`` evicts). Complexity: O(1)."""
        return self._fallback

    def __len__(self) -> int:
        return len(self._tracked)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._tracked
