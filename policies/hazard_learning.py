"""The learning half of ``hazard``: reuse-age statistics per class and the hazard score.

:class:`~prefixcache.policies.hazard.HazardPolicy` keeps the leaves (per-class
LRU heaps, stays, histories); this mixin keeps what it learns from them: for
each class of blocks (hand-outs x chain depth) how many entered it and at which
idle ages they were reused, decayed every ``_REFRESH_EVENTS`` events, and the
score a leaf of a class gets at an age. Split out so each file reads in one
sitting; the two are one policy (the mixin has no state of its own until
:meth:`HazardLearning._clear_learning`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

_BINS_PER_OCTAVE = 4  # age histogram resolution: bins grow by 2 ** (1 / 4)
_NUM_AGE_BINS = 128  # covers idle ages up to 2 ** 32 clock ticks
_NUM_USE_BUCKETS = 4  # hand-outs 1, 2, 3-4, 5 and more
_NUM_DEPTH_BUCKETS = 8  # depth 0, 1, 2-3, 4-7, ..., 64 and more


def _age_bin(age: float) -> int:
    """The histogram bin of an idle age: 4 bins an octave, the last open-ended."""
    return min(int(math.log2(age + 1.0) * _BINS_PER_OCTAVE), _NUM_AGE_BINS - 1)


def class_of(num_uses: int, depth: int) -> int:
    """A block's class: its hand-out bucket (1, 2, 3-4, 5+) by its depth bucket (log2)."""
    use_bucket = min((max(num_uses, 1) - 1).bit_length(), _NUM_USE_BUCKETS - 1)
    return use_bucket * _NUM_DEPTH_BUCKETS + min(depth.bit_length(), _NUM_DEPTH_BUCKETS - 1)


@dataclass(slots=True)
class Stay:
    """One block's stay under one hash; kept while the block is out of the policy for a hit.

    Attributes:
        block_hash: the hash the block holds during this stay.
        num_accesses: the allocator's hand-out count last seen, to count new hits.
        num_uses: hand-outs of this hash, earlier stays (remembered by hash) included.
        depth: position of the block in its chain.
        last_access: clock of its last use.
        klass: its class, from ``num_uses`` and ``depth``.
    """

    block_hash: int
    num_accesses: int
    num_uses: int
    depth: int
    last_access: int
    klass: int


NUM_CLASSES = _NUM_USE_BUCKETS * _NUM_DEPTH_BUCKETS


class HazardLearning:
    """Per-class reuse statistics and the hazard score (see ``HazardPolicy``'s docstring)."""

    _REFRESH_EVENTS = 256
    _window: float
    _decay: float
    _prior_weight: float
    _lifetime: float
    _events: int

    def _clear_learning(self) -> None:
        """Forget every statistic: no class has seen a block."""
        num_classes = NUM_CLASSES
        self._entered = [0.0] * num_classes  # blocks that entered each class (decayed)
        self._reuses = [[0.0] * _NUM_AGE_BINS for _ in range(num_classes)]  # by age bin
        # Refreshed tables: _cumulative[c][b] = reuses of class c at age bins < b.
        self._cumulative = [[0.0] * (_NUM_AGE_BINS + 1) for _ in range(num_classes)]
        self._pooled = [0.0] * (_NUM_AGE_BINS + 1)  # the same, all classes, per entered block
        self._events = 0
        self._lifetime = 0.0  # running mean idle age of victims: the window W

    def _enter(self, klass: int, learned: list[Any] | None) -> None:
        """Count a block entering ``klass``; note the old count in ``learned`` (bin -1)."""
        if learned is not None:
            learned.append((klass, -1, self._entered[klass]))
        self._entered[klass] += 1.0
        self._tick(learned)

    def _record_reuse(self, klass: int, age: int, learned: list[Any] | None) -> None:
        """Count a reuse at ``age``; note the old count in ``learned``."""
        reuses, age_bin = self._reuses[klass], _age_bin(max(age, 0))
        if learned is not None:
            learned.append((klass, age_bin, reuses[age_bin]))
        reuses[age_bin] += 1.0

    def _tick(self, learned: list[Any] | None) -> None:
        """Count an event; every ``_REFRESH_EVENTS``, refresh, noting the tables in ``learned``.

        ``learned`` is None outside a transaction: nothing is noted.
        """
        self._events += 1
        if self._events % self._REFRESH_EVENTS == 0:
            if learned is not None:
                learned.append(
                    (
                        self._entered[:],
                        [reuses[:] for reuses in self._reuses],
                        [cumulative[:] for cumulative in self._cumulative],
                        self._pooled,
                    )
                )
            self._refresh()

    def _unlearn(self, learned: list[Any], events: int) -> None:
        """Put back the counts and tables a call changed, as noted in ``learned``."""
        for note in reversed(learned):
            if len(note) == 4:
                self._entered, self._reuses, self._cumulative, self._pooled = note
                continue
            klass, age_bin, count = note
            if age_bin < 0:
                self._entered[klass] = count
            else:
                self._reuses[klass][age_bin] = count
        self._events = events

    def _refresh(self) -> None:
        """Decay the counts and rebuild the cumulative reuse tables. O(C x bins)."""
        total_entered = 0.0
        pooled = [0.0] * (_NUM_AGE_BINS + 1)
        for klass, reuses in enumerate(self._reuses):
            self._entered[klass] *= self._decay
            total_entered += self._entered[klass]
            running = 0.0
            cumulative = self._cumulative[klass]
            for age_bin in range(_NUM_AGE_BINS):
                reuses[age_bin] *= self._decay
                running += reuses[age_bin]
                cumulative[age_bin + 1] = running
                pooled[age_bin + 1] += running
        scale = 1.0 / total_entered if total_entered > 0 else 0.0
        self._pooled = [value * scale for value in pooled]

    def _score(self, klass: int, age: int) -> float:
        low = _age_bin(age)
        high = _age_bin(age + self._window * self._lifetime) + 1
        cumulative, pooled, weight = self._cumulative[klass], self._pooled, self._prior_weight
        reused_in_window = (
            cumulative[high] - cumulative[low] + weight * (pooled[high] - pooled[low])
        )
        survivors = self._entered[klass] - cumulative[low] + weight * (1.0 - pooled[low])
        return reused_in_window / survivors if survivors > 0 else 0.0
