"""Hand-written scenarios where the victim order is subtle, on both engines.

The state machine of ``test_differential.py`` reaches these rarely: leaves
tied on their last access, a parent exposed by evicting its last child, a
pinned cached block with no cached leaf left, a ref-zero release that drops a
subtree under a referenced descendant, FIFO ignoring touches, free groups
releasing in ascending ID order. Each runs on the Python and the native engine
and compares what was handed out and the free stack. Last, a pause refused by
the paused budget: the same message on both engines, nothing changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from prefixcache import BudgetExceededError, KVBlockAllocator
from prefixcache.engine.native_engine import native_available
from prefixcache.testing import changed_fields, state_digest

pytestmark = pytest.mark.skipif(
    not native_available(), reason="the native engine (prefixcache.engine._native) is not built"
)

Script = Callable[[KVBlockAllocator], list[Any]]


def _on_both(script: Script, policy: str = "lru", total_count: int = 8) -> list[Any]:
    """Run ``script`` on a Python and a native allocator; require the same everything."""
    python, native = (
        KVBlockAllocator(
            total_count=total_count,
            device="cpu",
            eviction_policy=policy,
            engine=engine,
            kv_events_capacity=100,
        )
        for engine in ("python", "native")
    )
    trace = script(native)
    assert trace == script(python)
    assert native._engine.free_ids().tolist() == python.pool.free_ids().tolist()
    assert native.take_events() == python.take_events()
    assert native.stats() == python.stats()
    python.check_invariants()
    native.check_invariants()
    return trace


def _ids(tensor: Any) -> list[int]:
    return [] if tensor is None else tensor.tolist()


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_tied_leaves_leave_in_block_id_order(policy: str) -> None:
    def script(a: KVBlockAllocator) -> list[Any]:
        blocks = _ids(a.allocate_memory_blocks(3))
        for block_id, block_hash in zip(blocks, (11, 12, 13), strict=True):
            a.register_kv_block_hashes([block_id], [block_hash])  # no tick between them
        a.release_memory_blocks(blocks[::-1])
        return [_ids(a.allocate_memory_blocks(7))]

    assert _on_both(script, policy)[0][:3] == [2, 1, 0]


def test_exposed_parent_competes_with_other_leaves_by_age() -> None:
    def script(a: KVBlockAllocator) -> list[Any]:
        chain = _ids(a.allocate_memory_blocks(3))
        a.register_kv_block_hashes(chain, [1, 2, 3])
        other = _ids(a.allocate_memory_blocks(1))
        a.register_kv_block_hashes(other, [9])
        a.release_memory_blocks(other)
        a.release_memory_blocks(chain)
        a.update_timestamps(other)
        return [a.evict_cached_blocks(2), _ids(a.allocate_memory_blocks(6))]

    _on_both(script)


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_touch_moves_an_lru_leaf_but_not_a_fifo_one(policy: str) -> None:
    def script(a: KVBlockAllocator) -> list[Any]:
        blocks = _ids(a.allocate_memory_blocks(2))
        a.register_kv_block_hashes([blocks[0]], [5])
        a.register_kv_block_hashes([blocks[1]], [6])
        a.release_memory_blocks(blocks)
        a.update_timestamps([blocks[0]])
        return [a.evict_cached_blocks(1), _ids(a.allocate_memory_blocks(6))]

    _on_both(script, policy)


def test_pinned_cached_block_goes_with_its_subtree_when_no_leaf_is_left() -> None:
    def script(a: KVBlockAllocator) -> list[Any]:
        chain = _ids(a.allocate_memory_blocks(4))
        a.register_kv_block_hashes(chain, [1, 2, 3, 4])
        a.release_memory_blocks(chain[:3])  # the prefix is cached, pinned below by chain[3]
        freed = a.evict_cached_blocks(2)
        still = a.is_hash_registered(4)
        a.release_memory_blocks(chain[3:])
        return [freed, still, _ids(a.allocate_memory_blocks(7))]

    _on_both(script)


def test_ref_zero_drops_a_subtree_under_a_referenced_descendant() -> None:
    def script(a: KVBlockAllocator) -> list[Any]:
        chain = _ids(a.allocate_memory_blocks(3))
        a.register_kv_block_hashes(chain, [1, 2, 3])
        branch = _ids(a.allocate_memory_blocks(2))
        a.register_kv_block_hashes(branch, [7, 8], parent_hash=1)
        a.release_memory_blocks([chain[0], chain[1]])
        registered = [a.is_hash_registered(h) for h in (1, 2, 3, 7, 8)]
        a.release_memory_blocks(branch + chain[2:])
        return [registered, _ids(a.allocate_memory_blocks(7))]

    _on_both(script, "ref_zero")


def test_free_group_releases_in_ascending_id_order() -> None:
    def script(a: KVBlockAllocator) -> list[Any]:
        blocks = _ids(a.allocate_memory_blocks(5))
        with a.free_group():
            a.release_memory_blocks(blocks[3:])
            a.release_memory_blocks(np.array(blocks[:3][::-1]))
        return [_ids(a.allocate_memory_blocks(7))]

    assert _on_both(script)[0] == [4, 3, 2, 1, 0, 5, 6]


def test_duplicate_release_pushes_sorted_distinct_ids() -> None:
    def script(a: KVBlockAllocator) -> list[Any]:
        blocks = _ids(a.allocate_memory_blocks(3))
        a.acquire_blocks([blocks[2]])
        a.release_memory_blocks([blocks[2], blocks[0], blocks[2], blocks[1]])
        return [_ids(a.allocate_memory_blocks(7))]

    _on_both(script)


def test_a_refused_pause_is_refused_alike_and_changes_nothing() -> None:
    """Issue 15 item 3 on both engines: the paused budget bounds blocks holding paused references.

    Pausing blocks a running request still holds gives them paused references;
    when that would exceed the budget, both engines refuse with the same
    message and change nothing, and a pause that adds no new holder passes.
    """
    engines = [
        KVBlockAllocator(total_count=8, paused_count=2, device="cpu", engine=engine)
        for engine in ("python", "native")
    ]
    messages = []
    for allocator in engines:
        ids = allocator.allocate_memory_blocks(3).tolist()
        allocator.acquire_blocks(ids)  # a second, running holder of each
        allocator.pause(ids[:2])  # budget full; each block still runs
        before = state_digest(allocator)
        with pytest.raises(BudgetExceededError) as refused:
            allocator.pause(ids[1:])  # ids[2] would be a third holder
        messages.append(str(refused.value))
        after = state_digest(allocator)
        assert after == before, changed_fields(before, after)
        allocator.pause(ids[1:2])  # a holder's last active reference: no new holder, passes
        allocator.release_memory_blocks([ids[0], ids[2], ids[2]])  # the running holders finish
        assert (allocator.get_paused_used(), allocator.get_paused_avail()) == (2, 0)
        assert allocator._engine.find_problems() == []
    assert messages[0] == messages[1]
    assert "1 more block(s)" in messages[0]
