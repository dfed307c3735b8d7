"""The partition calls of :class:`~prefixcache.KVBlockAllocator`: pause, resume, counts.

Each is one validated call into the engine (DESIGN.md, "The engine"); the
partition ledger itself lives in the engine.
"""

from __future__ import annotations

import numpy as np
import torch

from prefixcache.engine.block_ids import BlockIdsLike, to_block_ids
from prefixcache.engine.core import EngineCore

__all__ = ["PartitionMethods"]


class PartitionMethods:
    """Active and paused references, and the O(1) counters of every block state."""

    _engine: EngineCore
    num_usable: int
    active_count: int
    paused_count: int

    def _resume_with_hints(self, ids: np.ndarray) -> None:
        raise NotImplementedError  # hint_methods.py: move, yielding hints when short

    def pause(self, block_ids: BlockIdsLike) -> None:
        """Move one reference per occurrence from the active to the paused partition.

        Raises:
            ReferenceCountError: a block holds fewer active references than asked.
            BudgetExceededError: more blocks would take their first paused
                reference than :meth:`get_paused_avail` (nothing changes).

        Complexity: O(k log k) vectorised.
        """
        ids = to_block_ids(block_ids, self.num_usable)
        if ids.size:
            self._engine.move(ids, to_paused=True)

    def resume(self, block_ids: BlockIdsLike) -> None:
        """Move one reference per occurrence from the paused to the active partition.

        Raises:
            ReferenceCountError: a block holds fewer paused references than asked.
            BudgetExceededError: more than ``active_count`` blocks would be active,
                even with every scheduler hint withdrawn (hints are withdrawn,
                newest first, when that makes the resume fit).

        Complexity: O(k log k) vectorised.
        """
        ids = to_block_ids(block_ids, self.num_usable)
        if ids.size:
            self._resume_with_hints(ids)

    def reference_counts(self, block_ids: BlockIdsLike) -> tuple[torch.Tensor, torch.Tensor]:
        """Active and paused reference counts of ``block_ids`` (fresh int32 tensors).

        For debugging and tests; schedulers should not need it. Complexity: O(k).
        """
        ids = to_block_ids(block_ids, self.num_usable)
        active, paused = self._engine.reference_counts(ids)
        return torch.from_numpy(active), torch.from_numpy(paused)

    def get_total_used(self) -> int:
        """Blocks not on the free stack (active + paused + cached). O(1)."""
        return self.num_usable - int(self._engine.num_free)

    def get_active_used(self) -> int:
        """Blocks held by at least one running request. O(1)."""
        return int(self._engine.num_active)

    def get_paused_used(self) -> int:
        """Blocks held only by paused requests. O(1)."""
        return int(self._engine.num_paused)

    def get_active_avail(self) -> int:
        """``active_count`` minus :meth:`get_active_used`. O(1).

        Negative when allocation went past the active budget: allocation is
        bounded by the whole pool, as in Megatron-core, and the active budget
        binds :meth:`resume` only.
        """
        return self.active_count - int(self._engine.num_active)

    def get_paused_avail(self) -> int:
        """Blocks that may still take their first paused reference (never negative). O(1).

        The paused budget bounds every block holding a paused reference, also
        one a running request holds too (it becomes paused-only, and is counted
        by :meth:`get_paused_used`, when that request releases it), so this is
        ``paused_count`` minus those blocks: at most ``paused_count -
        get_paused_used()``, and what :meth:`pause` checks.
        """
        return self.paused_count - int(self._engine.num_holding_paused)

    def get_evictable_block_count(self) -> int:
        """Cached blocks, all of which eviction can reclaim. O(1)."""
        return int(self._engine.num_cached)
