"""EvictionPlanner: which blocks an eviction frees, decided before anything changes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from prefixcache.engine.journal import PolicyJournal
from prefixcache.engine.pins import PinnedChains
from prefixcache.engine.references import ReferenceTable
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
        refs: the reference table (its chain-pin arrays, engine/pins.py).
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
        refs: ReferenceTable,
    ) -> None:
        self._policy = policy
        self._refs = refs
        self._pinned = PinnedChains(registry, refs)
        # (block, last access, accesses, pin stamp, pin pending) before each hand-down of
        # the running plan, for undo_hand_downs.
        self._handed: list[tuple[int, int, int, int, int]] = []
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
        self._handed = []
        gone: set[int] = set()
        lost_children: dict[int, int] = {}
        # Per evicted block this loop is the hot path of eviction-bound serving,
        # so the checks run inline on local names.
        pick, insert, expose_parent = self._policy.evict, journal.insert, self._expose_parent
        note_victim = journal.evicted if journal.NOTES_VICTIMS else None
        evicts_first, leaf_args = self._evicts_first, self._leaf_args
        next_victim = ROOT  # an exposed parent the policy would evict next, kept from it
        is_registered, num_children = self._registry.is_registered, self._registry.num_children
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
            # The parent, left a cached leaf, joins the policy, unless the policy says it
            # would evict it next: then it is the next victim directly.
            if (parent_id := expose_parent(block_id, lost_children)) != ROOT:
                if (
                    evicts_first is not None
                    and len(freed) < num_blocks
                    and evicts_first(parent_id, *leaf_args(parent_id))
                ):
                    next_victim = parent_id
                else:
                    insert(parent_id)
        return freed, dropped

    def plan_blocks(self, block_ids: list[int], journal: PolicyJournal) -> list[int]:
        """Plan freeing the cached leaves among ``block_ids``, tail-first (``evict_blocks``).

        Walks the IDs from the end. A block that is a cached leaf once the
        plan's removals apply (registered, unreferenced, childless) is taken
        out of the policy (``discard``, as a hit takes a leaf out) and freed;
        its parent, left a cached leaf, is told to the policy as eviction
        tells it (after the pins' hand-down), unless it is the next ID of the
        walk: then it goes next without entering the policy. Any other block
        (referenced, unregistered, not a leaf, a repeat) is skipped.

        Returns:
            The blocks to free (and deregister), each childless at its turn.

        Complexity: O(len(block_ids)) plus O(log n) policy work per freed block.
        """
        freed: list[int] = []
        self._handed = []
        gone: set[int] = set()
        lost_children: dict[int, int] = {}
        is_registered, num_children = self._registry.is_registered, self._registry.num_children
        active, paused = self._active_refs, self._paused_refs
        held_back = ROOT  # an exposed parent that is the walk's next ID: kept from the policy
        for index in range(len(block_ids) - 1, -1, -1):
            block_id = block_ids[index]
            if (
                block_id in gone
                or not is_registered[block_id]
                or active[block_id]
                or paused[block_id]
                or num_children[block_id] != lost_children.get(block_id, 0)
            ):
                continue
            if block_id != held_back:
                journal.discard(block_id)
            held_back = ROOT
            gone.add(block_id)
            freed.append(block_id)
            if (parent_id := self._expose_parent(block_id, lost_children)) != ROOT:
                if index and block_ids[index - 1] == parent_id:
                    held_back = parent_id
                else:
                    journal.insert(parent_id)
        return freed

    def _expose_parent(self, block_id: int, lost_children: dict[int, int]) -> int:
        """Take ``block_id`` from its parent in the plan; the parent if left a cached leaf.

        The parent first gets what ``block_id``'s pins owe it (:meth:`_hand_down`),
        then counts one more child lost in ``lost_children``. It is exposed
        when it has lost every child and no request holds it: the caller
        then tells the policy of it, or takes it as the next victim. Shared
        by :meth:`plan` and :meth:`plan_blocks`.

        Returns:
            The exposed parent's ID, or ``ROOT`` (no parent, children left,
            or referenced).

        Complexity: O(1).
        """
        parent_id = int(self._registry.parent_of[block_id])
        if parent_id == ROOT:
            return ROOT
        if self._refs.pin_pending[block_id]:
            self._hand_down(block_id, parent_id)
        lost = lost_children[parent_id] = lost_children.get(parent_id, 0) + 1
        if lost != self._registry.num_children[parent_id] or not self.is_unreferenced(parent_id):
            return ROOT
        return parent_id

    def _hand_down(self, block_id: int, parent_id: int) -> None:
        """Give ``parent_id`` the stamp (max) and pending accesses (sum) that ``block_id``'s
        pins owe it: what full references would have written on it (engine/pins.py).
        Written now (``evicts_first`` and the journal read them); undone on failure."""
        refs = self._refs
        last, counts, stamps, pending = (
            refs.last_access,
            refs.num_accesses,
            refs.pin_stamp,
            refs.pin_pending,
        )
        self._handed.append(
            (
                parent_id,
                last.item(parent_id),
                counts.item(parent_id),
                stamps.item(parent_id),
                pending.item(parent_id),
            )
        )
        stamp, owed = stamps.item(block_id), pending.item(block_id)
        last[parent_id] = max(last.item(parent_id), stamp)
        stamps[parent_id] = max(stamps.item(parent_id), stamp)
        counts[parent_id] += owed
        pending[parent_id] += owed

    def undo_hand_downs(self) -> None:
        """Restore what the failed plan's hand-downs wrote (before the journal rolls back)."""
        refs = self._refs
        for block_id, last, count, stamp, owed in reversed(self._handed):
            refs.last_access[block_id] = last
            refs.num_accesses[block_id] = count
            refs.pin_stamp[block_id] = stamp
            refs.pin_pending[block_id] = owed
        self._handed = []

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
        for descendant in subtree[:-1]:  # its descendants' pins owe block_id, then its parent
            if self._refs.pin_pending[descendant]:
                self._hand_down(descendant, block_id)
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
        # A pinned tail's ancestors would be referenced with full references: never taken.
        pinned = self._pinned.ancestors() if self._refs.pin_bound else set()
        candidates = [
            block_id
            for block_id in np.flatnonzero(
                registry.is_registered
                & (self._active_refs == 0)
                & (self._paused_refs == 0)
                & (registry.num_children > 0)
            ).tolist()
            if block_id not in gone
            and block_id not in pinned
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
        stamps = self._last_access[deepest]
        if len(deepest) > 1 and self._refs.pin_pending.any():
            # The stamps full references would have written: with the descendants' pins.
            pin_stamp = self._refs.pin_stamp
            owed = [int(pin_stamp[self.subtree(int(b), gone)].max()) for b in deepest]
            stamps = np.maximum(stamps, np.asarray(owed, dtype=np.int64))
        return int(deepest[np.argmin(stamps)])
