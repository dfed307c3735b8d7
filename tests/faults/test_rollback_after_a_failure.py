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
from prefixcache.policies import LRUPolicy

from prefixcache import KVBlockAllocator

Digest = Callable[[KVBlockAllocator], Any]


class InjectedFault(RuntimeError):
    """What a :class:`FlakyLRU` or a patched pool raises (not a library error)."""


class FlakyLRU(LRUPolicy):
    """LRU whose ``fail_at[method]``-th call of ``method`` (1-based) raises, once armed.

    It raises before changing anything, as the journal requires of a policy.
    It also counts inserts, to show which leaves went through the policy.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fail_at: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.inserted: list[int] = []
        self.insert_args: list[tuple[int, int, int, int, int]] = []

    def _tick(self, method: str) -> None:
        if method in self.fail_at:
            self.calls[method] = self.calls.get(method, 0) + 1
            if self.calls[method] == self.fail_at[method]:
                raise InjectedFault(f"{method} call {self.calls[method]}")

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        self._tick("insert")
        self.inserted.append(block_id)
        self.insert_args.append((block_id, block_hash, last_access, num_accesses, depth))
        super().insert(block_id, block_hash, last_access, num_accesses, depth)

    def discard(self, block_id: int) -> None:
        self._tick("discard")
        super().discard(block_id)

    def touch(self, block_id: int, now: int) -> None:
        self._tick("touch")
        super().touch(block_id, now)


def _make(policy: Any, total_count: int = 10) -> KVBlockAllocator:
    return KVBlockAllocator(
        total_count=total_count, block_size_tokens=2, device="cpu", eviction_policy=policy
    )


def _chain(allocator: KVBlockAllocator, hashes: list[int], **kwargs: Any) -> list[int]:
    ids = allocator.allocate_memory_blocks(len(hashes))
    assert ids is not None
    allocator.register_kv_block_hashes(ids, hashes, **kwargs)
    return ids.tolist()


def _fail_pool(allocator: KVBlockAllocator, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise InjectedFault(f"pool.{method}")

    monkeypatch.setattr(allocator.pool, method, broken)


def _paused_allocator() -> KVBlockAllocator:
    return KVBlockAllocator(total_count=10, paused_count=3, block_size_tokens=2, device="cpu")


# ---------------------------------------------------------------------- journal rollback


def test_a_pool_failure_after_caching_leaves_takes_the_leaves_back_out(
    digest: Digest, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = FlakyLRU()
    allocator = _make(policy)
    first = _chain(allocator, [11])
    second = _chain(allocator, [21])
    unhashed = allocator.allocate_memory_blocks(1).tolist()
    _fail_pool(allocator, "release", monkeypatch)
    before = digest(allocator)
    with pytest.raises(InjectedFault, match=r"pool\.release"):
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
    digest: Digest, failing: str, call: str
) -> None:
    policy = FlakyLRU()
    allocator = _make(policy)
    first = _chain(allocator, [11])
    allocator.advance_clock()
    second = _chain(allocator, [21])
    allocator.release_memory_blocks([*first, *second])
    policy.fail_at = {failing: 2}
    before = digest(allocator)
    with pytest.raises(InjectedFault, match=f"{failing} call 2"):
        getattr(allocator, call)([*first, *second])
    assert digest(allocator) == before
    assert policy.eviction_order() == [*first, *second]  # the first is the oldest again


@pytest.mark.parametrize("evict", ["evict_cached_blocks", "allocate_memory_blocks"])
def test_a_pool_failure_after_planning_an_eviction_reinserts_the_victims(
    evict: str, digest: Digest, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = FlakyLRU()
    allocator = _make(policy, total_count=5)
    leaves = [_chain(allocator, [11 + i])[0] for i in range(3)]
    held = allocator.allocate_memory_blocks(1)
    assert held is not None
    allocator.release_memory_blocks(leaves)
    pool_method = "release" if evict == "evict_cached_blocks" else "acquire"
    _fail_pool(allocator, pool_method, monkeypatch)
    before = digest(allocator)
    with pytest.raises(InjectedFault, match=rf"pool\.{pool_method}"):
        getattr(allocator, evict)(2)
    assert digest(allocator) == before
    assert policy.eviction_order() == leaves


def test_a_policy_failing_to_take_an_exposed_parent_undoes_the_eviction(
    digest: Digest,
) -> None:
    policy = FlakyLRU()
    allocator = _make(policy)
    parent, child = _chain(allocator, [11, 12])
    allocator.release_memory_blocks([parent, child])
    policy.fail_at = {"insert": 1}  # the exposed parent's insert
    before = digest(allocator)
    with pytest.raises(InjectedFault, match="insert call 1"):
        allocator.evict_cached_blocks(1)
    assert digest(allocator) == before
    assert policy.eviction_order() == [child]


# ---------------------------------------------------------------------- reset


def test_a_pool_failure_in_reset_puts_every_cached_leaf_back(
    digest: Digest, monkeypatch: pytest.MonkeyPatch
) -> None:
    allocator = _paused_allocator()
    first_leaf = _chain(allocator, [11])  # block 0: the first usable ID is a cached leaf
    assert first_leaf == [0]
    inner, leaf = _chain(allocator, [21, 22])
    _chain(allocator, [31])  # a registered leaf held by a request
    paused = _chain(allocator, [41])
    allocator.pause(paused)
    pinned, _below = _chain(allocator, [51, 52])  # the held child pins its cached parent
    allocator.release_memory_blocks([*first_leaf, inner, leaf, pinned])
    _fail_pool(allocator, "reset", monkeypatch)
    before = digest(allocator)
    with pytest.raises(InjectedFault, match=r"pool\.reset"):
        allocator.reset()
    assert digest(allocator) == before
    assert sorted(allocator.policy.eviction_order()) == sorted([*first_leaf, leaf])
    allocator.check_invariants()
