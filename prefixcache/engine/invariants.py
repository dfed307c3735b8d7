"""The invariants of DESIGN.md, checked against an engine's whole state."""

from __future__ import annotations

import numpy as np

from prefixcache.engine.engine_parts import EngineParts


def find_invariant_problems(engine: EngineParts) -> list[str]:
    """Every broken invariant of ``engine``, described; empty when all hold.

    Reads the engine's private per-block arrays on purpose: the point is
    to cross-check its counters and the policy against the state itself.
    Backs :meth:`KVBlockAllocator.check_invariants`.

    Complexity: O(total_count).
    """
    problems: list[str] = []
    usable = slice(0, engine.num_usable)
    active_refs, paused_refs = engine.refs.active[usable], engine.refs.paused[usable]
    registered = engine.registry.is_registered[usable]
    if (active_refs < 0).any() or (paused_refs < 0).any():
        problems.append("a reference count is negative")
    dummy = engine.num_usable
    if (
        engine.refs.active[dummy]
        or engine.refs.paused[dummy]
        or engine.registry.is_registered[dummy]
    ):
        problems.append(f"dummy block {dummy} is referenced or registered")
    free_ids = engine.pool.free_ids()
    on_stack = np.zeros(engine.num_usable, dtype=bool)
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
        ("active", is_active, engine.ledger.num_active),
        ("paused", is_paused, engine.ledger.num_paused),
        ("cached", is_cached, engine.ledger.num_cached),
    ):
        if int(mask.sum()) != counter:
            problems.append(f"{name} counter {counter} but {int(mask.sum())} {name} blocks")
    total = (
        len(free_ids)
        + engine.ledger.num_active
        + engine.ledger.num_paused
        + engine.ledger.num_cached
    )
    if total != engine.num_usable:
        problems.append(f"free+active+paused+cached = {total}, usable = {engine.num_usable}")
    num_holding_paused = int(np.count_nonzero(paused_refs > 0))
    if num_holding_paused != engine.ledger.num_holding_paused:
        problems.append(
            f"paused-holding counter {engine.ledger.num_holding_paused} but "
            f"{num_holding_paused} blocks hold paused references"
        )
    problems.extend(engine.ledger.check())
    problems.extend(engine.registry.check())
    leaves = np.flatnonzero(is_cached & (engine.registry.num_children[usable] == 0))
    if not engine.retains_unreferenced:
        if engine.ledger.num_cached:
            problems.append(
                f"policy keeps nothing but {engine.ledger.num_cached} blocks are cached"
            )
    else:
        if len(engine.policy) != len(leaves):
            problems.append(
                f"policy tracks {len(engine.policy)} blocks, {len(leaves)} cached leaves"
            )
        untracked = [int(b) for b in leaves if int(b) not in engine.policy]
        if untracked:
            problems.append(f"cached leaf {untracked[0]} is not tracked by the policy")
    if engine.refs.pending.any() and not engine.refs.group_depth:
        problems.append("releases are queued outside a free group")
    return problems
