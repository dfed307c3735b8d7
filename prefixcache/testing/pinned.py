"""A digest of an allocator whose sessions pin chains, as full references would show it.

A pinned session turn (``engine/pins.py``) references its chain's tail; the
tail's ancestors stay cached where a turn taking full references leaves them
active. Everything else (the registry, the policy's leaves and order, the
counters, the effective access stamps) is the same, and
:func:`as_full_references` rewrites only the differing fields: each ancestor's
active count gains the pins below it, and a cached one is reported active, in
the per-block states, ``stats()`` and ``str()``. Tests compare this against a
twin running full references, so the one stated difference (DESIGN.md,
"Sessions": pinned ancestors are cached, not active) is the only one allowed.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from prefixcache.engine.allocator import KVBlockAllocator

__all__ = ["as_full_references", "pins_through"]


def pins_through(allocator: KVBlockAllocator) -> dict[int, int]:
    """Per block, the pins on tails below it (its strict descendants). O(registered)."""
    engine: Any = allocator._engine
    parent_hash_of = dict(engine.registered_chains())
    through: dict[int, int] = {}
    for tail, count in engine.pinned_tails():
        parent_hash = parent_hash_of.get(engine.hash_of(tail))
        while parent_hash is not None:
            parent = engine.block_of(parent_hash)
            through[parent] = through.get(parent, 0) + count
            parent_hash = parent_hash_of.get(parent_hash)
    return through


def as_full_references(digest: dict[str, Any], allocator: KVBlockAllocator) -> dict[str, Any]:
    """``digest`` (``state_digest(allocator)``) with pinned ancestors reported as referenced."""
    through = pins_through(allocator)
    if not through:
        return digest
    adjusted = dict(digest)
    active = list(digest["active_refs"])
    states = list(digest["block_states"])
    num_moved = 0
    for block_id, count in through.items():
        if states[block_id] == "cached":
            states[block_id] = "active"
            num_moved += 1
        active[block_id] += count
    adjusted["active_refs"], adjusted["block_states"] = active, states
    stats = digest["stats"]
    adjusted["stats"] = dataclasses.replace(
        stats, num_active=stats.num_active + num_moved, num_cached=stats.num_cached - num_moved
    )
    adjusted["str"] = re.sub(
        r"cached (\d+)$",
        lambda match: f"cached {int(match.group(1)) - num_moved}",
        re.sub(
            r"active (\d+)/",
            lambda match: f"active {int(match.group(1)) + num_moved}/",
            digest["str"],
        ),
    )
    return adjusted
