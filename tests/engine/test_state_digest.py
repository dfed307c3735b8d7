"""The test kit's state digest: one description of an allocator, on either engine.

:func:`prefixcache.testing.state_digest` is what every "a refused call changes
nothing" check compares. These tests keep it honest: equal on twins built the
same way, on the Python and the native engine alike (the seam part is the
same on both), different after each kind of change, and never driving the
policy it reads.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from prefixcache.policies import LRUPolicy

from prefixcache import KVBlockAllocator
from prefixcache.engine.native_engine import native_available
from prefixcache.engine.pool import BlockPool
from prefixcache.testing import changed_fields, pool_digest, state_digest

NATIVE_MISSING = "the native engine (prefixcache.engine._native) is not built"

ENGINES = [
    "python",
    pytest.param(
        "native",
        marks=pytest.mark.skipif(
            not native_available(),
            reason="the native engine (prefixcache.engine._native) is not built",
        ),
    ),
]

SEAM_FIELDS = (
    "stats",
    "str",
    "clock",
    "counters",
    "free_stack",
    "active_refs",
    "paused_refs",
    "block_states",
    "chains",
    "block_hashes",
    "fingerprints",
    "routing_written",
    "routing_data",
    "events",
)
"""The engine-agnostic fields: through the public API and the EngineCore seam."""


def _build(engine: str, **kwargs: Any) -> KVBlockAllocator:
    """An allocator with a held chain, a cached chain, routing and events."""
    allocator = KVBlockAllocator(
        total_count=12,
        block_size_tokens=2,
        paused_count=2,
        device="cpu",
        engine=engine,
        routing_num_layers=1,
        routing_top_k=1,
        routing_num_experts=4,
        kv_events_capacity=100,
        **kwargs,
    )
    held = allocator.allocate_memory_blocks(3)
    allocator.register_kv_block_hashes(held, [11, 12, 13])
    allocator.store_block_routing(int(held[0]), torch.ones(2, 1, 1, dtype=torch.int64))
    cached = allocator.allocate_memory_blocks(2)
    allocator.register_kv_block_hashes(cached, [21, 22])
    allocator.release_memory_blocks(cached)
    allocator.pause(allocator.allocate_memory_blocks(1))
    return allocator


@pytest.mark.parametrize("engine", ENGINES)
def test_twins_have_equal_digests_and_the_digest_changes_nothing(engine: str) -> None:
    allocator, twin = _build(engine), _build(engine)
    first = state_digest(allocator)
    assert first == state_digest(twin)
    assert state_digest(allocator) == first  # reading it twice changes nothing
    assert first["engine"] == engine
    assert changed_fields(first, state_digest(twin)) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_each_kind_of_change_shows_in_the_digest(engine: str) -> None:
    allocator = _build(engine)
    changes = {
        "clock": lambda: allocator.advance_clock(1),
        "a reference": lambda: allocator.acquire_blocks([0]),
        "an eviction": lambda: allocator.evict_cached_blocks(1),
        "a hand-out": lambda: allocator.allocate_memory_blocks(1),
        "routing": lambda: allocator.store_block_routing(
            1, torch.full((2, 1, 1), 3, dtype=torch.int64)
        ),
        "a pause": lambda: allocator.pause([1]),
        "an event": lambda: allocator.take_events(),
    }
    for name, change in changes.items():
        before = state_digest(allocator)
        change()
        assert changed_fields(before, state_digest(allocator)), name


def test_the_python_and_native_engines_agree_on_the_seam_fields() -> None:
    if not native_available():
        pytest.skip(NATIVE_MISSING)
    python, native = state_digest(_build("python")), state_digest(_build("native"))
    assert {k: python[k] for k in SEAM_FIELDS} == {k: native[k] for k in SEAM_FIELDS}
    assert "policy_order" in python and "policy_order" not in native


def test_the_python_engine_shows_its_internals_and_the_policy_order() -> None:
    allocator = _build("python")
    digest = state_digest(allocator)
    assert digest["policy_order"] == allocator.policy.eviction_order() == [4]
    assert digest["policy_tracked"] == [4]  # only the leaf of the cached chain
    # Touching an inner cached block moves its access clock (and the allocator's
    # clock and counters); only the Python engine's internals show which block.
    allocator.update_timestamps([3])
    changed = {line.split(":")[0] for line in changed_fields(digest, state_digest(allocator))}
    assert "last_access" in changed
    assert changed <= {"stats", "clock", "counters", "last_access", "num_accesses"}


class _ScriptedOrder(LRUPolicy):
    """An LRU whose evict would answer from a script: the digest must not call it."""

    def evict(self, num_blocks: int) -> list[int]:
        raise AssertionError("the digest drove the policy")


def test_a_policy_with_its_own_order_is_read_not_driven() -> None:
    allocator = _build("python", eviction_policy=_ScriptedOrder())
    assert state_digest(allocator)["policy_order"] == [4]


def test_a_policy_to_read_may_be_named_instead_of_the_allocators() -> None:
    allocator = _build("python")
    other = copy.deepcopy(allocator.policy)
    other.discard(4)
    digest = state_digest(allocator, policy=other)
    assert digest["policy_tracked"] == [] and digest["policy_order"] == []
    assert state_digest(allocator)["policy_tracked"] == [4]


def test_changed_fields_names_each_difference_shortly() -> None:
    before = {"a": 1, "b": list(range(100)), "c": "same"}
    after = {"a": 2, "b": list(range(101)), "c": "same"}
    lines = changed_fields(before, after)
    assert lines[0] == "a: 1 -> 2"
    assert lines[1].startswith("b: [0, 1, 2") and lines[1].count("...") == 2
    assert len(lines) == 2
    assert changed_fields({"gone": 1}, {}) == ["gone: 1 -> None"]


def test_pool_digest_is_the_free_count_and_the_stack() -> None:
    pool = BlockPool(5, "cpu")
    assert pool_digest(pool) == (4, [3, 2, 1, 0])
    pool.acquire(2)
    assert pool_digest(pool) == (2, [3, 2])
