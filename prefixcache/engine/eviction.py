"""EvictionPlanner: which blocks an eviction frees, decided before anything changes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from prefixcache.engine.journal import PolicyJournal
from prefixcache.engine.registry import ROOT, HashRegistry
from prefixcache.errors import InvariantError
from prefixcache.policies import EvictionPolicy, has_hook


class EvictionPlanner:
    """Chooses the blocks that free room, changing nothing but the policy.

    The engine's strong exception guarantee needs every fallible call (the
    policy's, then the pool's) made before it writes its own state. An
    eviction is interactive: evicting a leaf may expose its parent, which
    the policy must hear of before it picks the next victim. The planner
    plays that dialogue against the registry as it would be after the
    removals, without touching it, inside the policy transaction of a
    :class:`~prefixcache.engine.journal.PolicyJournal`; the engine then
    commits the plan (registry, counters, pool) and the journal, or rolls
    the journal back (DESIGN.md, "The transaction rule").

    It reads the allocator's per-block arrays, which stay the same objects
    for the allocator's lifetime (``reset`` clears them in place).

    Args:
        policy: the allocator's eviction policy.
        registry: the allocator's hash registry.
        active_refs, paused_refs: reference counts per block ID.
        last_access: clock of each registered block's last access.
        num_usable: usable blocks (the dummy block's ID).
        leaf_args: a block's insert arguments after its ID (hash, last
            access, accesses, depth), for the policy's ``evicts_first``.
    """

    def __init__(
        self,
        policy: EvictionPolicy,
        registry: HashRegistry,
        active_refs: np.ndarray,
        paused_refs: np.ndarray,
        last_access: np.ndarray,
        num_usable: int,
        leaf_args: Callable[[int], tuple[int, int, int, int]],
    ) -> None:
        self._policy = policy
        self._leaf_args = leaf_args
        # A policy that can say whether an exposed parent would be its next victim
        # lets a chain be evicted from its end without a round trip per block.
        self._evicts_first = policy.evicts_first if has_hook(policy, "evicts_first") else None
        self._registry = registry
        self._active_refs = active_refs
        self._paused_refs = paused_refs
        self._last_access = last_access
        self._num_usable = num_usable

    def plan(self, num_blocks: int, journal: PolicyJournal) -> tuple[list[int], list[int]]:
        """Choose what frees ``num_blocks`` blocks, changing only the policy (via ``journal``).

        Victims are asked for one at a time: evicting a leaf may expose its
        parent as a new leaf, which must compete with the other leaves for
        the next slot, so the order never depends on how many are evicted.
        ``lost_children`` counts the children each block loses to the plan
        and ``gone`` holds the blocks the plan deregisters. A victim must be
        a cached leaf once those apply: registered, unreferenced, childless.
        When the policy has no leaf left, the subtree of the deepest pinned
        cached block goes (see :meth:`_deepest_pinned_cached_block`).

        Args:
            num_blocks: blocks to free; at most the number of cached blocks.
            journal: the open journal the policy calls go through.

        Returns:
            Exactly ``num_blocks`` blocks to free, in order; and the blocks that lose their hash
            (those, plus referenced descendants of a dropped subtree), in an
            order where each is childless at its turn.

        Raises:
            InvariantError: the policy chose something other than one cached
                leaf, or has none left while cached leaves remain. The policy
                calls already made stay in the open transaction for the
                caller to roll back.

        Complexity: O(log n) policy work and O(1) else per evicted block.
        """
        freed: list[int] = []
        dropped: list[int] = []
        gone: set[int] = set()
        lost_children: dict[int, int] = {}
        # Per evicted block this loop is the hot path of eviction-bound serving,
        # so the checks run inline on local names.
        pick, insert = self._policy.evict, journal.insert
        note_victim = journal.evicted if journal.NOTES_VICTIMS else None
        evicts_first, leaf_args = self._evicts_first, self._leaf_args
        next_victim = ROOT  # an exposed parent the policy would evict next, kept from it
        registry = self._registry
        is_registered, num_children, parent_of = (
            registry.is_registered,
            registry.num_children,
            registry.parent_of,
        )
        active, paused, num_usable = self._active_refs, self._paused_refs, self._num_usable
        while len(freed) < num_blocks:
            if next_victim != ROOT:
                block_id, next_victim = next_victim, ROOT
            elif victims := pick(1):
                block_id = victims[0]
                if (  # not a cached leaf once the plan's removals apply
                    len(victims) != 1
                    or not isinstance(block_id, (int, np.integer))
                    or not 0 <= block_id < num_usable
                    or block_id in gone
                    or not is_registered[block_id]
                    or active[block_id]
                    or paused[block_id]
                    or num_children[block_id] != lost_children.get(block_id, 0)
                ):
                    raise InvariantError(
                        f"policy {type(self._policy).__name__} chose {victims}, not one cached leaf"
                    )
                block_id = int(block_id)
                if note_victim is not None:
                    note_victim(block_id)
            else:
                block_id = self._drop_pinned_subtree(gone, lost_children, dropped)
            gone.add(block_id)
            freed.append(block_id)
            dropped.append(block_id)
            # The parent loses a child; left a cached leaf, it joins the policy, unless the
            # policy says it would evict it next: then it is the next victim directly.
            parent_id = int(parent_of[block_id])
            if parent_id != ROOT:
                lost = lost_children[parent_id] = lost_children.get(parent_id, 0) + 1
                if lost == num_children[parent_id] and not (active[parent_id] or paused[parent_id]):
                    if (
                        evicts_first is not None
                        and len(freed) < num_blocks
                        and evicts_first(parent_id, *leaf_args(parent_id))
                    ):
                        next_victim = parent_id
                    else:
                        insert(parent_id)
        return freed, dropped

    def _drop_pinned_subtree(
        self, gone: set[int], lost_children: dict[int, int], dropped: list[int]
    ) -> int:
        """The policy has no leaf left: plan to drop the deepest pinned cached block's subtree.

        Its referenced descendants go to ``gone`` and ``dropped`` (they lose
        their hashes); the block itself, the only one freed, is returned.
        """
        block_id = self._deepest_pinned_cached_block(gone, lost_children)
        subtree = self.subtree(block_id, gone)  # children first: block_id is last
        cached = [b for b in subtree if self.is_unreferenced(b)]
        if len(cached) != 1:  # only block_id: a cached descendant is a lost leaf
            raise InvariantError(
                f"policy {type(self._policy).__name__} has no leaf to evict, yet "
                f"the subtree of pinned block {block_id} holds {len(cached) - 1} "
                "cached block(s) below it"
            )
        gone.update(subtree[:-1])
        dropped.extend(subtree[:-1])
        return block_id

    def is_unreferenced(self, block_id: int) -> bool:
        """Whether no request, running or paused, holds ``block_id``. O(1)."""
        return not self._active_refs[block_id] and not self._paused_refs[block_id]

    def subtree(self, root_id: int, gone: set[int]) -> list[int]:
        """``root_id`` and its registered descendants outside ``gone``, children first.

        Complexity: O(subtree size).
        """
        order: list[int] = []
        stack = [root_id]
        children_of = self._registry.children_of
        while stack:
            block_id = stack.pop()
            order.append(block_id)
            stack.extend(c for c in children_of(block_id) if c not in gone)
        order.reverse()
        return order

    def _deepest_pinned_cached_block(self, gone: set[int], lost_children: dict[int, int]) -> int:
        """A cached block with children, when the policy has no leaves left.

        Such a block is pinned below by a referenced descendant: it happens
        only when a request released a prefix while still holding later
        blocks, or holds a block registered under another request's prefix.
        The deepest one has no cached descendant (it would be deeper, or a
        leaf), so dropping its subtree frees exactly one block; among equals
        the least recently used goes.
        Complexity: O(total_count); reached only in that rare case.
        """
        registry = self._registry
        candidates = [
            block_id
            for block_id in np.flatnonzero(
                registry.is_registered
                & (self._active_refs == 0)
                & (self._paused_refs == 0)
                & (registry.num_children > 0)
            ).tolist()
            if block_id not in gone
            and registry.num_children[block_id] > lost_children.get(block_id, 0)
        ]
        if not candidates:
            raise InvariantError(
                f"policy {type(self._policy).__name__} has no leaf to evict, "
                "yet cached blocks remain"
            )
        ids = np.asarray(candidates)
        depths = registry.depth_of[ids]
        deepest = ids[depths == depths.max()]
        return int(deepest[np.argmin(self._last_access[deepest])])
