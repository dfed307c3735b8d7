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

import numpy as np

from prefixcache.engine.registry import ROOT, HashRegistry
from prefixcache.engine.types import NO_HASH
from prefixcache.errors import HashConflictError


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
