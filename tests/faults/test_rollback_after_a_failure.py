"""A policy or pool call that fails part-way leaves the allocator exactly as it was.

The fault-injection harness (``test_fault_injection.py``) judges each public
method on its own program; here each journalled call (insert, discard,
evicted victim, touch) and the pool under ``reset`` fail on their own, and
the digest, the policy's order and the leaves must come back unchanged.

``tests/MUTATION.md`` lists the mutants these tests kill and the survivors that are equivalent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from prefixcache import KVBlockAllocator

Digest = Callable[[KVBlockAllocator], Any]
Make = Callable[..., KVBlockAllocator]
Chain = Callable[..., list[int]]
Flaky = Callable[..., tuple[Any, KVBlockAllocator]]
FailPool = Callable[[KVBlockAllocator, str], None]


@pytest.fixture
def fail_pool(
    monkeypatch: pytest.MonkeyPatch, injected_fault: type[Exception]
) -> Callable[[KVBlockAllocator, str], None]:
    """A function that makes ``allocator.pool.<method>`` raise the injected fault.

    The patch lasts until the test's ``monkeypatch`` is undone (at its end, or
    by ``monkeypatch.undo()``).
    """

    def fail(allocator: KVBlockAllocator, method: str) -> None:
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise injected_fault(f"pool.{method}")

        monkeypatch.setattr(allocator.pool, method, broken)

    return fail


# ---------------------------------------------------------------------- journal rollback


def test_a_pool_failure_after_caching_leaves_takes_the_leaves_back_out(
    digest: Digest,
    monkeypatch: pytest.MonkeyPatch,
    chain: Chain,
    flaky: Flaky,
    injected_fault: Any,
    fail_pool: FailPool,
) -> None:
    policy, allocator = flaky()
    first = chain(allocator, [11])
    second = chain(allocator, [21])
    unhashed = allocator.allocate_memory_blocks(1).tolist()
    fail_pool(allocator, "release")
    before = digest(allocator)
    with pytest.raises(injected_fault, match=r"pool\.release"):
        allocator.release_memory_blocks([*first, *second, *unhashed])
    assert digest(allocator) == before
    assert len(policy) == 0
    monkeypatch.undo()
    allocator.release_memory_blocks([*first, *second, *unhashed])
    assert policy.eviction_order() == [*first, *second]
    allocator.check_invariants()


@pytest.mark.parametrize(
    ("failing", "call"),
    [("discard", "acquire_blocks"), ("touch", "update_timestamps")],
)
def test_a_failed_second_policy_call_restores_the_first_leaf_and_its_place(
    digest: Digest,
    failing: str,
    call: str,
    chain: Chain,
    flaky: Flaky,
    injected_fault: Any,
) -> None:
    policy, allocator = flaky()
    first = chain(allocator, [11])
    allocator.advance_clock()
    second = chain(allocator, [21])
    allocator.release_memory_blocks([*first, *second])
    policy.fail_at = {failing: 2}
    before = digest(allocator)
    with pytest.raises(injected_fault, match=f"{failing} call 2"):
        getattr(allocator, call)([*first, *second])
    assert digest(allocator) == before
    assert policy.eviction_order() == [*first, *second]  # the first is the oldest again


@pytest.mark.parametrize("evict", ["evict_cached_blocks", "allocate_memory_blocks"])
def test_a_pool_failure_after_planning_an_eviction_reinserts_the_victims(
    evict: str,
    digest: Digest,
    chain: Chain,
    flaky: Flaky,
    injected_fault: Any,
    fail_pool: FailPool,
) -> None:
    policy, allocator = flaky(total_count=5)
    leaves = [chain(allocator, [11 + i])[0] for i in range(3)]
    held = allocator.allocate_memory_blocks(1)
    assert held is not None
    allocator.release_memory_blocks(leaves)
    pool_method = "release" if evict == "evict_cached_blocks" else "acquire"
    fail_pool(allocator, pool_method)
    before = digest(allocator)
    with pytest.raises(injected_fault, match=rf"pool\.{pool_method}"):
        getattr(allocator, evict)(2)
    assert digest(allocator) == before
    assert policy.eviction_order() == leaves


def test_a_policy_failing_to_take_an_exposed_parent_undoes_the_eviction(
    digest: Digest,
    chain: Chain,
    flaky: Flaky,
    injected_fault: Any,
) -> None:
    policy, allocator = flaky()
    parent, child = chain(allocator, [11, 12])
    allocator.release_memory_blocks([parent, child])
    policy.fail_at = {"insert": 1}  # the exposed parent's insert
    before = digest(allocator)
    with pytest.raises(injected_fault, match="insert call 1"):
        allocator.evict_cached_blocks(1)
    assert digest(allocator) == before
    assert policy.eviction_order() == [child]


# ---------------------------------------------------------------------- reset


def test_a_pool_failure_in_reset_puts_every_cached_leaf_back(
    digest: Digest,
    make_small: Make,
    chain: Chain,
    injected_fault: Any,
    fail_pool: FailPool,
) -> None:
    allocator = make_small(paused_count=3)
    first_leaf = chain(allocator, [11])  # block 0: the first usable ID is a cached leaf
    assert first_leaf == [0]
    inner, leaf = chain(allocator, [21, 22])
    chain(allocator, [31])  # a registered leaf held by a request
    paused = chain(allocator, [41])
    allocator.pause(paused)
    pinned, _below = chain(allocator, [51, 52])  # the held child pins its cached parent
    allocator.release_memory_blocks([*first_leaf, inner, leaf, pinned])
    fail_pool(allocator, "reset")
    before = digest(allocator)
    with pytest.raises(injected_fault, match=r"pool\.reset"):
        allocator.reset()
    assert digest(allocator) == before
    assert sorted(allocator.policy.eviction_order()) == sorted([*first_leaf, leaf])
    allocator.check_invariants()
