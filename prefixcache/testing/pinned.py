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

import numpy as np

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.errors import BlockStateError, CapacityError

__all__ = ["Twin", "as_full_references", "pins_through"]


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


class Twin:
    """A session's turns as new requests over the whole conversation (what it must equal)."""

    def __init__(self, allocator: KVBlockAllocator) -> None:
        self.allocator = allocator
        self.block_size = allocator.block_size_tokens
        self.tokens: list[int] = []
        self.held: list[int] = []
        self.shared = 0  # the first turn's hits, which end() keeps

    @property
    def running(self) -> bool:
        return bool(self.held)

    @property
    def row(self) -> list[int]:
        return self.held

    def admit(self, tokens: list[int]) -> int:
        prompt = self.tokens + tokens
        row = np.zeros(-(-len(prompt) // self.block_size), dtype=np.int32)
        num_hit = self.allocator.admit_request(prompt, row)
        if not self.tokens:
            self.shared = num_hit
        self.tokens, self.held = prompt, row.tolist()
        return num_hit

    def append(self, tokens: list[int]) -> None:
        grown = self.tokens + tokens
        needed = -(-len(grown) // self.block_size) - len(self.held)
        new: list[int] = []
        if needed:
            ids = self.allocator.allocate_block_ids(needed)
            if ids is None:
                raise CapacityError("short")
            new = list(ids)
        held = self.held + new
        before, after = len(self.tokens) // self.block_size, len(grown) // self.block_size
        hashes = self.allocator.hash_tokens(grown)
        # A parent hash gone (its registration refused, its holder evicted): none registered.
        engine = self.allocator._engine
        if after > before and (not before or engine.block_of(hashes[before - 1]) is not None):
            self.allocator.register_kv_block_hashes(
                held[before:after],
                hashes[before:after],
                parent_hash=hashes[before - 1] if before else None,
            )
        self.tokens, self.held = grown, held

    def release(self) -> None:
        self.allocator.release_request(self.held)
        self.held = []

    def end(self) -> int:
        """The conversation ended: what ``Session.end`` must equal (its blocks after the
        first turn's hits, looked up, freed where cached leaves); then start over."""
        if self.held:
            raise BlockStateError("a turn of this session is running; release() it first")
        found = self.allocator._engine.lookup(self.allocator.hash_tokens(self.tokens))
        freed = self.allocator.evict_blocks(found[self.shared :]) if len(found) > self.shared else 0
        self.tokens, self.shared = [], 0
        return freed
