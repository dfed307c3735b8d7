"""The clock and eviction calls of :class:`~prefixcache.KVBlockAllocator`.

The logical clock, touches, retention priorities and explicit eviction: each
validated here and run by the engine, which asks the policy (DESIGN.md, "The
engine").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from prefixcache.engine.block_ids import BlockIdsLike, to_block_ids
from prefixcache.engine.core import EngineCore
from prefixcache.engine.prefix_hashing import to_hash_list
from prefixcache.engine.validation import require_int
from prefixcache.errors import ConfigError
from prefixcache.policies import EvictionPolicy, has_hook

__all__ = ["MAX_CLOCK", "ClockMethods", "check_count"]

MAX_CLOCK = 1 << 62
"""Furthest :meth:`KVBlockAllocator.advance_clock` may take the logical clock.

The clock is stored in int64 per block; stopping at 2**62 leaves 2**62 ticks
of room for the one tick each later hand-out, hit or touch adds."""


def check_count(num_blocks: object) -> int:
    """``num_blocks`` as an int >= 0 (InvalidArgumentError otherwise)."""
    return require_int(num_blocks, "num_blocks", minimum=0)


class ClockMethods:
    """The logical clock, touches, retention priorities and explicit eviction."""

    _engine: EngineCore
    _max_hash: int
    _track_changes: bool
    num_usable: int
    enable_prefix_caching: bool
    policy: EvictionPolicy

    def _sync_collaborators(self) -> None:
        raise NotImplementedError  # the facade's: it hands the engine's changes on

    def advance_clock(self, ticks: int = 1) -> int:
        """Move the logical clock forward and return it.

        Every hand-out and touch already ticks the clock once, so recency
        works without calling this; call it to mark coarser boundaries.

        Raises:
            InvalidArgumentError: ``ticks`` is not an int >= 0, or would take
                the clock past :data:`MAX_CLOCK` (2**62).

        Complexity: O(1).
        """
        ticks = require_int(ticks, "ticks", minimum=0, maximum=MAX_CLOCK - self._engine.clock)
        return int(self._engine.advance_clock(ticks))

    @property
    def clock(self) -> int:
        """The current logical clock value."""
        return int(self._engine.clock)

    def update_timestamps(self, block_ids: BlockIdsLike) -> None:
        """Mark blocks as used now, so recency-based policies keep them longer.

        Raises:
            InvalidTensorError, InvalidBlockIdError: malformed IDs.
            BlockStateError: a block is free.

        Complexity: O(k) vectorised, plus O(log n) per touched cached leaf.
        """
        ids = to_block_ids(block_ids, self.num_usable)
        if ids.size:
            self._engine.touch(ids)

    def set_retention_priority(
        self, block_hashes: Any, priority: int, *, duration: int | None = None
    ) -> None:
        """Ask the policy to keep the blocks of ``block_hashes`` longer (or shorter).

        For pinning a system prompt or an agent's paused context. Lower
        priorities are evicted first; after ``duration`` clock ticks the
        hashes fall back to the default priority. Hashes need not be
        registered yet: the priority applies whenever they are cached.

        Raises:
            ConfigError: the configured policy has no retention priorities.
            InvalidTensorError, InvalidArgumentError: malformed hashes,
                priority or duration.
            Whatever the policy raises; the calls run in one policy
                transaction, so none of the priorities is kept (a legacy
                policy without transactions keeps those set before).

        Complexity: O(k) policy calls.
        """
        if not has_hook(self.policy, "set_retention"):
            raise ConfigError(
                f"policy {type(self.policy).__name__} does not support retention priorities; "
                "configure one that does (e.g. 'priority')"
            )
        hashes = to_hash_list(block_hashes, "block_hashes", self._max_hash)
        priority = require_int(priority, "priority")
        if duration is not None:
            duration = require_int(duration, "duration", minimum=0, maximum=MAX_CLOCK)
        expires_at = None if duration is None else self._engine.clock + duration
        self._engine.set_retention(hashes, priority, expires_at)

    def evict_cached_blocks(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` cached blocks through the policy.

        Returns:
            How many blocks were freed.

        Complexity: O(log n) per evicted block.
        """
        num_freed = self._engine.evict(check_count(num_blocks))
        if self._track_changes:
            self._sync_collaborators()
        return int(num_freed)

    def evict_blocks(self, block_ids: BlockIdsLike) -> int:
        """Free the cached leaves among ``block_ids``, tail-first under the leaf rule.

        Walks the IDs from the end: a block that is cached (no reference,
        registered) and a leaf (no registered child) leaves the policy and the
        registry and is freed; its parent may then become a leaf in turn (so a
        chain given in order is eaten from its end). Referenced, unregistered
        and non-leaf blocks are skipped, not refused: a prefix another chain
        still hangs off stays. Counted in ``stats()``'s evictions; removal
        events are emitted as for eviction.

        Returns:
            How many blocks were freed.

        Raises:
            InvalidTensorError, InvalidBlockIdError: malformed IDs (the dummy
                block included). Nothing changes.

        Complexity: O(k) plus O(log n) policy work per freed block.
        """
        ids = to_block_ids(block_ids, self.num_usable)
        num_freed = self._engine.evict_blocks(ids) if ids.size else 0
        if num_freed and self._track_changes:
            self._sync_collaborators()
        return int(num_freed)

    def end_conversation(self, block_hashes: Any) -> int:
        """A conversation ended: free the cached end of its chain (``evict_blocks``).

        Looks the chained hashes up (the hit counters do not move) and frees
        the cached leaves of the longest registered prefix, tail-first. Blocks
        still referenced, and a shared prefix that another chain hangs off,
        stay. With prefix caching off nothing is cached: returns 0.

        Returns:
            How many blocks were freed.

        Raises:
            InvalidTensorError, InvalidArgumentError: malformed hashes. Nothing changes.

        Complexity: O(len(block_hashes)) lookups, then as ``evict_blocks``.
        """
        hashes = to_hash_list(block_hashes, "block_hashes", self._max_hash)
        if not hashes or not self.enable_prefix_caching:
            return 0
        ids = self._engine.lookup(hashes).astype(np.intp)
        return self.evict_blocks(ids) if len(ids) else 0

    def evict_lru_blocks(self, num_blocks: int) -> bool:
        """Megatron-core's name: evict ``num_blocks`` cached blocks, all or none.

        Delegates to the configured policy (LRU by default).

        Returns:
            True if that many blocks were evicted; False (nothing changes) if
            fewer are cached.
        """
        engine = self._engine
        if check_count(num_blocks) > engine.num_evictable(engine.num_cached):
            return False
        self.evict_cached_blocks(num_blocks)
        return True
