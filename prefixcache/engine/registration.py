"""Planning a registration: who holds each hash once a chain is registered, before any change.

A registration call names blocks and their chained hashes. Most calls are a
matched prefix registered again (blocks already carrying their hashes)
followed by fresh blocks with hashes nobody holds; that case has a fast
path. Anything else (a hash held by another block, a block listed twice) goes
through :func:`plan_registration`. Everything here reads the registry and
changes nothing, so the engine can make its fallible policy calls afterwards
and write its own state last.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from prefixcache.engine.references import ReferenceTable
from prefixcache.engine.registry import ROOT, HashRegistry
from prefixcache.engine.types import NO_HASH
from prefixcache.errors import HashConflictError
from prefixcache.policies import EvictionPolicy, has_hook


def num_holding_own_hash(registry: HashRegistry, id_list: list[int], hashes: list[int]) -> int:
    """How many leading blocks already carry their hash (a matched prefix, registered again)."""
    hash_of = registry.hash_of
    held = 0
    for block_id, block_hash in zip(id_list, hashes, strict=True):
        if hash_of(block_id) != block_hash:
            break
        held += 1
    return held


def is_fresh_chain(
    registry: HashRegistry, ids: np.ndarray, id_list: list[int], hashes: list[int]
) -> bool:
    """Distinct unregistered blocks, distinct hashes nobody holds: the common registration."""
    return (
        not np.count_nonzero(registry.is_registered[ids])
        and len(set(id_list)) == len(id_list)
        and len(set(hashes)) == len(hashes)
        and registry.holds_none(hashes)
    )


def check_hash_assignment(registry: HashRegistry, id_list: list[int], hashes: list[int]) -> None:
    """Refuse a block that carries another hash or is listed twice with different hashes.

    Raises:
        HashConflictError: naming the block and both hashes.
    """
    assigned: dict[int, int] = {}
    for block_id, block_hash in zip(id_list, hashes, strict=True):
        current = registry.hash_of(block_id)
        if current != NO_HASH and current != block_hash:
            raise HashConflictError(
                f"block {block_id} already carries hash {current}; cannot register {block_hash}"
            )
        if assigned.setdefault(block_id, block_hash) != block_hash:
            raise HashConflictError(
                f"block {block_id} appears twice with different hashes "
                f"({assigned[block_id]} and {block_hash})"
            )


def plan_registration(
    registry: HashRegistry, id_list: list[int], hashes: list[int]
) -> tuple[list[int], list[bool]]:
    """Who holds each hash once the chain is registered, and which blocks newly take theirs.

    A hash already held (by another block, or by this block itself) keeps its
    holder, and the chain continues under it.
    """
    holder_in_call: dict[int, int] = {}
    holders: list[int] = []
    new: list[bool] = []
    for block_id, block_hash in zip(id_list, hashes, strict=True):
        holder = holder_in_call.get(block_hash)
        if holder is None:
            holder = registry.block_of(block_hash)
        new.append(holder is None)
        if holder is None:
            holder = holder_in_call[block_hash] = block_id
        holders.append(holder)
    return holders, new


def planned_depths(
    registry: HashRegistry, id_list: list[int], parents: list[int], new: list[bool]
) -> dict[int, int]:
    """Chain depth of each block a registration plan newly registers, before it commits."""
    depths: dict[int, int] = {}
    for block_id, parent_id, is_new in zip(id_list, parents, new, strict=True):
        if is_new:
            if parent_id == ROOT:
                depths[block_id] = 0
            elif parent_id in depths:
                depths[block_id] = depths[parent_id] + 1
            else:
                depths[block_id] = int(registry.depth_of[parent_id]) + 1
    return depths


def new_runs(new: list[bool], hashes: list[int]) -> list[tuple[int, list[int]]]:
    """``(first index, hashes)`` of each run of consecutive newly registered positions."""
    runs: list[tuple[int, list[int]]] = []
    for index, block_hash in enumerate(hashes):
        if new[index]:
            if runs and runs[-1][0] + len(runs[-1][1]) == index:
                runs[-1][1].append(block_hash)
            else:
                runs.append((index, [block_hash]))
    return runs


class Registrar:
    """Commits registrations into the registry, telling the policy what changes.

    Validation of references is the engine's; this plans (with the functions
    above), makes the fallible policy calls (the optional ``on_register`` hook,
    then a parent that gains a child stops being a cached leaf) in one policy
    transaction, as the native engine does, so a raising hook leaves the policy
    as it was; then writes the registry and the blocks' access history.

    Args:
        registry: the engine's hash registry.
        refs: the engine's reference table (access history is written here).
        policy: the eviction policy.
        retains_unreferenced: False in ref-zero mode (no leaf is tracked).
        discard_leaves: ``(leaves, before=hook)``: calls ``hook``, then takes the cached
            leaves out of the policy, in one policy transaction (all or none).
    """

    def __init__(
        self,
        registry: HashRegistry,
        refs: ReferenceTable,
        policy: EvictionPolicy,
        retains_unreferenced: bool,
        discard_leaves: Callable[..., None],
    ) -> None:
        self._registry = registry
        self._refs = refs
        self._policy = policy
        self._retains_unreferenced = retains_unreferenced
        self._discard_leaves = discard_leaves
        self._observe_registration = policy.on_register if has_hook(policy, "on_register") else None

    def register(
        self, block_ids: np.ndarray, block_hashes: list[int], parent_hash: int | None, clock: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Register a chain of referenced blocks at clock ``clock``; see ``EngineCore.register``.

        Returns:
            ``(holds, new)`` per position.

        Raises:
            HashConflictError: see ``EngineCore.register``.
        """
        ids, hashes, registry = block_ids, block_hashes, self._registry
        id_list = ids.tolist()
        parent_id = ROOT
        if parent_hash is not None:
            holder = registry.block_of(parent_hash)
            if holder is None:
                raise HashConflictError(f"parent hash {parent_hash} is not registered")
            parent_id = holder
        # The common call: a matched prefix that holds its hashes, then fresh blocks.
        held = num_holding_own_hash(registry, id_list, hashes)
        if held:
            parent_id = id_list[held - 1]
        if held == len(id_list) or is_fresh_chain(
            registry, ids[held:], id_list[held:], hashes[held:]
        ):
            new = np.zeros(len(id_list), dtype=bool)
            if held < len(id_list):
                self._register_fresh_chain(
                    ids[held:], id_list[held:], hashes[held:], parent_id, clock
                )
                new[held:] = True
            return np.ones(len(id_list), dtype=bool), new
        check_hash_assignment(registry, id_list, hashes)
        holders, new_list = plan_registration(registry, id_list, hashes)
        parents = [parent_id, *holders[:-1]]
        observe = None
        if self._observe_registration is not None:
            depths = planned_depths(registry, id_list, parents, new_list)
            told = [(run, depths[id_list[first]]) for first, run in new_runs(new_list, hashes)]
            observe = partial(self._tell, told)
        gaining_child = dict.fromkeys(parents[i] for i in range(len(new_list)) if new_list[i])
        leaves = [p for p in gaining_child if self._is_tracked_leaf(p)]
        self._discard_leaves(leaves, before=observe)
        for index, (block_id, block_hash) in enumerate(zip(id_list, hashes, strict=True)):
            if new_list[index]:
                registry.register(block_id, block_hash, parents[index])
                # A block's cache life starts here: allocation leaves these untouched.
                self._refs.last_access[block_id] = clock
                self._refs.num_accesses[block_id] = 1
                self._refs.pin_stamp[block_id] = self._refs.pin_pending[block_id] = 0
        return np.asarray(holders) == ids, np.array(new_list, dtype=bool)

    def _register_fresh_chain(
        self, ids: np.ndarray, id_list: list[int], hashes: list[int], parent_id: int, clock: int
    ) -> None:
        leaves = [parent_id] if self._is_tracked_leaf(parent_id) else []
        if self._observe_registration is not None:
            first_depth = 0 if parent_id == ROOT else self._registry.depth_of[parent_id] + 1
            told = [(hashes, int(first_depth))]
            self._discard_leaves(leaves, before=partial(self._tell, told))
        elif leaves:
            self._policy.discard(parent_id)  # the only fallible call: before any change
        self._registry.register_chain(ids, id_list, hashes, parent_id)
        self._refs.last_access[ids] = clock
        self._refs.num_accesses[ids] = 1
        self._refs.pin_stamp[ids] = self._refs.pin_pending[ids] = 0

    def _tell(self, told: list[tuple[list[int], int]]) -> None:
        """``on_register`` for each run of new hashes, inside the discards' transaction."""
        assert self._observe_registration is not None
        for run, depth in told:
            self._observe_registration(run, depth)

    def _is_tracked_leaf(self, block_id: int) -> bool:
        """Whether ``block_id`` is a cached leaf, i.e. tracked by the policy."""
        return (
            block_id != ROOT
            and self._retains_unreferenced
            and self._registry.num_children[block_id] == 0
            and self._refs.active[block_id] == 0
            and self._refs.paused[block_id] == 0
        )
