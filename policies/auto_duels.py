"""``auto``'s choice of expert: counterfactual duels, decayed charges, a sequential test.

At each eviction where the experts disagree, a *duel* opens between the
victim's hash and the kept candidate's hash; whichever is used first shows
whose choice was wrong, and only that expert is charged one miss (block for
block, so a chain evicted by one expert is not over-counted against a single
leaf the other keeps). Charges decay with a half-life counted in registered
blocks, lazily (a charge added now weighs ``_weight``, which grows). The lead
moves when the challenger is one miss ahead and the gap passes a sequential
test (``switch_z`` standard deviations of a fair coin's count). A mixin of
:class:`~prefixcache.policies.auto.AutoPolicy`: the state lives on the policy,
the undo log is the policy's. Integer and double arithmetic only.
"""

from __future__ import annotations

import math
from typing import Any

EXPERTS = ("lru", "frequent")
"""The experts, by index: how each orders the tracked leaves (see :class:`AutoPolicy`)."""

Duel = tuple[int, int, int, int]
"""(victim hash, experts that named it, kept hash, experts that named it); bit 0: lru."""


class Duels:
    """Open duels and the experts' charges (a mixin: see the module docstring)."""

    _duels: dict[int, Duel]  # open duels by ID, oldest first
    _by_hash: dict[int, set[int]]  # hash -> IDs of the open duels it is in
    _oldest: int  # no open duel has a lower ID
    _next_duel: int  # the last duel ID given out; never taken back
    _max_duels: int
    _charges: tuple[float, float]  # in units of _weight (see _age)
    _weight: float  # what one miss charged now weighs
    _growth: float  # _weight's growth per registered block
    _leader: int
    _net: tuple[float, float]  # the safety net's (gap, volume), also in units of _weight
    _keep: float  # 1 - switch_margin
    _z: float  # switch_z

    def _age(self, num_registered: int, undo: list[Any] | None) -> None:
        """Let time pass by ``num_registered`` registrations: charges decay.

        Decay is lazy: a miss charged now weighs ``_weight``, which grows by
        ``_growth`` per registration, so older charges shrink relative to
        new ones without touching them. Both (and the safety net's ``_net``,
        in the same units) are scaled back to 1 when the weight grows large.
        Complexity: O(1).
        """
        weight, charges = self._weight, self._charges
        self._weight = weight * self._growth**num_registered
        if self._weight > 1e100:
            scale = self._weight
            self._charges = (charges[0] / scale, charges[1] / scale)
            net = self._net
            self._net = (net[0] / scale, net[1] / scale)
            if undo is not None:
                undo.append((setattr, self, "_net", net))
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

    def _open(self, duel: Duel, undo: list[Any] | None) -> None:
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

    def _close(self, duel_id: int) -> Duel:
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

    def _reopen(self, duel_id: int, duel: Duel) -> None:
        """Put back a duel :meth:`_close` removed."""
        self._duels[duel_id] = duel
        self._by_hash.setdefault(duel[0], set()).add(duel_id)
        self._by_hash.setdefault(duel[2], set()).add(duel_id)

    def _reopen_oldest(self, duel_id: int, duel: Duel, oldest: int) -> None:
        """Take back the drop of the oldest duel: the duel and the ``_oldest`` mark."""
        self._reopen(duel_id, duel)
        self._oldest = oldest

    def _reopen_all(self, closed: list[tuple[int, Duel]]) -> None:
        for duel_id, duel in reversed(closed):
            self._reopen(duel_id, duel)

    @property
    def leader(self) -> str:
        """The name of the expert that evicts now (:data:`EXPERTS`). Complexity: O(1)."""
        return EXPERTS[self._leader]

    def charges(self) -> dict[str, float]:
        """Each expert's decayed count of hits its choices cost. Complexity: O(1)."""
        weight = self._weight
        return {name: charge / weight for name, charge in zip(EXPERTS, self._charges, strict=True)}
