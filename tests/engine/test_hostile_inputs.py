"""Issue 15, items 1, 2 and 6: hostile integers and odd types are refused up front.

Every refusal goes through the ``refuses`` fixture: the library's own error,
and a state digest equal before and after. Calls that used to hang run in a
thread with a deadline, so a regression fails instead of stalling the suite.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from prefixcache import KVBlockAllocator
from prefixcache.engine.events import wire_hash
from prefixcache.engine.locked import ThreadSafeAllocator

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
DEADLINE_S = 10.0  # a bound on hangs, never a timing assertion


@pytest.fixture
def make(make: Callable[..., KVBlockAllocator]) -> Callable[..., KVBlockAllocator]:
    """The shared factory on the Python engine, whose whole state the digest reads."""
    return functools.partial(make, engine="python")


@pytest.fixture
def populated(make: Callable[..., KVBlockAllocator]) -> SimpleNamespace:
    """Blocks in every state: an active chain (101, 102, 103), a cached one, a paused block."""
    allocator = make(paused_count=2)
    chain = allocator.allocate_memory_blocks(3)
    allocator.register_kv_block_hashes(chain, [101, 102, 103])
    cached = allocator.allocate_memory_blocks(2)
    allocator.register_kv_block_hashes(cached, [201, 202])
    allocator.release_memory_blocks(cached)
    allocator.pause(allocator.allocate_memory_blocks(1))
    return SimpleNamespace(allocator=allocator, chain=chain)


def finishes(call: Callable[[], Any]) -> Any:
    """Run ``call`` in a daemon thread; fail (instead of hanging) if it does not return."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed back to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), "the call did not return"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


# ---------------------------------------------------------------- item 1: the hang


@pytest.mark.parametrize("block_hash", [-5, -2, INT64_MIN, INT64_MIN + 1])
def test_negative_hash_with_events_returns_and_is_announced(
    make: Callable[..., KVBlockAllocator], block_hash: int
) -> None:
    allocator = make(kv_events_capacity=10)
    ids = allocator.allocate_memory_blocks(1)
    finishes(lambda: allocator.register_kv_block_hashes(ids, [block_hash]))
    (event,) = allocator.take_events()
    assert event.block_hashes == (wire_hash(block_hash),)
    assert 0 <= event.block_hashes[0] <= INT64_MAX
    allocator.release_memory_blocks(ids)
    allocator.evict_cached_blocks(1)
    (removed,) = allocator.take_events()
    assert removed.block_hashes == event.block_hashes


def test_negative_hash_under_the_lock_releases_the_lock(
    make: Callable[..., KVBlockAllocator],
) -> None:
    shared = ThreadSafeAllocator(make(kv_events_capacity=10))
    ids = shared.allocate_memory_blocks(1)
    finishes(lambda: shared.register_kv_block_hashes(ids, [-5]))

    def take_and_give_back() -> bool:
        taken = shared.lock.acquire(timeout=DEADLINE_S)
        if taken:
            shared.lock.release()
        return taken

    assert finishes(take_and_give_back)  # from another thread: the lock is free


@pytest.mark.parametrize("value", [-1, -5, INT64_MIN, -(1 << 64) - 3, -(1 << 200)])
def test_wire_hash_of_any_negative_int_terminates_in_range(value: int) -> None:
    folded = finishes(lambda: wire_hash(value))
    assert 1 <= folded <= INT64_MAX
