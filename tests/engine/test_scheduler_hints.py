"""Scheduler hints (``hint_upcoming`` / ``withdraw_hint``): protection, bound, yield, errors.

Every policy the engine runs by name, both engines: a hinted prefix survives
eviction pressure that takes every other cached block, withdrawing it hands
it back to the policy, hints never hold more than ``hint_limit`` blocks, and
they are yielded (newest first) rather than fail an allocation, an admission,
a session turn or a resume that would succeed without them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from prefixcache import KVBlockAllocator
from prefixcache.engine.locked import ThreadSafeAllocator
from prefixcache.errors import (
    BudgetExceededError,
    CapacityError,
    InvalidArgumentError,
    ReferenceCountError,
)
from prefixcache.testing.engine_setup import CACHING_POLICIES, cache_chain, small_allocator

PROTECTED = [301, 302, 303]
OTHER = [401, 402, 403]
ENGINES = ["python", "native"]


def _allocator(engine: str, policy: str = "lru", **kwargs: Any) -> Any:
    """13 blocks (12 usable): the counts below are worked out for that size."""
    return small_allocator(engine, policy, total_count=13, **kwargs)


def _registered(allocator: KVBlockAllocator, hashes: list[int]) -> list[bool]:
    return [allocator.is_hash_registered(h) for h in hashes]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("policy", CACHING_POLICIES)
def test_a_hinted_prefix_outlives_pressure_and_returns_to_the_policy(
    engine: str, policy: str
) -> None:
    allocator = _allocator(engine, policy)
    protected = cache_chain(allocator, PROTECTED)
    cache_chain(allocator, OTHER)
    stats = allocator.stats()
    assert allocator.hint_upcoming("queued", [*PROTECTED, 999]) == 3  # 999 is not cached
    assert allocator.num_hinted_blocks == 3 and allocator.num_hints == 1
    assert allocator.stats().num_queried_tokens == stats.num_queried_tokens  # not a query
    # 12 usable blocks, 3 hinted: the other 9 are free or cached and all get handed out.
    held = allocator.allocate_memory_blocks(9)
    assert held is not None
    assert _registered(allocator, PROTECTED) == [True] * 3
    assert _registered(allocator, OTHER) == [False] * 3
    allocator.check_invariants()
    assert allocator.withdraw_hint("queued") == 3
    assert allocator.num_hinted_blocks == 0 and allocator.num_hints == 0
    active, _ = allocator.reference_counts(protected)
    assert active.tolist() == [0, 0, 0]  # cached again, the policy's to evict
    assert allocator.allocate_memory_blocks(3) is not None
    assert _registered(allocator, PROTECTED) == [False] * 3
    allocator.check_invariants()


@pytest.mark.parametrize("engine", ENGINES)
def test_admission_then_withdrawal_keeps_the_blocks_referenced(engine: str) -> None:
    allocator = _allocator(engine)
    protected = cache_chain(allocator, PROTECTED)
    allocator.hint_upcoming(7, PROTECTED)
    hit = allocator.match_prefix(PROTECTED, acquire=True)
    assert hit.tolist() == protected
    assert allocator.withdraw_hint(7) == 3
    active, _ = allocator.reference_counts(protected)
    assert active.tolist() == [1, 1, 1]  # the admitted request's own references
    allocator.release_memory_blocks(hit)
    assert allocator.stats().num_cached == 3
    allocator.hint_upcoming(7, PROTECTED)  # the key is free again
    allocator.check_invariants()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_re_hint_extends_over_blocks_cached_since(engine: str) -> None:
    allocator = _allocator(engine)
    head = cache_chain(allocator, PROTECTED[:2])
    assert allocator.hint_upcoming("q", PROTECTED) == 2
    tail = allocator.allocate_memory_blocks(1)
    allocator.register_kv_block_hashes(tail, PROTECTED[2:], parent_hash=PROTECTED[1])
    allocator.release_memory_blocks(tail)
    assert allocator.hint_upcoming("q", PROTECTED) == 3
    active, _ = allocator.reference_counts([*head, *tail.tolist()])
    assert active.tolist() == [1, 1, 1]  # one hint reference each, not two
    assert allocator.num_hinted_blocks == 3 and allocator.num_hints == 1
    allocator.check_invariants()


@pytest.mark.parametrize("engine", ENGINES)
def test_hints_hold_at_most_the_limit(engine: str) -> None:
    allocator = _allocator(engine)
    assert allocator.hint_limit == allocator.num_usable
    cache_chain(allocator, PROTECTED)
    cache_chain(allocator, OTHER)
    allocator.set_hint_limit(4)
    assert allocator.hint_upcoming("a", PROTECTED[:2]) == 2
    assert allocator.hint_upcoming("b", PROTECTED) == 3  # two shared: one new block
    assert allocator.num_hinted_blocks == 3
    assert allocator.hint_upcoming("c", OTHER) == 1  # the head that fits
    assert allocator.hint_upcoming("d", OTHER) == 1  # shares it; nothing new fits
    assert allocator.num_hinted_blocks == 4
    for key in "abcd":
        allocator.withdraw_hint(key)
    assert allocator.num_hinted_blocks == 0
    allocator.check_invariants()


@pytest.mark.parametrize("engine", ENGINES)
def test_hints_yield_newest_first_rather_than_fail_an_allocation(engine: str) -> None:
    allocator = _allocator(engine)
    cache_chain(allocator, PROTECTED)
    cache_chain(allocator, OTHER)
    allocator.hint_upcoming("old", PROTECTED)
    allocator.hint_upcoming("new", OTHER)
    assert allocator.is_memory_available(12)
    assert not allocator.is_memory_available(13)
    assert allocator.allocate_memory_blocks(13) is None  # fails without hints too
    assert allocator.num_hinted_blocks == 6  # and nothing was yielded
    held = allocator.allocate_memory_blocks(9)  # the 6 free blocks, then 3 hinted ones
    assert held is not None
    assert _registered(allocator, PROTECTED) == [True] * 3  # the older hint stayed
    assert allocator.num_hinted_blocks == 3 and allocator.num_hints == 2
    assert allocator.withdraw_hint("new") == 0  # yielded: its key held nothing
    assert allocator.withdraw_hint("old") == 3
    allocator.check_invariants()


@pytest.mark.parametrize("engine", ENGINES)
def test_admissions_and_session_turns_yield_hints(engine: str) -> None:
    allocator = _allocator(engine)
    cache_chain(allocator, OTHER)
    tokens = np.arange(20, dtype=np.int64)  # 10 blocks; nothing of it is cached
    hashes = allocator.hash_tokens(tokens[:6])
    cache_chain(allocator, hashes)  # its first 3 blocks are
    allocator.hint_upcoming("mine", hashes)
    allocator.hint_upcoming("other", OTHER)
    row = np.zeros(10, dtype=np.int32)
    assert allocator.admit_request(tokens, row) == 3  # 7 more: 6 free + a yielded hint's leaf
    assert allocator.num_hinted_blocks == 3
    assert _registered(allocator, OTHER) == [True, True, False]  # one eviction was enough
    allocator.release_request(row)
    allocator.withdraw_hint("other")
    allocator.withdraw_hint("mine")
    allocator.check_invariants()

    fresh = _allocator(engine)
    cache_chain(fresh, OTHER)
    fresh.hint_upcoming("other", OTHER)
    session = fresh.open_session()
    assert session.admit(np.arange(100, 120)) == 0  # 10 blocks: 9 free + a yielded hint's
    assert fresh.num_hinted_blocks == 0
    with pytest.raises(CapacityError):
        session.append(np.arange(8))  # no hint left to yield: short as without hints
    fresh.check_invariants()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_resume_yields_hints_when_the_active_budget_refuses(engine: str) -> None:
    allocator = _allocator(engine, paused_count=4)  # active budget 8 of 12
    cache_chain(allocator, PROTECTED)
    paused = allocator.allocate_memory_blocks(3)
    allocator.pause(paused)
    allocator.hint_upcoming("q", PROTECTED)
    running = allocator.allocate_memory_blocks(3)  # 6 active with the hinted ones
    assert running is not None
    allocator.resume(paused)  # 9 > 8 with the hint: it is yielded
    assert allocator.num_hinted_blocks == 0
    allocator.pause(paused)
    allocator.hint_upcoming("r", PROTECTED)
    more = allocator.allocate_memory_blocks(3)  # 9 active without any hint
    assert more is not None
    with pytest.raises(BudgetExceededError):
        allocator.resume(paused)  # 12 > 8 even without the hint: not yielded
    assert allocator.num_hinted_blocks == 3
    allocator.check_invariants()


@pytest.mark.parametrize("engine", ENGINES)
def test_bad_hints_are_refused_and_change_nothing(
    engine: str, refuses: Callable[..., Exception]
) -> None:
    allocator = _allocator(engine)
    cache_chain(allocator, PROTECTED)
    allocator.hint_upcoming("held", PROTECTED)
    for key in (1.5, True, None, (1, 2), 1 << 70):
        refuses(allocator, InvalidArgumentError, allocator.hint_upcoming, key, PROTECTED)
    refuses(allocator, InvalidArgumentError, allocator.hint_upcoming, "new", ["x"])
    refuses(allocator, InvalidArgumentError, allocator.hint_upcoming, "new", [1 << 70])
    refuses(allocator, InvalidArgumentError, allocator.withdraw_hint, "never")
    refuses(allocator, InvalidArgumentError, allocator.withdraw_hint, 2.0)
    refuses(allocator, InvalidArgumentError, allocator.set_hint_limit, -1)
    refuses(allocator, InvalidArgumentError, allocator.set_hint_limit, allocator.num_usable + 1)
    assert allocator.num_hinted_blocks == 3


@pytest.mark.parametrize("engine", ENGINES)
def test_hints_follow_defragmentation_and_end_at_reset(engine: str) -> None:
    allocator = _allocator(engine)
    filler = allocator.allocate_memory_blocks(6)
    protected = cache_chain(allocator, PROTECTED)
    allocator.release_memory_blocks(filler)
    allocator.hint_upcoming("q", PROTECTED)
    assert allocator.apply_defragment(allocator.plan_defragment()) == 3
    moved = allocator.match_prefix(PROTECTED).tolist()
    assert moved != protected
    active, _ = allocator.reference_counts(moved)
    assert active.tolist() == [1, 1, 1]  # the hint's references moved with the blocks
    assert allocator.withdraw_hint("q") == 3
    allocator.check_invariants()
    allocator.hint_upcoming("q", PROTECTED)
    allocator.reset()
    assert allocator.num_hints == 0 and allocator.num_hinted_blocks == 0
    allocator.hint_upcoming("q", PROTECTED)  # nothing cached after a reset
    assert allocator.num_hinted_blocks == 0
    allocator.check_invariants()


def test_ref_zero_keeps_a_hinted_prefix_after_its_request_releases() -> None:
    allocator = _allocator("python", "ref_zero")
    ids = allocator.allocate_memory_blocks(3)
    allocator.register_kv_block_hashes(ids, PROTECTED)
    allocator.hint_upcoming("q", PROTECTED)
    allocator.release_memory_blocks(ids)
    assert _registered(allocator, PROTECTED) == [True] * 3
    allocator.withdraw_hint("q")
    assert _registered(allocator, PROTECTED) == [False] * 3  # dropped, as ref-zero does
    allocator.check_invariants()


def test_the_lock_wrapper_serves_hints() -> None:
    shared = ThreadSafeAllocator(_allocator("python"))
    assert shared.hint_upcoming("q", PROTECTED) == 0
    assert shared.withdraw_hint("q") == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_hint_whose_references_a_caller_released_is_never_yielded(
    engine: str, refuses: Callable[..., Exception]
) -> None:
    allocator = _allocator(engine)
    protected = cache_chain(allocator, PROTECTED)
    cache_chain(allocator, OTHER)
    allocator.hint_upcoming("q", PROTECTED)
    allocator.hint_upcoming("r", OTHER)
    allocator.release_memory_blocks(protected)  # misuse: the caller never held them
    assert allocator.allocate_memory_blocks(10) is None  # 9 without "r"; no yield: unsafe
    assert _registered(allocator, OTHER) == [True] * 3
    refuses(allocator, ReferenceCountError, allocator.withdraw_hint, "q")
    refuses(allocator, ReferenceCountError, allocator.hint_upcoming, "q", PROTECTED)
