"""Defragmentation: plan the moves that pack the live blocks low, and the Python engine's move.

A long-running pool scatters its live blocks (referenced or cached) over the
whole ID range. :func:`plan_compaction` says which blocks to move where so
that they occupy the lowest IDs; the allocator applies the plan
(:meth:`KVBlockAllocator.apply_defragment`: the KV storage's copy callback,
then the engine's ``relocate``, then routing and fingerprints), and block
tables follow with :meth:`BlockTable.apply_moves`. DESIGN.md,
"Defragmentation".

:func:`relocate_blocks` is the Python engine's ``relocate`` (the native twin
is ``engine_layout.cpp``): it moves every piece of a block's state at once,
reference counts, access history, hash and links, the policy's entry, and
rebuilds the free list so the lowest free ID goes out first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from prefixcache.engine.engine_parts import EngineParts
from prefixcache.errors import BlockStateError, ConfigError, InvalidArgumentError
from prefixcache.policies import is_transactional


@dataclass(frozen=True)
class DefragmentPlan:
    """Moves ``sources[i] -> destinations[i]``: live blocks to free ones (int32 arrays).

    Every source is live (active, paused or cached) and every destination
    free when the plan is made; applying it after any other call may be
    refused (the allocator checks the states again).
    """

    sources: np.ndarray
    destinations: np.ndarray

    def __len__(self) -> int:
        return len(self.sources)

    @property
    def moves(self) -> list[tuple[int, int]]:
        """The moves as ``(source, destination)`` pairs. Complexity: O(k)."""
        return list(zip(self.sources.tolist(), self.destinations.tolist(), strict=True))


def plan_compaction(free_ids: np.ndarray, num_usable: int) -> DefragmentPlan:
    """The fewest moves that put every live block below ``num_usable - len(free_ids)``.

    With ``L`` live blocks, each live block at an ID ``>= L`` moves to a
    free ID ``< L``, both taken in ascending order; there are exactly as many
    of each. Blocks already below ``L`` stay, so the plan moves no block
    twice and no block onto another live one.

    Complexity: O(num_usable), vectorised.
    """
    free = np.zeros(num_usable, dtype=bool)
    free[np.asarray(free_ids, dtype=np.intp)] = True
    num_live = num_usable - int(np.count_nonzero(free))
    destinations = np.flatnonzero(free[:num_live]).astype(np.int32)
    sources = (np.flatnonzero(~free[num_live:]) + num_live).astype(np.int32)
    return DefragmentPlan(sources, destinations)


def largest_free_run(free_ids: np.ndarray, num_usable: int) -> int:
    """Length of the longest run of consecutive free IDs. Complexity: O(num_usable)."""
    if not len(free_ids):
        return 0
    free = np.zeros(num_usable + 2, dtype=np.int8)
    free[np.asarray(free_ids, dtype=np.intp) + 1] = 1
    edges = np.diff(free)
    starts, stops = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return int((stops - starts).max())


def check_moves(
    sources: np.ndarray,
    destinations: np.ndarray,
    is_free: np.ndarray,
    describe_state: Callable[[int], str],
) -> None:
    """Refuse a move list before anything changes, in the order both engines check.

    Args:
        sources, destinations: the moves, IDs already range-checked.
        is_free: mask over ``sources`` then ``destinations`` (concatenated).
        describe_state: ``block_id -> state name``, for the messages.

    Raises:
        InvalidArgumentError: an ID appears twice among sources and destinations.
        BlockStateError: a free source, or a destination that is not free.
    """
    both = np.concatenate((sources, destinations))
    if len(np.unique(both)) != len(both):
        values, counts = np.unique(both, return_counts=True)
        raise InvalidArgumentError(
            f"block {int(values[counts > 1][0])} appears twice among the moves"
        )
    count = len(sources)
    free_sources = np.flatnonzero(is_free[:count])
    if len(free_sources):
        raise BlockStateError(
            f"source block {int(sources[free_sources[0]])} is free; nothing to move"
        )
    busy = np.flatnonzero(~is_free[count:])
    if len(busy):
        block_id = int(destinations[busy[0]])
        raise BlockStateError(
            f"destination block {block_id} is {describe_state(block_id)}; moves go to free blocks"
        )


def relocate_blocks(
    engine: EngineParts, sources: np.ndarray, destinations: np.ndarray, *, check_only: bool
) -> None:
    """The Python engine's ``relocate``: move each source's whole state to its destination.

    With ``check_only``, only refuse what the move would refuse (for the
    facade, which runs the KV copy between the check and the move).

    Order of the transaction rule: every check, then the policy's calls
    (one ``relocate`` per cached leaf, in move order) inside one transaction,
    then the free list (which may raise on a device mirror), then the
    engine's own arrays and registry, which cannot fail.

    Raises:
        BlockStateError: a free group is open, a source is free or a
            destination is not.
        InvalidArgumentError: an ID appears twice.
        ConfigError: the policy follows the deprecated protocol (no transactions).
    """
    if engine.refs.group_depth:
        raise BlockStateError("blocks cannot be relocated while a free group is open")
    src = np.asarray(sources, dtype=np.intp)
    dst = np.asarray(destinations, dtype=np.intp)
    both = np.concatenate((src, dst))
    is_free = engine.refs.is_unreferenced(both) & ~engine.registry.is_registered[both]
    check_moves(src, dst, is_free, engine.describe_state)
    policy = engine.policy
    if len(src) and engine.retains_unreferenced and not is_transactional(policy):
        raise ConfigError(
            f"defragmentation needs a policy that subclasses EvictionPolicy; "
            f"{type(policy).__name__} has no transactions"
        )
    if check_only or not len(src):
        return
    registry = engine.registry
    leaf_pairs: list[tuple[int, int]] = []
    if engine.retains_unreferenced:
        leaf = (
            registry.is_registered[src]
            & engine.refs.is_unreferenced(src)
            & (registry.num_children[src] == 0)
        )
        leaf_pairs = list(zip(src[leaf].tolist(), dst[leaf].tolist(), strict=True))
    free_after = _free_after(engine, src, dst)
    policy.begin()
    try:
        for old_id, new_id in leaf_pairs:
            policy.relocate(old_id, new_id, *engine.leaf_args(old_id))
        engine.pool.rebuild(free_after)
    except BaseException:
        policy.abort()
        raise
    policy.commit()
    refs = engine.refs
    swapped = np.concatenate((dst, src))
    for array in (
        refs.active,
        refs.paused,
        refs.last_access,
        refs.num_accesses,
        refs.pins,
        refs.pin_stamp,
        refs.pin_pending,
    ):
        array[both] = array[swapped]
    registry.relocate(src, dst)


def _free_after(engine: EngineParts, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """The free IDs once the moves apply: the old ones without ``dst``, with ``src``."""
    free = np.zeros(engine.num_usable, dtype=bool)
    free[engine.pool.free_ids().astype(np.intp)] = True
    free[dst] = False
    free[src] = True
    return np.flatnonzero(free).astype(np.int32)
