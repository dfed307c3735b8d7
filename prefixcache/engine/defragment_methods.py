"""DefragmentMethods: the allocator's defragmentation calls (DESIGN.md, "Defragmentation")."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from prefixcache.engine.block_ids import to_block_ids
from prefixcache.engine.core import EngineCore
from prefixcache.engine.defragment import DefragmentPlan, largest_free_run, plan_compaction
from prefixcache.engine.routing import RoutingStore
from prefixcache.errors import InvalidArgumentError

CopyCallback = Callable[[torch.Tensor, torch.Tensor], object]
"""``copy(sources, destinations)``: copy the KV data of each source block to its destination.

Both are int64 CPU tensors of equal length; a destination is free until the
allocator commits the move, so a copy that fails half way harms nothing.
:meth:`prefixcache.serving.KVCache.copy_blocks` is one."""


class DefragmentMethods:
    """Compaction of the live blocks into the lowest IDs, mixed into the allocator.

    :meth:`plan_defragment` says which blocks move where; :meth:`apply_defragment`
    checks the plan against the state now, runs the KV storage's copy, then has
    the engine relocate each block's state (counts, hash, links, policy entry,
    free list) and moves the facade's own per-block data (MoE routing,
    verification fingerprints, scheduler hints). KV events carry hashes, not block IDs, so a
    relocation publishes none. Block tables follow with
    :meth:`prefixcache.serving.BlockTable.apply_moves`.
    """

    _engine: EngineCore
    _layout_epoch: int
    num_usable: int
    routing: RoutingStore | None
    _fingerprint_of_block: list[int]

    def _move_hints(self, sources: np.ndarray, destinations: np.ndarray) -> None:
        raise NotImplementedError  # hint_methods.py: hinted blocks follow the moves

    def plan_defragment(self) -> DefragmentPlan:
        """The fewest moves that pack every live (referenced or cached) block into the lowest IDs.

        Changes nothing. Live blocks at IDs at or past the live count move to
        the free IDs below it, both ascending. Complexity: O(num_usable).
        """
        return plan_compaction(self._engine.free_ids(), self.num_usable)

    def apply_defragment(self, plan: DefragmentPlan, copy: CopyCallback | None = None) -> int:
        """Apply ``plan``: copy the KV data, then move every block's state; return the moves.

        Args:
            plan: from :meth:`plan_defragment` (or any moves of live blocks to
                free ones), made since the last state change.
            copy: the KV storage's copy (see :data:`CopyCallback`), called
                once with all moves after the plan is checked and before any
                state changes; None when there is no storage to move.

        Raises:
            InvalidArgumentError: ``plan`` is not a DefragmentPlan, its lists
                differ in length, or an ID appears twice among the moves.
            InvalidBlockIdError, InvalidTensorError: an ID out of range or malformed.
            BlockStateError: a source is free, a destination is not, or a free
                group is open.
            ConfigError: a legacy (non-transactional) policy.
            Whatever ``copy`` raises. In every case nothing changes.

        Complexity: O(num_usable + k log n) plus the copy.
        """
        if not isinstance(plan, DefragmentPlan):
            raise InvalidArgumentError(f"plan must be a DefragmentPlan, got {type(plan).__name__}")
        sources = to_block_ids(plan.sources, self.num_usable, "sources")
        destinations = to_block_ids(plan.destinations, self.num_usable, "destinations")
        if len(sources) != len(destinations):
            raise InvalidArgumentError(
                f"{len(sources)} sources but {len(destinations)} destinations"
            )
        if not len(sources):
            return 0
        src, dst = sources.astype(np.int32), destinations.astype(np.int32)
        self._engine.relocate(src, dst, check_only=True)
        if copy is not None:
            copy(torch.from_numpy(src.astype(np.int64)), torch.from_numpy(dst.astype(np.int64)))
        self._engine.relocate(src, dst, check_only=False)
        self._move_hints(sources, destinations)
        self._layout_epoch += 1  # blocks moved: sessions look their chains up again
        both = np.concatenate((sources, destinations))
        swapped = np.concatenate((destinations, sources))
        if self.routing is not None:
            self.routing.swap_rows(both, swapped)
        fingerprints = self._fingerprint_of_block
        for source, destination in zip(sources.tolist(), destinations.tolist(), strict=True):
            fingerprints[source], fingerprints[destination] = (
                fingerprints[destination],
                fingerprints[source],
            )
        return len(sources)

    def largest_free_run(self) -> int:
        """The longest run of consecutive free IDs. Complexity: O(num_usable)."""
        return largest_free_run(self._engine.free_ids(), self.num_usable)
