"""The Python engine's hit and reference steps (a mixin of ``PythonEngine``).

A prefix hit and an explicit acquire take active references on distinct blocks. The
policy's part comes first, as one transaction (the cached leaves a reference takes out of
the policy, then a hit's ``on_hit``): when it raises, the policy is rolled back and the
engine has written nothing (DESIGN.md, "The transaction rule").
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from prefixcache.engine.journal import PolicyJournal
from prefixcache.engine.partitions import PartitionLedger
from prefixcache.engine.references import ReferenceTable, check_headroom, count_occurrences
from prefixcache.engine.registry import HashRegistry
from prefixcache.errors import BlockStateError

__all__ = ["PythonHitSteps"]


class PythonHitSteps:
    """``take_hit`` and ``acquire`` of the Python engine; see the module doc."""

    refs: ReferenceTable
    registry: HashRegistry
    ledger: PartitionLedger
    retains_unreferenced: bool
    _observe_hit: Callable[[list[int]], None] | None
    _num_queried: int
    _num_hits: int
    _clock: int

    def _journal(self) -> PolicyJournal:
        raise NotImplementedError  # the engine's

    def take_hit(self, block_ids: np.ndarray, num_queried: int, *, acquire: bool) -> None:
        matched = block_ids
        if acquire and len(matched):
            # A chain (each block the parent of the next) repeats no block.
            heard = None
            if self._observe_hit is not None:  # told inside the discards' transaction
                hash_of = self.registry.hash_of
                hashes = [int(hash_of(block_id)) for block_id in matched.tolist()]
                heard = partial(self._observe_hit, hashes)
            if len(matched) < 2 or np.array_equal(
                self.registry.parent_of[matched[1:]], matched[:-1]
            ):
                self._take_references(matched, None, heard)
            else:
                self._take_references(*count_occurrences(matched), heard)
        self._num_queried += num_queried
        self._num_hits += len(matched)

    def acquire(self, block_ids: np.ndarray) -> None:
        unique, counts = count_occurrences(block_ids)
        free = ~self.registry.is_registered[unique] & self.refs.is_unreferenced(unique)
        if free.any():
            raise BlockStateError(
                f"block {int(unique[free][0])} is free; only cached or referenced blocks "
                "can be acquired (allocate fresh blocks instead)"
            )
        self._take_references(unique, counts)

    def _take_references(
        self,
        unique: np.ndarray,
        counts: np.ndarray | None,
        heard: Callable[[], None] | None = None,
    ) -> None:
        """Commit new active references (one each if ``counts`` is None) on distinct blocks.

        The policy's part comes first, as one transaction: the cached leaves taken out,
        then ``heard()`` (a hit's ``on_hit``); if either raises, the policy is rolled back
        and nothing of the engine's was written.
        """
        refs, ledger = self.refs, self.ledger
        delta = 1 if counts is None else counts
        active = refs.active[unique]
        check_headroom(unique, active, delta, "active")
        inactive = active == 0
        num_activated = np.count_nonzero(inactive)
        leaves: list[int] = []
        if num_activated:
            activated = unique if num_activated == len(unique) else unique[inactive]
            paused = refs.paused[activated]
            num_from_paused = np.count_nonzero(paused)
            cached = activated[paused == 0] if num_from_paused else activated
            if len(cached) and self.retains_unreferenced:
                leaves = cached[self.registry.num_children[cached] == 0].tolist()
        if leaves or heard is not None:
            self._discard_leaves(leaves, heard)
        if num_activated:
            ledger.num_active += int(num_activated)
            ledger.num_paused -= int(num_from_paused)
            ledger.num_cached -= len(cached)
        refs.active[unique] = active + delta
        self._clock += 1
        refs.last_access[unique] = self._clock
        refs.num_accesses[unique] += delta

    def _discard_leaves(
        self,
        leaves: list[int],
        heard: Callable[[], None] | None = None,
        *,
        before: Callable[[], None] | None = None,
    ) -> None:
        """Call ``before``, take cached leaves out of the policy, then call ``heard``: one
        policy transaction, all or none (a raising hook leaves the policy as it was)."""
        journal = self._journal()
        try:
            if before is not None:
                before()
            for block_id in leaves:
                journal.discard(block_id)
            if heard is not None:
                heard()
        except BaseException:
            journal.rollback()
            raise
        journal.commit()
