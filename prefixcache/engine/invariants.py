"""The invariants of DESIGN.md, checked against an allocator's whole state."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from prefixcache.engine.allocator import KVBlockAllocator


def find_invariant_problems(allocator: KVBlockAllocator) -> list[str]:
    """Every broken invariant of ``allocator``, described; empty when all hold.

    Reads the allocator's private per-block arrays on purpose: the point is
    to cross-check its counters and the policy against the state itself.
    Backs :meth:`KVBlockAllocator.check_invariants`.

    Complexity: O(total_count).
    """
    problems: list[str] = []
    usable = slice(0, allocator.num_usable)
    active_refs, paused_refs = allocator._active_refs[usable], allocator._paused_refs[usable]
    registered = allocator.registry.is_registered[usable]
    if (active_refs < 0).any() or (paused_refs < 0).any():
        problems.append("a reference count is negative")
    dummy = allocator.dummy_block_id
    if (
        allocator._active_refs[dummy]
        or allocator._paused_refs[dummy]
        or allocator.registry.is_registered[dummy]
    ):
        problems.append(f"dummy block {dummy} is referenced or registered")
    free_ids = allocator.pool.free_ids()
    on_stack = np.zeros(allocator.num_usable, dtype=bool)
    on_stack[free_ids] = True
    if len(np.unique(free_ids)) != len(free_ids):
        problems.append("a block is on the free stack twice")
    is_active = active_refs > 0
    is_paused = ~is_active & (paused_refs > 0)
    unreferenced = ~is_active & ~is_paused
    is_cached = unreferenced & registered
    is_free = unreferenced & ~registered
    if not np.array_equal(on_stack, is_free):
        bad = int(np.flatnonzero(on_stack != is_free)[0])
        problems.append(f"block {bad}: on free stack={on_stack[bad]} but free={is_free[bad]}")
    for name, mask, counter in (
        ("active", is_active, allocator._num_active),
        ("paused", is_paused, allocator._num_paused),
        ("cached", is_cached, allocator._num_cached),
    ):
        if int(mask.sum()) != counter:
            problems.append(f"{name} counter {counter} but {int(mask.sum())} {name} blocks")
    total = len(free_ids) + allocator._num_active + allocator._num_paused + allocator._num_cached
    if total != allocator.num_usable:
        problems.append(f"free+active+paused+cached = {total}, usable = {allocator.num_usable}")
    problems.extend(allocator.registry.check())
    leaves = np.flatnonzero(is_cached & (allocator.registry.num_children[usable] == 0))
    if not allocator.policy.retains_unreferenced:
        if allocator._num_cached:
            problems.append(f"policy keeps nothing but {allocator._num_cached} blocks are cached")
    else:
        if len(allocator.policy) != len(leaves):
            problems.append(
                f"policy tracks {len(allocator.policy)} blocks, {len(leaves)} cached leaves"
            )
        untracked = [int(b) for b in leaves if int(b) not in allocator.policy]
        if untracked:
            problems.append(f"cached leaf {untracked[0]} is not tracked by the policy")
    if allocator._pending_releases.any() and not allocator._group_depth:
        problems.append("releases are queued outside a free group")
    return problems
