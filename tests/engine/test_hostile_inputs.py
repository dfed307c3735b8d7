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

import numpy as np
import pytest
import torch

from prefixcache import KVBlockAllocator
from prefixcache.engine import clock_methods
from prefixcache.engine.events import wire_hash
from prefixcache.engine.hashing import compute_block_hashes, root_hash
from prefixcache.engine.locked import ThreadSafeAllocator
from prefixcache.errors import InvalidArgumentError, InvalidTensorError, PrefixCacheError

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
OUTSIDE_INT64 = (INT64_MAX + 1, INT64_MIN - 1, 1 << 64, -(1 << 70))
MAX_CLOCK = 1 << 62  # the documented limit of advance_clock
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


# ---------------------------------------------------------------- item 2: 64-bit range


@pytest.mark.parametrize("value", OUTSIDE_INT64)
def test_hashes_outside_int64_are_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError], value: int
) -> None:
    allocator = populated.allocator
    fresh = allocator.allocate_memory_blocks(1)
    refuses(allocator, InvalidArgumentError, allocator.register_kv_block_hashes, fresh, [value])
    refuses(
        allocator,
        InvalidArgumentError,
        allocator.register_kv_block_hashes,
        fresh,
        [7],
        parent_hash=value,
    )
    refuses(allocator, InvalidArgumentError, allocator.match_prefix, [101, value], acquire=True)
    refuses(allocator, InvalidArgumentError, allocator.is_hash_registered, value)


def test_wide_algorithms_take_their_own_range(make: Callable[..., KVBlockAllocator]) -> None:
    allocator = make(hash_algo="sha256")
    hashes = allocator.hash_tokens(list(range(8)))
    assert max(hashes) > INT64_MAX
    ids = allocator.allocate_memory_blocks(2)
    allocator.register_kv_block_hashes(ids, hashes)
    assert allocator.match_prefix(hashes).tolist() == ids.tolist()
    assert allocator.is_hash_registered(hashes[1])
    with pytest.raises(InvalidArgumentError):
        allocator.match_prefix([1 << 256])


def test_uint64_hash_arrays_above_int64_are_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    allocator = populated.allocator
    hashes = np.array([101, INT64_MAX + 5], dtype=np.uint64)
    refuses(allocator, InvalidArgumentError, allocator.match_prefix, hashes)


def test_clock_past_its_limit_is_refused_and_a_hit_still_works(
    make: Callable[..., KVBlockAllocator], refuses: Callable[..., PrefixCacheError]
) -> None:
    assert getattr(clock_methods, "MAX_CLOCK", None) == MAX_CLOCK
    allocator = make()
    ids = allocator.allocate_memory_blocks(2)
    allocator.register_kv_block_hashes(ids, [11, 12])
    allocator.release_memory_blocks(ids)
    refuses(allocator, InvalidArgumentError, allocator.advance_clock, 1 << 63)
    refuses(allocator, InvalidArgumentError, allocator.advance_clock, MAX_CLOCK)  # clock > 0
    allocator.advance_clock(MAX_CLOCK - allocator.clock)
    assert allocator.clock == MAX_CLOCK
    refuses(allocator, InvalidArgumentError, allocator.advance_clock, 1)
    hit = allocator.match_prefix([11, 12], acquire=True)  # ticks the int64 clock: no overflow
    assert hit.tolist() == ids.tolist()
    allocator.release_memory_blocks(hit)
    allocator.check_invariants()


@pytest.mark.parametrize(
    "call",
    [
        lambda a: a.allocate_memory_blocks(1 << 64),
        lambda a: a.is_memory_available(1 << 64),
        lambda a: a.evict_cached_blocks(1 << 63),
        lambda a: a.evict_lru_blocks(-(1 << 64)),
        lambda a: a.set_retention_priority([5], 1 << 63),
        lambda a: a.set_retention_priority([5], 1, duration=1 << 63),
        lambda a: a.set_retention_priority([5], 1, duration=-1),
        lambda a: a.release_memory_blocks([1 << 64]),
        lambda a: a.hash_tokens([1 << 40] * 4),
        lambda a: a.register_kv_block_hashes([0], [7], token_ids=[1 << 64, 1, 2, 3]),
    ],
)
def test_counts_durations_ids_and_tokens_outside_range_are_refused(
    make: Callable[..., KVBlockAllocator],
    refuses: Callable[..., PrefixCacheError],
    call: Callable[[KVBlockAllocator], object],
) -> None:
    allocator = make(eviction_policy="priority", kv_events_capacity=4)
    allocator.allocate_memory_blocks(2)
    refuses(allocator, InvalidArgumentError, lambda: call(allocator))


# ---------------------------------------------------------------- item 6: one rule for ints


@pytest.mark.parametrize(
    "call",
    [
        lambda a: a.hash_tokens([1, True, 3, 4]),
        lambda a: a.hash_tokens((False,) * 4),
        lambda a: a.fingerprint_tokens([1, 2, 3, True]),
        lambda a: a.match_prefix([True]),
        lambda a: a.is_hash_registered(True),
        lambda a: a.register_kv_block_hashes([0], [7], parent_hash=True),
        lambda a: a.register_kv_block_hashes([0], [7], token_ids=[True, 1, 2, 3]),
        lambda a: a.release_memory_blocks([True]),
        lambda a: a.allocate_memory_blocks(True),
        lambda a: a.advance_clock(True),
        lambda a: a.set_retention_priority([5], np.bool_(True)),
        lambda a: a.match_prefix([5], acquire=1),
        lambda a: a.hash_tokens(torch.tensor([True, False, True, True])),
    ],
)
def test_bools_are_never_ints(
    make: Callable[..., KVBlockAllocator],
    refuses: Callable[..., PrefixCacheError],
    call: Callable[[KVBlockAllocator], object],
) -> None:
    allocator = make(eviction_policy="priority")
    allocator.allocate_memory_blocks(1)
    refuses(allocator, InvalidArgumentError, lambda: call(allocator))


def test_numpy_integers_are_ints_everywhere(make: Callable[..., KVBlockAllocator]) -> None:
    plain = make(eviction_policy="priority")
    numpy = make(eviction_policy="priority")
    for allocator, ints in ((plain, int), (numpy, np.int64)):
        ids = allocator.allocate_memory_blocks(ints(2))
        hashes = allocator.hash_tokens([ints(t) for t in range(8)], extra_keys=(ints(3),))
        allocator.register_kv_block_hashes(ids, [ints(h) for h in hashes])
        assert allocator.is_hash_registered(ints(hashes[0]))
        allocator.set_retention_priority([ints(hashes[1])], ints(2), duration=ints(5))
        assert allocator.advance_clock(ints(3)) == allocator.clock
        allocator.release_memory_blocks([ints(i) for i in ids.tolist()])
        hit = allocator.match_prefix([ints(h) for h in hashes], acquire=True)
        assert len(hit) == 2
        allocator.release_memory_blocks(hit)
        assert allocator.evict_cached_blocks(ints(1)) == 1
        assert type(allocator.clock) is int
    assert plain.stats() == numpy.stats()
    assert root_hash(extra_keys=(np.int32(3),)) == root_hash(extra_keys=(3,))
    assert compute_block_hashes([np.int16(1), 2], 2, parent=np.uint32(9)) == compute_block_hashes(
        [1, 2], 2, parent=9
    )


def test_an_empty_salt_is_refused_not_taken_as_no_salt(
    make: Callable[..., KVBlockAllocator],
) -> None:
    for salt in ("", b""):
        with pytest.raises(InvalidArgumentError, match="salt is empty"):
            root_hash(salt)
        with pytest.raises(InvalidArgumentError, match="salt is empty"):
            make().hash_tokens([1, 2, 3, 4], salt=salt)
    assert root_hash("tenant") != root_hash()


def test_non_int_elements_in_hash_lists_are_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    allocator = populated.allocator
    for bad in ([1.0], ["1"], [None], [np.float64(1)]):
        refuses(allocator, InvalidTensorError, allocator.match_prefix, bad)
