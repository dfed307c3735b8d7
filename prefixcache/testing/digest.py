"""One description of an allocator's whole state, on either engine.

:func:`state_digest` is what "a call that raises changes nothing" (DESIGN.md
invariant 6) is checked against, and what compares two allocators;
:func:`changed_fields` names what differs; :func:`pool_digest` describes a
Python-engine pool; :func:`deep_state` does for any object (a tier, a request
cache) what :func:`state_digest` does for an allocator.
"""

from __future__ import annotations

import inspect
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.policies import is_transactional
from prefixcache.testing.policy_driver import eviction_order

if TYPE_CHECKING:
    from prefixcache.engine.pool import BlockPool

__all__ = ["changed_fields", "deep_state", "pool_digest", "state_digest"]


def _free_ids(engine: Any) -> list[int]:
    """The engine's free stack in order (native: the engine's; Python: its pool's)."""
    free_ids = getattr(engine, "free_ids", None)
    ids = free_ids() if free_ids is not None else engine.pool.free_ids()
    return [int(block_id) for block_id in ids]


def _python_engine_internals(allocator: KVBlockAllocator, policy: Any) -> dict[str, Any]:
    """What only the Python engine can show: access clocks, queued releases, tree shape, order.

    The seam does not expose these (the native engine keeps them in C++, where
    the differential test of ``tests/native/`` compares them); a digest that
    saw only the seam could miss a half-applied call on the reference engine.
    """
    engine = allocator._engine
    refs = engine.refs  # type: ignore[attr-defined]
    registry = allocator.registry
    # What full references would have written: with what chain pins owe (engine/pins.py).
    last_access, num_accesses = engine.pins.effective_access()  # type: ignore[attr-defined]
    return {
        "last_access": last_access.tolist(),
        "num_accesses": num_accesses.tolist(),
        "pending_releases": refs.pending.tolist(),
        "pending_chunks": [chunk.tolist() for chunk in refs._pending_chunks],
        "group_depth": refs.group_depth,
        "hash_map": sorted(registry.items()),
        "parent_of": registry.parent_of.tolist(),
        "num_children": registry.num_children.tolist(),
        "depth_of": registry.depth_of.tolist(),
        "policy_size": len(policy),
        "policy_tracked": [b for b in range(allocator.total_count) if b in policy],
        "policy_order": _policy_order(policy),
    }


def _policy_order(policy: Any) -> list[int] | None:
    """The policy's own ``eviction_order()``, else a transactional copy's ``evict`` order.

    The policy's own reading comes first: a test policy whose ``evict`` follows a
    script (consumed by a refused call) keeps its true order there. A policy of
    the old protocol without ``eviction_order()`` shows none (its ``evict`` may
    be a script); its tracked set is still compared.
    """
    own = getattr(policy, "eviction_order", None)
    if callable(own):
        return list(own())
    return eviction_order(policy) if is_transactional(policy) else None


def state_digest(allocator: KVBlockAllocator, *, policy: Any = None) -> dict[str, Any]:
    """Everything observable of ``allocator``, by name, for "nothing changed" checks.

    Engine-agnostic part (through the public API and the :class:`EngineCore`
    seam, so it works for ``engine="python"`` and ``engine="native"`` alike):
    ``stats()``, ``str()``, the clock, the engine's counters, the free stack in
    order, every usable block's reference counts and state, the registered
    chains (hash, block, parent hash), the verify-mode fingerprints, the
    routing store's written flags and values, the queued KV events and the
    scheduler hints (:meth:`~prefixcache.KVBlockAllocator.hint_upcoming`).
    On the Python engine it adds the internals the seam does not expose (see
    :func:`_python_engine_internals`): per-block access clocks and queued
    releases, the registry's tree, and the policy's tracked set and eviction
    order (its ``eviction_order()``, or read from a copy: the policy is unchanged).

    Args:
        allocator: the allocator to describe.
        policy: the policy whose order to read, when the allocator's own is a
            wrapper that must not be driven (a fault-injecting one); default
            ``allocator.policy``.

    Returns:
        A dict of plain values; equal dicts mean indistinguishable allocators
        (:func:`changed_fields` names the fields that differ).

    Complexity:
        O(total_count + registered + events), plus a copy of the policy on the
        Python engine.
    """
    engine = allocator._engine
    usable = np.arange(allocator.num_usable, dtype=np.int32)
    active, paused = engine.reference_counts(usable)
    routing = allocator.routing
    events = allocator.events
    digest: dict[str, Any] = {
        "engine": allocator.engine,
        "stats": allocator.stats(),
        "str": str(allocator),
        "clock": allocator.clock,
        "counters": engine.counters(),
        "free_stack": _free_ids(engine),
        "active_refs": [int(count) for count in active],
        "paused_refs": [int(count) for count in paused],
        "block_states": [engine.describe_state(b) for b in range(allocator.num_usable)],
        "chains": sorted(
            (block_hash, engine.block_of(block_hash), parent)
            for block_hash, parent in engine.registered_chains()
        ),
        "block_hashes": [engine.hash_of(b) for b in range(allocator.num_usable)],
        "fingerprints": list(allocator._fingerprint_of_block),
        "routing_written": None if routing is None else routing._written.tolist(),
        "routing_data": None if routing is None else routing._data.tobytes(),
        "events": None if events is None else list(events._queue),
        "hints": [(key, held.tolist()) for key, held in allocator._hints.items()],
        "hint_limit": allocator.hint_limit,
    }
    if allocator.engine == "python":
        chosen = allocator.policy if policy is None else policy
        digest.update(_python_engine_internals(allocator, chosen))
    return digest


def changed_fields(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Names of the digest fields that differ, each with a short ``before -> after``."""
    return [
        f"{name}: {_short(value)} -> {_short(after.get(name))}"
        for name, value in before.items()
        if after.get(name) != value
    ]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 160 else text[:157] + "..."


def pool_digest(pool: BlockPool) -> tuple[int, list[int]]:
    """A :class:`~prefixcache.engine.pool.BlockPool`'s state: free count and free stack."""
    return pool.num_free, pool.free_ids().tolist()


def deep_state(obj: Any, seen: set[int] | None = None) -> Any:
    """Everything reachable from ``obj`` as nested tuples that compare by value.

    Allocators by :func:`state_digest`; arrays and tensors by dtype, shape and
    bytes; dicts in their order (an insertion order is state); objects by their
    attributes. Callables, locks and threads are left out (behaviour, not state).
    """
    seen = set() if seen is None else seen
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if isinstance(obj, KVBlockAllocator):
        return ("allocator", state_digest(obj))
    if isinstance(obj, np.ndarray):
        return ("array", str(obj.dtype), obj.shape, obj.tobytes())
    if isinstance(obj, torch.Tensor):
        return deep_state(obj.detach().cpu().numpy(), seen)
    if (callable(obj) and not hasattr(obj, "__dict__")) or inspect.isroutine(obj):
        return "<callable>"
    if isinstance(obj, (threading.Thread, type(threading.Lock()), type(threading.RLock()))):
        return "<thread or lock>"
    if id(obj) in seen:
        return ("<seen>", type(obj).__name__)
    seen.add(id(obj))
    if isinstance(obj, dict):
        return ("dict", tuple((deep_state(k, seen), deep_state(v, seen)) for k, v in obj.items()))
    if isinstance(obj, (set, frozenset)):
        return ("set", tuple(sorted(repr(deep_state(item, seen)) for item in obj)))
    if isinstance(obj, (list, tuple)) or type(obj).__name__ in {"deque", "SortedList"}:
        return (type(obj).__name__, tuple(deep_state(item, seen) for item in obj))
    fields: dict[str, Any] = {}
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if hasattr(obj, slot):
                fields[slot] = getattr(obj, slot)
    fields.update(getattr(obj, "__dict__", {}))
    return (type(obj).__name__, tuple((k, deep_state(v, seen)) for k, v in sorted(fields.items())))
