"""The Python engine's partition steps: pause/resume moves, reference counts, block states.

A mixin of :class:`~prefixcache.engine.python_engine.PythonEngine`, one concern a
file like :mod:`~prefixcache.engine.python_eviction`: a move checks every count and
budget before it writes (DESIGN.md, "The transaction rule").
"""

from __future__ import annotations

import numpy as np

from prefixcache.engine.partitions import PartitionLedger
from prefixcache.engine.references import ReferenceTable, check_headroom, count_occurrences
from prefixcache.engine.registry import HashRegistry

__all__ = ["PythonPartitionSteps"]


class PythonPartitionSteps:
    """``move`` (pause and resume), ``reference_counts`` and ``describe_state``."""

    refs: ReferenceTable
    registry: HashRegistry
    ledger: PartitionLedger

    def move(self, block_ids: np.ndarray, *, to_paused: bool) -> None:
        refs = self.refs
        unique, counts = count_occurrences(block_ids)
        delta = 1 if counts is None else counts
        active, paused = refs.active[unique], refs.paused[unique]
        # Inside a free group, queued releases are no longer the caller's to pause.
        held = active - refs.pending[unique] if to_paused else paused
        refs.check_can_drop(
            unique, counts, held, "active" if to_paused else "paused", self.describe_state
        )
        check_headroom(
            unique, paused if to_paused else active, delta, "paused" if to_paused else "active"
        )
        ledger = self.ledger
        after_active, after_paused, total_active, total_paused, total_holding = ledger.plan_move(
            active, paused, delta, to_paused=to_paused
        )
        refs.active[unique] = after_active
        refs.paused[unique] = after_paused
        ledger.num_active, ledger.num_paused = total_active, total_paused
        ledger.num_holding_paused = total_holding

    def reference_counts(self, block_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.refs.active[block_ids], self.refs.paused[block_ids]

    def describe_state(self, block_id: int) -> str:
        if self.refs.active[block_id] > 0:
            return "active"
        if self.refs.paused[block_id] > 0:
            return "paused"
        return "cached" if self.registry.is_registered[block_id] else "free"
