"""PythonEngine: the reference implementation of the engine seam, over any policy object."""

from __future__ import annotations

import numpy as np

from prefixcache.engine.core import EngineCounters
from prefixcache.engine.defragment import relocate_blocks
from prefixcache.engine.eviction import EvictionPlanner
from prefixcache.engine.free_list import SortedFreeList, bind_page_policy
from prefixcache.engine.invariants import find_invariant_problems
from prefixcache.engine.journal import PolicyJournal
from prefixcache.engine.partitions import PartitionLedger
from prefixcache.engine.pins import PinnedChains, PythonPinSteps
from prefixcache.engine.pool import BlockPool
from prefixcache.engine.python_eviction import PythonEvictionSteps
from prefixcache.engine.python_hits import PythonHitSteps
from prefixcache.engine.python_partitions import PythonPartitionSteps
from prefixcache.engine.references import ReferenceTable, count_occurrences
from prefixcache.engine.registration import Registrar
from prefixcache.engine.registry import ROOT, HashRegistry
from prefixcache.engine.types import NO_HASH
from prefixcache.errors import BlockStateError
from prefixcache.policies import EvictionPolicy, has_hook

_EMPTY_FREED = np.empty(0, dtype=np.int32)


class PythonEngine(PythonHitSteps, PythonPinSteps, PythonEvictionSteps, PythonPartitionSteps):
    """Block state in numpy arrays and Python collaborators; drives any eviction policy.

    The readable reference of :class:`~prefixcache.engine.core.EngineCore`
    (see there for each method's contract): the native engine must behave
    exactly like it. Collaborators, each with one job: the pool (free stack),
    the :class:`ReferenceTable` (counts, access history, free-group queue),
    the :class:`PartitionLedger` (active/paused/cached counts, budgets), the
    :class:`HashRegistry` (prefix index), the :class:`EvictionPlanner` and the
    policy behind a :class:`PolicyJournal`. Every method makes its fallible
    calls (policy, then pool) first, inside one policy transaction, and
    writes its own state last; a failure aborts the transaction, so the
    engine and the policy are left exactly as they were (DESIGN.md, "The
    transaction rule").

    Args:
        total_count: blocks including the dummy.
        paused_count: budget of the paused partition.
        policy: the eviction policy object (owned by this engine).
        track_changes: record freed blocks and removed hashes for
            :meth:`take_changes` (events or routing are on).
        cache_unreferenced: the config's mode (False: ref-zero); None: the
            policy's deprecated ``retains_unreferenced``.
        free_list: ``"stack"`` (:class:`BlockPool`) or ``"lowest"``
            (:class:`SortedFreeList`, pages of ``page_size`` blocks).
    """

    name = "python"

    def __init__(
        self,
        total_count: int,
        paused_count: int,
        policy: EvictionPolicy,
        *,
        track_changes: bool = False,
        cache_unreferenced: bool | None = None,
        free_list: str = "stack",
        page_size: int = 1,
    ) -> None:
        self.policy = policy
        self._observe_hit = policy.on_hit if has_hook(policy, "on_hit") else None
        self._observe_end = policy.on_end if has_hook(policy, "on_end") else None
        if cache_unreferenced is None:
            cache_unreferenced = bool(getattr(policy, "retains_unreferenced", True))
        self.retains_unreferenced = cache_unreferenced
        self.pool: BlockPool | SortedFreeList = (
            SortedFreeList(total_count, "cpu", page_size=page_size)
            if free_list == "lowest"
            else BlockPool(total_count, "cpu")  # host only: the facade mirrors it on the device
        )
        self.num_usable = total_count - 1
        self.registry = HashRegistry(total_count)
        self.refs = ReferenceTable(total_count)
        # A page-aware policy reads each page's free and held block counts.
        bind_page_policy(policy, self.pool, self.refs.active, self.refs.paused)
        self.ledger = PartitionLedger(self.num_usable, paused_count)
        self.paused_count = paused_count
        self.active_count = self.ledger.active_count
        self.planner = EvictionPlanner(
            policy,
            self.registry,
            self.refs.active,
            self.refs.paused,
            self.refs.last_access,
            self.num_usable,
            self.leaf_args,
            self.refs,
        )
        self.pins = PinnedChains(self.registry, self.refs)
        self.registrar = Registrar(
            self.registry, self.refs, policy, self.retains_unreferenced, self._discard_leaves
        )
        self._policy_journal = PolicyJournal(policy, self._insert_leaf)
        self._track_changes = track_changes
        self._freed: list[np.ndarray] = []
        self._removed: list[int] = []
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._clock = 0
        self._num_allocated = 0
        self._num_released = 0
        self._num_queried = 0
        self._num_hits = 0
        self._num_evicted = 0
        self._num_dropped = 0

    # ------------------------------------------------------------------ counters

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_active(self) -> int:
        return self.ledger.num_active

    @property
    def num_paused(self) -> int:
        return self.ledger.num_paused

    @property
    def num_holding_paused(self) -> int:
        return self.ledger.num_holding_paused

    @property
    def num_cached(self) -> int:
        return self.ledger.num_cached

    @property
    def num_registered(self) -> int:
        return len(self.registry)

    @property
    def clock(self) -> int:
        return self._clock

    def counters(self) -> EngineCounters:
        return EngineCounters(
            num_allocated_blocks=self._num_allocated,
            num_released_references=self._num_released,
            num_queried_blocks=self._num_queried,
            num_hit_blocks=self._num_hits,
            num_evicted_blocks=self._num_evicted,
            num_dropped_blocks=self._num_dropped,
            clock=self._clock,
        )

    def advance_clock(self, ticks: int) -> int:
        self._clock += ticks
        return self._clock

    # ------------------------------------------------------------------ allocation

    def allocate(self, num_blocks: int) -> np.ndarray | None:
        shortfall = num_blocks - self.pool.num_free
        if shortfall > 0 and shortfall > self.num_evictable(shortfall):
            return None
        if shortfall > 0:
            block_ids = self._allocate_evicting(num_blocks, shortfall)
        else:
            block_ids = self.pool.acquire(num_blocks)
        self._clock += 1
        self.refs.active[block_ids.astype(np.intp)] = 1
        self.ledger.num_active += num_blocks
        self._num_allocated += num_blocks
        return block_ids

    def release(self, block_ids: np.ndarray, *, paused: bool) -> None:
        if self.refs.group_depth and not paused:
            self.refs.queue_release(block_ids, self.describe_state)
            return
        unique, counts = count_occurrences(block_ids)
        refs = self.refs.paused if paused else self.refs.active
        held = refs[unique]
        self.refs.check_can_drop(
            unique, counts, held, "paused" if paused else "active", self.describe_state
        )
        self._drop_references(unique, counts, held, paused=paused)

    def open_group(self) -> None:
        self.refs.group_depth += 1

    def close_group(self) -> None:
        self.refs.group_depth -= 1
        if self.refs.group_depth == 0:
            queued = self.refs.take_queued()
            if queued is not None:  # if this raises, the group's releases are dropped
                touched, counts = queued
                self._drop_references(touched, counts, self.refs.active[touched], paused=False)

    def _drop_references(
        self, unique: np.ndarray, counts: np.ndarray | None, held: np.ndarray, *, paused: bool
    ) -> None:
        """Commit a validated release of ``counts`` references of distinct ``unique``.

        Only blocks whose count in the released partition reaches zero can
        change state. If the pool or the policy raises, the counts are put back.
        """
        refs = self.refs.paused if paused else self.refs.active
        num_references = len(unique) if counts is None else int(counts.sum())
        remaining = held - (1 if counts is None else counts)
        emptied = unique[remaining == 0]
        refs[unique] = remaining
        if not len(emptied):
            self._num_released += num_references
            return
        other = (self.refs.active if paused else self.refs.paused)[emptied]
        still_held = np.count_nonzero(other)
        unreferenced = emptied[other == 0] if still_held else emptied
        if len(unreferenced):
            try:
                self._on_unreferenced(unreferenced)
            except BaseException:
                refs[unique] = held
                raise
        self._num_released += num_references
        if paused:  # still-active blocks do not change state; the rest were paused
            self.ledger.num_paused -= len(emptied) - still_held
            self.ledger.num_holding_paused -= len(emptied)
        else:  # blocks with paused references become paused
            self.ledger.num_active -= len(emptied)
            self.ledger.num_paused += still_held

    def _on_unreferenced(self, block_ids: np.ndarray) -> None:
        """Blocks that just lost their last reference become cached or free (all or nothing)."""
        if not len(self.registry):  # always so with prefix caching off
            self._release_to_pool(block_ids)
            return
        hashed = self.registry.is_registered[block_ids]
        num_hashed = np.count_nonzero(hashed)
        unhashed = block_ids[~hashed] if num_hashed else block_ids
        if not num_hashed:
            self._release_to_pool(unhashed)
        elif self.retains_unreferenced:
            self._cache_blocks(block_ids[hashed], unhashed)
        else:
            self._drop_blocks(block_ids[hashed], unhashed)

    def _release_to_pool(self, block_ids: np.ndarray) -> None:
        self.pool.release(block_ids)
        if self._track_changes and len(block_ids):
            self._freed.append(np.array(block_ids, dtype=np.int32))

    def _cache_blocks(self, hashed: np.ndarray, unhashed: np.ndarray) -> None:
        """Keep the unreferenced ``hashed`` blocks cached, their leaves in the policy."""
        leaves = hashed[self.registry.num_children[hashed] == 0]
        journal = self._journal()
        try:
            for block_id in leaves.tolist():
                journal.insert(block_id)
            self._release_to_pool(unhashed)
        except BaseException:
            journal.rollback()
            raise
        journal.commit()
        self.ledger.num_cached += len(hashed)

    def _drop_blocks(self, hashed: np.ndarray, unhashed: np.ndarray) -> None:
        """Ref-zero: free the unreferenced ``hashed`` blocks, each with its descendants' hashes.

        Dropping a subtree keeps the registry ancestor-closed; referenced
        descendants lose their hash and are freed when released.
        """
        gone: set[int] = set()
        dropped: list[int] = []
        for block_id in hashed.tolist():
            if block_id not in gone:
                subtree = self.planner.subtree(block_id, gone)
                gone.update(subtree)
                dropped.extend(subtree)
        freed = [block_id for block_id in dropped if self.planner.is_unreferenced(block_id)]
        self._release_to_pool(np.concatenate((unhashed, np.asarray(freed, dtype=np.int32))))
        self._record_removed(self.registry.deregister_leaves(dropped))
        self._num_dropped += len(freed)

    def _record_removed(self, hashes: list[int]) -> None:
        if self._track_changes:
            self._removed.extend(hashes)

    def leaf_args(self, block_id: int) -> tuple[int, int, int, int]:
        """What the policy is told of a leaf: hash, last access, hand-outs, depth."""
        return (
            self.registry.hash_of(block_id),
            self.refs.last_access.item(block_id),
            self.refs.num_accesses.item(block_id),
            self.registry.depth_of.item(block_id),
        )

    def _insert_leaf(self, block_id: int) -> None:
        self.policy.insert(block_id, *self.leaf_args(block_id))

    def _journal(self) -> PolicyJournal:
        """The engine's journal with a policy transaction open; end it with commit or rollback."""
        journal = self._policy_journal
        journal.begin()
        return journal

    # ------------------------------------------------------------------ prefix reuse

    def lookup(self, block_hashes: list[int]) -> np.ndarray:
        return np.array(self.registry.match(block_hashes), dtype=np.intp)

    def register(
        self, block_ids: np.ndarray, block_hashes: list[int], parent_hash: int | None
    ) -> tuple[np.ndarray, np.ndarray]:
        unreferenced = self.refs.is_unreferenced(block_ids)
        if unreferenced.any():
            block_id = int(block_ids[unreferenced][0])
            raise BlockStateError(
                f"block {block_id} ({self.describe_state(block_id)}) is not referenced; "
                "register blocks while a request holds them"
            )
        return self.registrar.register(block_ids, block_hashes, parent_hash, self._clock)

    def block_of(self, block_hash: int) -> int | None:
        return self.registry.block_of(block_hash)

    def hash_of(self, block_id: int) -> int | None:
        block_hash = self.registry.hash_of(block_id)
        return None if block_hash == NO_HASH else block_hash

    def registrations(self, block_ids: np.ndarray) -> np.ndarray:
        return self.registry.registrations(block_ids)

    def registered_chains(self) -> list[tuple[int, int | None]]:
        registry = self.registry
        pairs = sorted(registry.items(), key=lambda pair: int(registry.depth_of[pair[1]]))
        chains: list[tuple[int, int | None]] = []
        for block_hash, block_id in pairs:
            parent_id = int(registry.parent_of[block_id])
            chains.append((block_hash, None if parent_id == ROOT else registry.hash_of(parent_id)))
        return chains

    def relocate(self, sources: np.ndarray, destinations: np.ndarray, *, check_only: bool) -> None:
        relocate_blocks(self, sources, destinations, check_only=check_only)

    def free_ids(self) -> np.ndarray:
        return self.pool.free_ids()

    # ------------------------------------------------------------------ collaborators

    def take_changes(self) -> tuple[np.ndarray, list[int]]:
        freed = np.concatenate(self._freed) if self._freed else _EMPTY_FREED
        removed = self._removed
        self._freed, self._removed = [], []
        return freed, removed

    def reset(self) -> None:
        leaves = self.cached_leaves() if self.retains_unreferenced else []
        self.policy.clear()
        try:
            self.pool.reset()
        except BaseException:
            for block_id in leaves:
                self._insert_leaf(block_id)
            raise
        self.registry.clear()
        self.refs.clear()
        self.ledger.clear()
        self._freed, self._removed = [], []
        self._reset_counters()

    def cached_leaves(self) -> list[int]:
        """Every cached leaf (what the policy tracks). Complexity: O(total_count)."""
        usable = slice(0, self.num_usable)
        leaves: list[int] = np.flatnonzero(
            self.registry.is_registered[usable]
            & (self.refs.active[usable] == 0)
            & (self.refs.paused[usable] == 0)
            & (self.registry.num_children[usable] == 0)
        ).tolist()
        return leaves

    def find_problems(self) -> list[str]:
        return find_invariant_problems(self)
