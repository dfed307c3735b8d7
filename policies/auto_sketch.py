"""``auto``'s use counts: a count-min sketch of block hashes, in bounded memory.

A prefix that was reused, evicted and computed again must still be known as
reused (that is the point of ``frequent``, W-TinyLFU's admission rule), so
counts are kept by hash, not by block, in 4 rows of one-byte counters that
saturate at 15, with conservative update; every count is halved each
``sample_ratio`` x pool uses so old popularity fades. A mixin of
:class:`~prefixcache.policies.auto.AutoPolicy`: the state lives on the policy,
the undo log is the policy's (every change is recorded with its inverse).
Integer arithmetic only (64-bit multiply-shift hashing), so a native port
gives the same counts.
"""

from __future__ import annotations

from typing import Any

ROWS = 4  # count-min sketch rows
MAX_COUNT = 15  # sketch counters saturate here (4 bits' worth, as in TinyLFU)
MASK64 = (1 << 64) - 1
_HALVE = bytes(value >> 1 for value in range(256))  # bytearray.translate table: every count / 2


class UseSketch:
    """The count-min sketch of uses by hash (a mixin: see the module docstring).

    Row ``r``'s counter for hash ``h`` is the top ``log2(width)`` bits of
    ``(h mod 2**64) * multiplier[r] mod 2**64``.
    """

    _multipliers: tuple[int, ...]
    _sketch_ratio: float
    _sample_ratio: float
    _width: int
    _sketch: bytearray
    _shift: int
    _added: int  # uses counted since the last halving
    _sample: int  # uses between two halvings

    @property
    def sketch_multipliers(self) -> tuple[int, ...]:
        """The odd 64-bit multiplier of each row (``seed`` picks them), for a native port."""
        return self._multipliers

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
        sketch = bytearray(ROWS * width)
        for row in range(ROWS):
            counters = old[row * old_width : (row + 1) * old_width]
            for offset in range(factor):  # strided slice assignment: C speed
                sketch[row * width + offset : (row + 1) * width : factor] = counters
        self._sketch, self._width = sketch, width
        self._shift = 64 - (width.bit_length() - 1)

    def _indices(self, block_hash: int) -> tuple[int, int, int, int]:
        """The hash's counter in each of the four rows (unrolled: it runs once per use)."""
        value, shift, width = block_hash & MASK64, self._shift, self._width
        m0, m1, m2, m3 = self._multipliers
        return (
            ((value * m0) & MASK64) >> shift,
            width + (((value * m1) & MASK64) >> shift),
            2 * width + (((value * m2) & MASK64) >> shift),
            3 * width + (((value * m3) & MASK64) >> shift),
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
        if target > MAX_COUNT:
            target = MAX_COUNT
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

    def _count_run(self, block_hashes: list[int], undo: list[Any] | None) -> None:
        """``_count(h, 1, undo)`` for each hash of a run, inlined: it runs once per registration.

        One undo entry per run (and one per halving inside it): the changed
        counters, flat (index, old value, ...).
        """
        m0, m1, m2, m3 = self._multipliers
        shift, width, sketch, sample = self._shift, self._width, self._sketch, self._sample
        added = first_added = self._added
        changed: list[int] = []
        for block_hash in block_hashes:
            value = block_hash & MASK64
            i0 = ((value * m0) & MASK64) >> shift
            i1 = width + (((value * m1) & MASK64) >> shift)
            i2 = 2 * width + (((value * m2) & MASK64) >> shift)
            i3 = 3 * width + (((value * m3) & MASK64) >> shift)
            c0, c1, c2, c3 = sketch[i0], sketch[i1], sketch[i2], sketch[i3]
            target = min(c0, c1, c2, c3) + 1
            if target <= MAX_COUNT:
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

    def _uses_after(self, block_hash: int, new_uses: int) -> int:
        """What ``uses(block_hash)`` would be after ``_count(block_hash, new_uses)``; no change."""
        sketch, shift, width = self._sketch, self._shift, self._width  # as in uses(), inlined
        value = block_hash & MASK64
        m0, m1, m2, m3 = self._multipliers
        uses = min(
            sketch[((value * m0) & MASK64) >> shift],
            sketch[width + (((value * m1) & MASK64) >> shift)],
            sketch[2 * width + (((value * m2) & MASK64) >> shift)],
            sketch[3 * width + (((value * m3) & MASK64) >> shift)],
        )
        if new_uses > 0:
            uses = min(uses + new_uses, MAX_COUNT)
            if self._added + new_uses >= self._sample:
                uses >>= 1
        return uses

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
