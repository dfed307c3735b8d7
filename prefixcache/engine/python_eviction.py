"""The Python engine's eviction and time steps: touch, evict, retention, evicting hand-outs.

A mixin of :class:`~prefixcache.engine.python_engine.PythonEngine`, one concern
a file like the facade's mixins: each step opens a policy transaction
(:class:`~prefixcache.engine.journal.PolicyJournal`), makes its fallible policy
and pool calls, and writes the engine's own state only once they succeeded
(DESIGN.md, "The transaction rule").
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from prefixcache.engine.eviction import EvictionPlanner
from prefixcache.engine.free_list import SortedFreeList
from prefixcache.engine.journal import PolicyJournal
from prefixcache.engine.partitions import PartitionLedger
from prefixcache.engine.pool import BlockPool
from prefixcache.engine.references import ReferenceTable
from prefixcache.engine.registry import HashRegistry
from prefixcache.errors import BlockStateError
from prefixcache.policies import EvictionPolicy, is_transactional

__all__ = ["PythonEvictionSteps"]


class PythonEvictionSteps:
    """``touch``, ``evict``, ``evict_blocks``, ``set_retention`` and the evicting hand-out of
    ``allocate``."""

    policy: EvictionPolicy
    pool: BlockPool | SortedFreeList
    refs: ReferenceTable
    registry: HashRegistry
    _observe_end: Callable[[list[int]], None] | None
    ledger: PartitionLedger
    planner: EvictionPlanner
    retains_unreferenced: bool
    _clock: int
    _num_evicted: int
    _track_changes: bool
    _freed: list[np.ndarray]

    def _journal(self) -> PolicyJournal:
        raise NotImplementedError  # the engine's

    def _record_removed(self, hashes: list[int]) -> None:
        raise NotImplementedError  # the engine's

    def touch(self, block_ids: np.ndarray) -> None:
        ids = block_ids
        unreferenced = self.refs.is_unreferenced(ids)
        free = unreferenced & ~self.registry.is_registered[ids]
        if free.any():
            raise BlockStateError(
                f"block {int(ids[free][0])} is free; it has no timestamp to update"
            )
        now = self._clock + 1
        if self.retains_unreferenced:
            leaves = np.unique(ids[unreferenced & (self.registry.num_children[ids] == 0)])
            journal = self._journal()
            try:
                for block_id in leaves.tolist():
                    journal.touch(block_id, now)
            except BaseException:
                journal.rollback()
                raise
            journal.commit()
        self._clock = now
        self.refs.last_access[ids] = now

    def num_evictable(self, num_blocks: int) -> int:
        raise NotImplementedError  # the engine's

    def evict(self, num_blocks: int) -> int:
        num_blocks = self.num_evictable(min(num_blocks, self.ledger.num_cached))
        if not num_blocks:
            return 0
        return self._run_plan(functools.partial(self.planner.plan, num_blocks))

    def evict_blocks(self, block_ids: np.ndarray) -> int:
        if not self.retains_unreferenced or not len(block_ids):
            return 0
        ids = block_ids.tolist()

        def plan(journal: PolicyJournal) -> tuple[list[int], list[int]]:
            freed = self.planner.plan_blocks(ids, journal)
            return freed, freed  # the freed blocks are the ones that lose their hashes

        return self._run_plan(plan, ended=True)

    def _run_plan(
        self, plan: Callable[[PolicyJournal], tuple[list[int], list[int]]], ended: bool = False
    ) -> int:
        """Free what ``plan`` chooses, all or nothing: the frame of ``evict`` and ``evict_blocks``.

        ``plan`` makes its policy calls through the journal it is given and
        returns the blocks to free and the blocks that lose their hashes (as
        :meth:`EvictionPlanner.plan` does). The pool takes the freed blocks
        back inside the same transaction; if either fails, the plan's
        hand-downs are undone and the journal rolls back, so nothing changes.
        Only then are the registry and counters written. ``ended`` (a conversation's
        end): the freed blocks' hashes go to the policy's ``on_end`` before the pool
        takes them, inside the transaction (an ``on_end`` that raises changes nothing).

        Returns:
            The number of blocks freed.
        """
        journal = self._journal()
        try:
            freed, dropped = plan(journal)
            if freed and ended and self._observe_end is not None:  # in the transaction
                hash_of = self.registry.hash_of
                self._observe_end([int(hash_of(block_id)) for block_id in freed])
            if freed:
                self.pool.release(np.asarray(freed, dtype=np.int32))
        except BaseException:
            self.planner.undo_hand_downs()
            journal.rollback()
            raise
        journal.commit()
        if freed:
            self._commit_eviction(freed, dropped)
            if self._track_changes:
                self._freed.append(np.asarray(freed, dtype=np.int32))
        return len(freed)

    def set_retention(self, block_hashes: list[int], priority: int, expires_at: int | None) -> None:
        # One policy transaction: a policy that raises midway keeps none of the priorities.
        policy = self.policy
        transactional = is_transactional(policy)
        if transactional:
            policy.begin()
        try:
            for block_hash in block_hashes:
                policy.set_retention(block_hash, priority, expires_at)
        except BaseException:
            if transactional:
                policy.abort()
            raise
        if transactional:
            policy.commit()

    def _allocate_evicting(self, num_blocks: int, shortfall: int) -> np.ndarray:
        """Evict ``shortfall`` cached blocks and hand them out with every free block.

        The evicted blocks go straight to the caller, in the order that
        pushing them on the free stack and popping ``num_blocks`` would give,
        so the stack ends exactly as if they had passed through it.
        """
        journal = self._journal()
        try:
            freed, dropped = self.planner.plan(shortfall, journal)
            if isinstance(self.pool, SortedFreeList):  # through the list: it picks the order
                self.pool.release(np.asarray(freed, dtype=np.int32))
                block_ids = self.pool.acquire(num_blocks)
            else:
                block_ids = np.concatenate(
                    (
                        np.asarray(freed[::-1], dtype=np.int32),
                        self.pool.acquire(num_blocks - shortfall),
                    )
                )
        except BaseException:
            self.planner.undo_hand_downs()
            journal.rollback()
            raise
        journal.commit()
        self._commit_eviction(freed, dropped)
        return block_ids

    def _commit_eviction(self, freed: list[int], dropped: list[int]) -> None:
        """Apply a plan whose policy and pool calls succeeded: deregister and count."""
        self._record_removed(self.registry.deregister_leaves(dropped))
        self.ledger.num_cached -= len(freed)
        self._num_evicted += len(freed)
