"""Tests of the allocator core written to kill mutants that survived the main suite.

Mutation testing of prefixcache/allocator.py, eviction.py and journal.py
left three kinds of behaviour unpinned:

- Rollback. The fault-injection harness computes its report once per
  session, so a mutant of :class:`~prefixcache.engine.journal.PolicyJournal` run
  against one of its tests is judged on that test's method only. Here each
  journalled call (insert, discard, evicted victim, touch) fails part-way
  on its own and the allocator must come back exactly as it was.
- The planner's rare paths: victims a wrong policy names (a free block, the
  same block twice), a policy that runs dry after exposing a parent, two
  pinned subtrees dropped by one eviction, the recency tie-break between
  pinned blocks, and the chain shortcut of ``evicts_first``.
- Partitions and references: a block held both active and paused, moves
  that add no block to an over-full partition, duplicate IDs in releases
  and free groups, batches past the small-batch size.
- Registration's general path (runs of new hashes, their depths and
  events), the arguments hashing passes on, routing refusals, and the exact
  messages and counters that other tests only checked loosely.

One test pins a bug this found and that is now fixed: the fresh-chain
shortcut of ``register_kv_block_hashes`` let a hash repeated in one call be
held by two blocks. ``tests/MUTATION.md`` lists the survivors and why each is
equivalent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from prefixcache.policies import LRUPolicy

from prefixcache import AllocatorConfig, InvariantError, KVBlockAllocator, compute_block_hashes
from prefixcache.engine.events import wire_hash
from prefixcache.engine.invariants import find_invariant_problems

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


class ScriptedLRU(LRUPolicy):
    """LRU whose ``evict`` answers from ``script`` (a list of replies) while it lasts."""

    def __init__(self) -> None:
        super().__init__()
        self.script: list[list[Any]] = []

    def evict(self, num_blocks: int) -> list[int]:
        if self.script:
            return self.script.pop(0)
        return super().evict(num_blocks)


class DryAfterLRU:
    """An LRU that hands out ``budget`` victims, then claims to have none.

    It wraps :class:`LRUPolicy` rather than subclassing it so that it does
    not predict victims (no ``evicts_first``): an exposed parent is inserted.
    """

    retains_unreferenced = True

    def __init__(self, budget: int = 1_000) -> None:
        self.budget = budget
        self._lru = LRUPolicy()

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        self._lru.insert(block_id, block_hash, last_access, num_accesses, depth)

    def discard(self, block_id: int) -> None:
        self._lru.discard(block_id)

    def touch(self, block_id: int, now: int) -> None:
        self._lru.touch(block_id, now)

    def evict(self, num_blocks: int) -> list[int]:
        if self.budget <= 0:
            return []
        victims = self._lru.evict(min(num_blocks, self.budget))
        self.budget -= len(victims)
        return victims

    def clear(self) -> None:
        self._lru.clear()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._lru


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


# ---------------------------------------------------------------------- victims refused


def test_a_free_block_named_as_victim_is_refused(digest: Digest) -> None:
    policy = ScriptedLRU()
    allocator = _make(policy)
    (cached,) = _chain(allocator, [11])
    allocator.release_memory_blocks([cached])
    free_id = int(allocator.pool.free_ids()[0])
    policy.script = [[free_id]]
    before = digest(allocator)
    with pytest.raises(InvariantError, match=rf"^policy ScriptedLRU chose \[{free_id}\], not one"):
        allocator.evict_cached_blocks(1)
    assert digest(allocator) == before


def test_the_same_victim_named_twice_is_refused(digest: Digest) -> None:
    policy = ScriptedLRU()
    allocator = _make(policy)
    first, second = _chain(allocator, [11]) + _chain(allocator, [21])
    allocator.release_memory_blocks([first, second])
    policy.script = [[first], [first]]
    before = digest(allocator)
    with pytest.raises(InvariantError, match=rf"chose \[{first}\], not one cached leaf"):
        allocator.evict_cached_blocks(2)
    assert digest(allocator) == before
    assert policy.eviction_order() == [first, second]


# ---------------------------------------------------------------------- planner paths


def test_a_parent_exposed_by_its_last_child_is_offered_to_the_policy() -> None:
    allocator = _make(DryAfterLRU())
    parent, left = _chain(allocator, [11, 12])
    (right,) = _chain(allocator, [13], parent_hash=11)
    allocator.release_memory_blocks([parent, left, right])
    assert allocator.evict_cached_blocks(2) == 2
    assert allocator.is_hash_registered(11)
    assert parent in allocator.policy  # both children gone: a leaf again
    assert allocator.evict_cached_blocks(1) == 1
    assert not allocator.is_hash_registered(11)
    allocator.check_invariants()


def test_a_policy_that_runs_dry_after_exposing_a_parent_is_caught(digest: Digest) -> None:
    policy = DryAfterLRU()
    allocator = _make(policy)
    parent, child = _chain(allocator, [11, 12])
    allocator.release_memory_blocks([parent, child])
    policy.budget = 1  # the child goes; the exposed parent is inserted, then never named
    before = digest(allocator)
    with pytest.raises(
        InvariantError,
        match=r"^policy DryAfterLRU has no leaf to evict, yet cached blocks remain$",
    ):
        allocator.evict_cached_blocks(2)
    assert digest(allocator) == before


def test_a_lost_leaf_below_a_pinned_block_is_reported_with_the_policy_name() -> None:
    policy = DryAfterLRU()
    allocator = _make(policy)
    root, _middle, leaf = _chain(allocator, [11, 12, 13])
    allocator.release_memory_blocks([root, leaf])
    policy.budget = 0
    with pytest.raises(
        InvariantError,
        match=rf"^policy DryAfterLRU has no leaf to evict, yet the subtree of pinned block "
        rf"{root} holds 1 cached block\(s\) below it$",
    ):
        allocator.evict_cached_blocks(1)


def test_one_eviction_drops_two_pinned_subtrees() -> None:
    allocator = _make(LRUPolicy())
    first_root, first_held = _chain(allocator, [11, 12])
    allocator.advance_clock()
    second_root, second_held = _chain(allocator, [21, 22])
    allocator.release_memory_blocks([first_root, second_root])  # pinned by their children
    assert allocator.evict_cached_blocks(2) == 2
    assert allocator.pool.free_ids().tolist()[-2:] == [first_root, second_root]  # older first
    for block_hash in (11, 12, 21, 22):
        assert not allocator.is_hash_registered(block_hash)
    assert allocator.get_evictable_block_count() == 0
    assert allocator.stats().num_evicted_blocks == 2
    allocator.release_memory_blocks([first_held, second_held])  # unhashed now: freed
    assert allocator.get_total_used() == 0
    allocator.check_invariants()


@pytest.mark.parametrize("older_first", [True, False])
def test_the_least_recently_used_of_equally_deep_pinned_blocks_goes(older_first: bool) -> None:
    allocator = _make(LRUPolicy())
    low_root, low_held = allocator.allocate_memory_blocks(2).tolist()
    high_root, high_held = allocator.allocate_memory_blocks(2).tolist()
    order = [(low_root, low_held, 11), (high_root, high_held, 21)]
    if not older_first:
        order.reverse()
    for root, held, block_hash in order:
        allocator.register_kv_block_hashes([root, held], [block_hash, block_hash + 1])
        allocator.advance_clock()
    allocator.release_memory_blocks([low_root, high_root])
    oldest_root, _, oldest_hash = order[0]
    assert allocator.evict_cached_blocks(1) == 1
    assert allocator.pool.free_ids().tolist()[-1] == oldest_root
    assert not allocator.is_hash_registered(oldest_hash)
    assert allocator.is_hash_registered(order[1][2])


def test_a_chain_is_evicted_from_its_end_without_reinserting_its_inner_blocks() -> None:
    policy = FlakyLRU()
    allocator = _make(policy)
    # One allocation and no clock tick between the registrations: equal last-access times,
    # so the exposed parent's prediction compares block IDs too.
    parent, child, other = allocator.allocate_memory_blocks(3).tolist()
    assert child < other and parent < other  # LRU breaks the tie between equal times by ID
    allocator.register_kv_block_hashes([parent, child], [11, 12])
    allocator.register_kv_block_hashes([other], [21])
    allocator.release_memory_blocks([parent, child, other])
    policy.inserted.clear()
    assert allocator.evict_cached_blocks(2) == 2
    assert policy.inserted == []  # the parent went straight from prediction to eviction
    assert allocator.pool.free_ids().tolist()[-2:] == [child, parent]
    assert allocator.is_hash_registered(21) and not allocator.is_hash_registered(11)
    assert policy.eviction_order() == [other]
    allocator.check_invariants()


def test_counts_in_numpy_integers_are_accepted() -> None:
    allocator = _make(LRUPolicy())
    ids = allocator.allocate_memory_blocks(np.int64(2))
    assert ids is not None and len(ids) == 2
    assert allocator.is_memory_available(np.int32(7)) and not allocator.is_memory_available(10)


# ---------------------------------------------------------------------- large batches


def test_batches_past_the_small_batch_size_count_each_occurrence() -> None:
    allocator = _make(LRUPolicy(), total_count=700)
    ids = allocator.allocate_memory_blocks(600).tolist()
    extra = ids[400]  # not the smallest ID: a duplicate anywhere must be seen
    allocator.acquire_blocks([*ids, extra])
    active, _ = allocator.reference_counts(ids)
    assert active.tolist() == [3 if block_id == extra else 2 for block_id in ids]
    allocator.release_memory_blocks(ids[::-1])  # distinct, in an order that is not sorted
    allocator.release_memory_blocks(ids[::-1])
    freed = [block_id for block_id in ids[::-1] if block_id != extra]
    assert allocator.pool.free_ids().tolist()[-len(freed) :] == freed  # in release order
    assert allocator.get_active_used() == 1
    assert allocator.stats().num_released_references == 2 * len(ids)


def test_releases_count_every_reference_across_calls() -> None:
    allocator = _make(LRUPolicy())
    single, shared = allocator.allocate_memory_blocks(2).tolist()
    allocator.acquire_blocks([shared, shared, shared])  # four references
    allocator.release_memory_blocks([single])  # empties a block: 1
    allocator.release_memory_blocks([shared, shared])  # empties none: 2
    allocator.release_memory_blocks([shared])  # empties none: 1
    assert allocator.stats().num_released_references == 4
    with allocator.free_group():
        allocator.release_memory_blocks([shared])
    assert allocator.stats().num_released_references == 5
    assert allocator.get_active_used() == 0


def test_a_group_applies_every_queued_reference() -> None:
    allocator = _make(LRUPolicy())
    (block,) = allocator.allocate_memory_blocks(1).tolist()
    allocator.acquire_blocks([block])
    with allocator.free_group():
        allocator.release_memory_blocks([block, block])
    assert allocator.get_total_used() == 0
    assert allocator.reference_counts([block])[0].tolist() == [0]


# ---------------------------------------------------------------------- partitions


def _paused_allocator() -> KVBlockAllocator:
    return KVBlockAllocator(total_count=10, paused_count=3, block_size_tokens=2, device="cpu")


def test_a_paused_release_of_a_block_still_active_keeps_it_active() -> None:
    allocator = _paused_allocator()
    (block,) = allocator.allocate_memory_blocks(1).tolist()
    allocator.acquire_blocks([block])
    allocator.pause([block])  # one active, one paused reference
    allocator.release_memory_blocks([block], paused=True)
    active, paused = allocator.reference_counts([block])
    assert (active.tolist(), paused.tolist()) == ([1], [0])
    assert (allocator.get_active_used(), allocator.get_paused_used()) == (1, 0)
    assert block not in allocator.pool.free_ids().tolist()
    allocator.check_invariants()


def test_acquiring_a_paused_block_with_a_cached_leaf_moves_each_to_its_state() -> None:
    allocator = _paused_allocator()
    (held,) = _chain(allocator, [11])
    (cached,) = _chain(allocator, [21])
    allocator.release_memory_blocks([cached])
    allocator.pause([held])
    clock = allocator.clock
    allocator.acquire_blocks([held, cached])
    assert allocator.clock == clock + 1
    assert (allocator.get_active_used(), allocator.get_paused_used()) == (2, 0)
    assert allocator.get_evictable_block_count() == 0
    assert len(allocator.policy) == 0
    assert [t.tolist() for t in allocator.reference_counts([held, cached])] == [[1, 1], [1, 0]]
    allocator.check_invariants()


def test_acquiring_an_active_block_with_a_cached_one_discards_only_the_cached() -> None:
    allocator = _make(LRUPolicy())
    (active,) = _chain(allocator, [11])
    (cached,) = _chain(allocator, [21])
    allocator.release_memory_blocks([cached])
    allocator.acquire_blocks([active, cached])
    assert [t.tolist() for t in allocator.reference_counts([active, cached])] == [[2, 1], [0, 0]]
    assert allocator.get_active_used() == 2 and len(allocator.policy) == 0
    allocator.check_invariants()


def test_a_block_held_active_and_paused_can_be_registered_acquired_and_touched() -> None:
    allocator = _paused_allocator()
    first, second = allocator.allocate_memory_blocks(2).tolist()
    allocator.acquire_blocks([first, second])
    allocator.pause([first, second])  # each: one active, one paused reference
    allocator.update_timestamps([first])
    allocator.acquire_blocks([first])
    assert allocator.register_kv_block_hashes([second], [11]).tolist() == [True]
    assert [t.tolist() for t in allocator.reference_counts([first, second])] == [[2, 1], [1, 1]]


def test_the_policy_hears_the_hand_outs_and_depth_of_a_released_leaf() -> None:
    policy = FlakyLRU()
    allocator = _make(policy)
    root, leaf = _chain(allocator, [11, 12])
    allocator.match_prefix([11, 12], acquire=True)
    allocator.match_prefix([11, 12], acquire=True)
    allocator.release_memory_blocks([root, leaf] * 3)
    ((block_id, block_hash, last_access, num_accesses, depth),) = policy.insert_args
    assert (block_id, block_hash, num_accesses, depth) == (leaf, 12, 3, 1)
    assert type(last_access) is int and last_access == allocator.clock
    _chain(allocator, [21])
    refused, taken = allocator.allocate_memory_blocks(2).tolist()
    # 21 is held by another block: the general path registers 22 under that holder.
    assert allocator.register_kv_block_hashes([refused, taken], [21, 22]).tolist() == [False, True]
    allocator.release_memory_blocks([refused, taken])
    assert policy.insert_args[-1][0] == taken
    assert policy.insert_args[-1][3:] == (1, 1)  # one hand-out since registration; depth 1


def test_move_references_refuses_with_the_partition_named() -> None:
    allocator = _paused_allocator()
    (block,) = allocator.allocate_memory_blocks(1).tolist()
    with pytest.raises(Exception, match=rf"^block {block} \(active\) holds 0 paused reference"):
        allocator.resume([block])
    allocator.pause([block])
    with pytest.raises(Exception, match=rf"^block {block} \(paused\) holds 0 active reference"):
        allocator.pause([block])


def test_pausing_a_block_active_twice_keeps_it_counted_active() -> None:
    allocator = _paused_allocator()
    (block,) = allocator.allocate_memory_blocks(1).tolist()
    allocator.acquire_blocks([block, block])
    allocator.pause([block])
    allocator.pause([block])  # (2 active, 1 paused) -> (1, 2): still active
    assert (allocator.get_active_used(), allocator.get_paused_used()) == (1, 0)
    allocator.check_invariants()


def test_a_move_that_adds_no_block_passes_an_overfull_paused_partition() -> None:
    allocator = KVBlockAllocator(total_count=8, paused_count=1, block_size_tokens=2, device="cpu")
    first, second, third = allocator.allocate_memory_blocks(3).tolist()
    allocator.pause([first])  # the paused budget is full
    allocator.acquire_blocks([second, third])
    allocator.pause([second])  # (1 active, 1 paused): counted active
    allocator.release_memory_blocks([second])  # now paused only: over the budget
    assert allocator.get_paused_used() == 2
    allocator.pause([third])  # stays active: allowed
    assert (allocator.get_active_used(), allocator.get_paused_used()) == (1, 2)


def test_a_move_that_adds_no_block_passes_an_overfull_active_partition() -> None:
    allocator = KVBlockAllocator(total_count=6, paused_count=2, block_size_tokens=2, device="cpu")
    ids = allocator.allocate_memory_blocks(5).tolist()  # active budget 3: allocation ignores it
    allocator.acquire_blocks(ids[:1])
    allocator.pause(ids[:1])
    allocator.resume(ids[:1])  # stays active: allowed
    assert allocator.get_active_used() == 5


def test_resume_may_fill_the_active_budget_exactly() -> None:
    allocator = KVBlockAllocator(total_count=6, paused_count=2, block_size_tokens=2, device="cpu")
    ids = allocator.allocate_memory_blocks(3).tolist()  # the active budget is 3
    allocator.pause(ids[:1])
    allocator.resume(ids[:1])
    assert allocator.get_active_used() == 3 and allocator.get_active_avail() == 0


# ---------------------------------------------------------------------- messages


def _refusal_cases() -> list[Any]:
    """(setup-and-call, error type name, exact message pattern) per refusal."""

    def block_of(allocator: KVBlockAllocator, state: str) -> int:
        (block,) = allocator.allocate_memory_blocks(1).tolist()
        if state == "cached":
            allocator.register_kv_block_hashes([block], [77])
            allocator.release_memory_blocks([block])
        elif state == "paused":
            allocator.pause([block])
        elif state == "free":
            allocator.release_memory_blocks([block])
        return block

    def release(state: str, paused: Any) -> Callable[[KVBlockAllocator], Any]:
        def call(allocator: KVBlockAllocator) -> Any:
            block = block_of(allocator, state)
            return lambda: allocator.release_memory_blocks([block], paused=paused)

        return call

    def queued_twice(allocator: KVBlockAllocator) -> Any:
        block = block_of(allocator, "active")

        def call() -> None:
            with allocator.free_group():
                allocator.release_memory_blocks([block, block])

        return call

    def on(method: str, *args: Any, **kwargs: Any) -> Callable[[KVBlockAllocator], Any]:
        return lambda allocator: lambda: getattr(allocator, method)(*args, **kwargs)

    def on_block(state: str, method: str, *args: Any) -> Callable[[KVBlockAllocator], Any]:
        def call(allocator: KVBlockAllocator) -> Any:
            block = block_of(allocator, state)
            return lambda: getattr(allocator, method)([block], *args)

        return call

    def twice_in_one_call(allocator: KVBlockAllocator) -> Any:
        (block,) = allocator.allocate_memory_blocks(1).tolist()
        return lambda: allocator.register_kv_block_hashes([block, block], [5, 6])

    b = r"block \d+"
    return [
        (
            release("cached", False),
            "ReferenceCountError",
            rf"{b} \(cached\) holds 0 active reference\(s\); asked to drop 1",
        ),
        (
            release("free", False),
            "ReferenceCountError",
            rf"{b} \(free\) holds 0 active reference\(s\); asked to drop 1",
        ),
        (
            release("paused", False),
            "ReferenceCountError",
            rf"{b} \(paused\) holds 0 active reference\(s\); asked to drop 1",
        ),
        (
            release("active", True),
            "ReferenceCountError",
            rf"{b} \(active\) holds 0 paused reference\(s\); asked to drop 1",
        ),
        (
            queued_twice,
            "ReferenceCountError",
            rf"{b} \(active\) holds 1 active \(after queued releases\) reference\(s\); "
            "asked to drop 2",
        ),
        (
            release("active", "no"),
            "InvalidArgumentError",  # type: ignore[arg-type]
            "paused must be a bool, got 'no'",
        ),
        (
            on("allocate_memory_blocks", 2.0),
            "InvalidArgumentError",
            "num_blocks must be an int, got 2.0",
        ),
        (
            on("allocate_memory_blocks", -1),
            "InvalidArgumentError",
            "num_blocks must be >= 0, got -1",
        ),
        (
            on("match_prefix", [1], acquire="yes"),
            "InvalidArgumentError",
            "acquire must be a bool, got 'yes'",
        ),
        (
            on("match_prefix", "ab"),
            "InvalidTensorError",
            "block_hashes must be a sequence of ints or a 1-D integer tensor, got str",
        ),
        (
            on("set_retention_priority", "ab", 1),
            "ConfigError",
            r"policy LRUPolicy does not support retention priorities; "
            r"configure one that does \(e\.g\. 'priority'\)",
        ),
        (
            on_block("active", "register_kv_block_hashes", "ab"),
            "InvalidTensorError",
            "block_hashes must be a sequence of ints or a 1-D integer tensor, got str",
        ),
        (
            on_block("active", "register_kv_block_hashes", [1, 2]),
            "InvalidArgumentError",
            "1 block IDs but 2 hashes",
        ),
        (
            on_block("free", "register_kv_block_hashes", [1]),
            "BlockStateError",
            rf"{b} \(free\) is not referenced; register blocks while a request holds them",
        ),
        (
            twice_in_one_call,
            "HashConflictError",
            r"block \d+ appears twice with different hashes \(5 and 6\)",
        ),
        (
            on_block("free", "acquire_blocks"),
            "BlockStateError",
            r"block \d+ is free; only cached or referenced blocks can be acquired "
            r"\(allocate fresh blocks instead\)",
        ),
        (
            on_block("free", "update_timestamps"),
            "BlockStateError",
            r"block \d+ is free; it has no timestamp to update",
        ),
        (
            on("is_hash_registered", "1"),
            "InvalidArgumentError",
            "block_hash must be an int, got '1'",
        ),
        (
            on("is_hash_registered", True),
            "InvalidArgumentError",
            "block_hash must be an int, got True",
        ),
        (on("advance_clock", -1), "InvalidArgumentError", "ticks must be an int >= 0, got -1"),
        (
            on("hash_tokens", [1, 2], extra_keys="k"),
            "InvalidArgumentError",
            "extra_keys must be a list or tuple of keys, got str",
        ),
        (on("take_events"), "ConfigError", r"KV cache events are off; set kv_events_capacity > 0"),
    ]


@pytest.mark.parametrize(("setup", "error", "message"), _refusal_cases())
def test_refusals_say_exactly_what_is_wrong(
    setup: Callable[[KVBlockAllocator], Callable[[], Any]], error: str, message: str
) -> None:
    allocator = _paused_allocator()
    call = setup(allocator)
    with pytest.raises(Exception, match=f"^{message}$") as info:
        call()
    assert type(info.value).__name__ == error


def test_register_refuses_a_lora_name_that_is_not_a_string_and_tokens_of_the_wrong_size() -> None:
    allocator = KVBlockAllocator(
        total_count=10, block_size_tokens=2, device="cpu", kv_events_capacity=10
    )
    ids = allocator.allocate_memory_blocks(1)
    with pytest.raises(Exception, match=r"^lora_name must be a string or None, got 3$"):
        allocator.register_kv_block_hashes(ids, [5], lora_name=3)  # type: ignore[arg-type]
    with pytest.raises(Exception, match=r"^token_ids has 3 tokens; 1 blocks of 2 need 2$"):
        allocator.register_kv_block_hashes(ids, [5], token_ids=[1, 2, 3])
    with pytest.raises(Exception, match=r"^token_ids must contain only ints$"):
        allocator.register_kv_block_hashes(ids, [5], token_ids=[1.5, 2.5])


def test_verify_mode_names_the_missing_or_malformed_fingerprints() -> None:
    allocator = KVBlockAllocator(
        total_count=10, block_size_tokens=2, device="cpu", verify_prefix_hits=True
    )
    with pytest.raises(
        Exception, match=r"^verify_prefix_hits is on: pass fingerprints \(see fingerprint_tokens\)$"
    ):
        allocator.match_prefix([1])
    with pytest.raises(Exception, match=r"^fingerprints must be a sequence of ints or a 1-D"):
        allocator.match_prefix([1], fingerprints="ab")


def test_the_constructor_names_a_wrong_config() -> None:
    config = AllocatorConfig(total_count=8, device="cpu")
    with pytest.raises(
        Exception, match=r"^pass either an AllocatorConfig or keyword arguments, not both$"
    ):
        KVBlockAllocator(config, total_count=8)
    with pytest.raises(Exception, match=r"^config must be an AllocatorConfig, got object$"):
        KVBlockAllocator(object())  # type: ignore[arg-type]
    assert repr(KVBlockAllocator(config)) == "KVBlockAllocator(total_count=8, policy=LRUPolicy)"


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


# ---------------------------------------------------------------------- hashing


def test_hash_tokens_passes_parent_salt_and_keys_to_the_configured_algorithm() -> None:
    tokens = [1, 2, 3, 4]
    allocator = KVBlockAllocator(
        total_count=4, block_size_tokens=2, device="cpu", hash_algo="sha256", hash_salt="v2"
    )
    expected = compute_block_hashes(
        tokens, 2, parent=9, salt="s", extra_keys=["v2", "k"], algo="sha256"
    )
    assert allocator.hash_tokens(tokens, parent=9, salt="s", extra_keys=["k"]) == expected
    assert allocator.hash_tokens(tokens) == compute_block_hashes(
        tokens, 2, extra_keys=["v2"], algo="sha256"
    )
    assert allocator.hash_tokens(tokens, salt="s", extra_keys=["k"]) == compute_block_hashes(
        tokens, 2, salt="s", extra_keys=["v2", "k"], algo="sha256"
    )


def test_a_callable_hash_algorithm_gets_every_argument() -> None:
    seen: list[tuple[Any, ...]] = []

    def algo(
        tokens: Any,
        block_size: int,
        *,
        parent: int | None = None,
        salt: Any = None,
        extra_keys: Any = None,
    ) -> list[int]:
        seen.append((list(tokens), block_size, parent, salt, extra_keys))
        return [7]

    allocator = KVBlockAllocator(
        total_count=4, block_size_tokens=2, device="cpu", hash_algo=algo, hash_salt="v2"
    )
    seen.clear()  # the config may probe the function
    assert allocator.hash_tokens([1, 2], parent=5, salt="s", extra_keys=("k",)) == [7]
    assert seen == [([1, 2], 2, 5, "s", ["v2", "k"])]


@pytest.mark.parametrize(
    ("hash_algo", "fingerprint_algo"),
    [("xxh3_64", "xxh3_128"), ("sha256", "xxh3_128"), ("xxh3_128", "sha256")],
)
def test_fingerprints_use_the_other_algorithm_under_their_own_root(
    hash_algo: str, fingerprint_algo: str
) -> None:
    tokens = [1, 2, 3, 4]
    allocator = KVBlockAllocator(
        total_count=4, block_size_tokens=2, device="cpu", hash_algo=hash_algo, hash_salt="v2"
    )
    for parent in (None, 9):  # salt and keys seed a chain's root; a parent carries them
        got = allocator.fingerprint_tokens(tokens, parent=parent, salt="s", extra_keys=["k"])
        assert got == compute_block_hashes(
            tokens,
            2,
            parent=parent,
            salt="s",
            extra_keys=["prefixcache-fingerprint", "v2", "k"],
            algo=fingerprint_algo,
        )


# ---------------------------------------------------------------------- registration


def _events_allocator(**kwargs: Any) -> KVBlockAllocator:
    return KVBlockAllocator(
        total_count=12, block_size_tokens=2, device="cpu", kv_events_capacity=100, **kwargs
    )


def test_extending_a_registered_prefix_hangs_the_new_blocks_under_its_end() -> None:
    allocator = _events_allocator(kv_events_medium="CPU_TIER")
    first, second = _chain(allocator, [11, 12])
    (third,) = allocator.allocate_memory_blocks(1).tolist()
    allocator.take_events()
    held = allocator.register_kv_block_hashes(
        [first, second, third], [11, 12, 13], token_ids=[1, 2, 3, 4, 5, 6], lora_name="a"
    )
    assert held.dtype == torch.bool and held.tolist() == [True, True, True]
    assert int(allocator.registry.parent_of[third]) == second
    (event,) = allocator.take_events()
    assert event.block_hashes == (wire_hash(13),)
    assert event.parent_block_hash == wire_hash(12)
    assert event.token_ids == (5, 6) and event.lora_name == "a" and event.medium == "CPU_TIER"


def test_a_chain_continued_from_a_cached_leaf_takes_it_out_of_the_policy() -> None:
    allocator = _events_allocator()
    (parent,) = _chain(allocator, [11])
    allocator.release_memory_blocks([parent])
    assert parent in allocator.policy
    (child,) = allocator.allocate_memory_blocks(1).tolist()
    allocator.take_events()
    allocator.register_kv_block_hashes([child], [12], parent_hash=11)
    assert parent not in allocator.policy
    (event,) = allocator.take_events()
    assert event.parent_block_hash == wire_hash(11)
    allocator.check_invariants()


class RegistrationLog(LRUPolicy):
    """LRU that records the registration hook's calls."""

    def __init__(self) -> None:
        super().__init__()
        self.registered: list[tuple[list[int], int]] = []

    def on_register(self, block_hashes: list[int], first_depth: int) -> None:
        self.registered.append((list(block_hashes), first_depth))


def test_the_general_path_splits_new_hashes_into_runs_with_their_depths() -> None:
    policy = RegistrationLog()
    allocator = KVBlockAllocator(
        total_count=12,
        block_size_tokens=2,
        device="cpu",
        kv_events_capacity=100,
        eviction_policy=policy,
    )
    (root,) = _chain(allocator, [10])
    (holder,) = _chain(allocator, [12], parent_hash=10)
    ids = allocator.allocate_memory_blocks(5).tolist()
    allocator.take_events()
    policy.registered.clear()
    # 11 new under the root block; 12 held by `holder`; 13, 14 new under it; 14 again.
    held = allocator.register_kv_block_hashes(
        ids, [11, 12, 13, 14, 14], parent_hash=10, token_ids=list(range(10))
    )
    assert held.tolist() == [True, False, True, True, False]
    assert policy.registered == [([11], 1), ([13, 14], 2)]
    events = allocator.take_events()
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in events] == [
        ((wire_hash(11),), wire_hash(10), (0, 1)),
        ((wire_hash(13), wire_hash(14)), wire_hash(12), (4, 5, 6, 7)),
    ]
    assert int(allocator.registry.parent_of[ids[0]]) == root
    assert int(allocator.registry.parent_of[ids[2]]) == holder
    assert int(allocator.registry.parent_of[ids[3]]) == ids[2]


def test_a_hash_repeated_in_one_call_is_held_by_its_first_block() -> None:
    policy = RegistrationLog()
    allocator = KVBlockAllocator(
        total_count=8, block_size_tokens=2, device="cpu", eviction_policy=policy
    )
    (root,) = _chain(allocator, [10])
    refused, first, second, third = allocator.allocate_memory_blocks(4).tolist()
    policy.registered.clear()
    held = allocator.register_kv_block_hashes([refused, first, second, third], [10, 11, 11, 12])
    assert held.tolist() == [False, True, False, True]
    assert policy.registered == [([11], 1), ([12], 2)]
    assert int(allocator.registry.parent_of[first]) == root
    assert int(allocator.registry.parent_of[third]) == first
    allocator.check_invariants()


def test_a_hash_repeated_in_a_fresh_chain_is_held_by_its_first_block() -> None:
    allocator = _make(LRUPolicy())
    first, second, third = allocator.allocate_memory_blocks(3).tolist()
    held = allocator.register_kv_block_hashes([first, second, third], [11, 11, 12])
    assert held.tolist() == [True, False, True]
    allocator.check_invariants()


def test_the_snapshot_lists_parents_before_children_whatever_their_hashes() -> None:
    allocator = _events_allocator()
    _chain(allocator, [50, 10, 30])
    snapshot = allocator.snapshot()
    assert [event.block_hashes for event in snapshot] == [
        (wire_hash(50),),
        (wire_hash(10),),
        (wire_hash(30),),
    ]
    assert [event.parent_block_hash for event in snapshot] == [None, wire_hash(50), wire_hash(10)]


def test_with_prefix_caching_off_registration_returns_false_flags() -> None:
    allocator = KVBlockAllocator(
        total_count=8, block_size_tokens=2, device="cpu", enable_prefix_caching=False
    )
    ids = allocator.allocate_memory_blocks(2)
    held = allocator.register_kv_block_hashes(ids, [1, 2])
    assert held.dtype == torch.bool and held.tolist() == [False, False]


# ---------------------------------------------------------------------- counters


def test_a_fresh_allocator_counts_nothing() -> None:
    stats = _make(LRUPolicy()).stats()
    assert stats.num_dropped_blocks == 0
    assert stats.num_rejected_hits == 0
    assert stats.num_dropped_events == 0


def test_dropped_events_are_counted() -> None:
    allocator = KVBlockAllocator(
        total_count=8, block_size_tokens=2, device="cpu", kv_events_capacity=1
    )
    for block_hash in (11, 21, 31):
        _chain(allocator, [block_hash])
    assert allocator.stats().num_dropped_events == 2


def test_each_allocation_and_hit_ticks_the_clock_once() -> None:
    allocator = _make(LRUPolicy())
    allocator.allocate_memory_blocks(1)
    allocator.allocate_memory_blocks(1)
    assert allocator.clock == 2
    assert allocator.advance_clock(0) == 2
    _chain(allocator, [11])
    allocator.match_prefix([11], acquire=True)
    assert allocator.clock == 4


def test_every_rejected_verified_hit_is_counted() -> None:
    allocator = KVBlockAllocator(
        total_count=8, block_size_tokens=2, device="cpu", verify_prefix_hits=True
    )
    ids = allocator.allocate_memory_blocks(1)
    allocator.register_kv_block_hashes(ids, [11], fingerprints=[5])
    for _ in range(2):
        assert allocator.match_prefix([11], fingerprints=[6]).tolist() == []
    assert allocator.stats().num_rejected_hits == 2


def test_ref_zero_counts_every_dropped_block_and_keeps_other_routing() -> None:
    allocator = KVBlockAllocator(
        total_count=8,
        block_size_tokens=2,
        device="cpu",
        eviction_policy="ref_zero",
        routing_num_layers=1,
        routing_top_k=1,
    )
    kept = allocator.allocate_memory_blocks(1)
    allocator.store_block_routing(int(kept[0]), torch.ones((2, 1, 1), dtype=torch.int64))
    for block_hash in (11, 21):
        allocator.release_memory_blocks(_chain(allocator, [block_hash]))
    assert allocator.stats().num_dropped_blocks == 2
    assert allocator.get_block_routing(int(kept[0])) is not None
    assert allocator.get_evictable_block_count() == 0


@pytest.mark.parametrize("registered", [False, True])
def test_releasing_an_unhashed_block_keeps_the_routing_of_others(registered: bool) -> None:
    allocator = KVBlockAllocator(
        total_count=8, block_size_tokens=2, device="cpu", routing_num_layers=1, routing_top_k=1
    )
    if registered:
        _chain(allocator, [11])
    kept, released = allocator.allocate_memory_blocks(2).tolist()
    for block_id in (kept, released):
        allocator.store_block_routing(block_id, torch.ones((2, 1, 1), dtype=torch.int64))
    allocator.release_memory_blocks([released])
    assert allocator.get_block_routing(kept) is not None


def test_check_invariants_joins_the_first_five_problems() -> None:
    allocator = _make(LRUPolicy())
    allocator._engine.ledger.num_active, allocator._engine.ledger.num_paused, allocator._engine.ledger.num_cached = 3, 2, 4
    allocator._engine.refs.active[2] = -1
    allocator._engine.refs.pending[1] = 1
    problems = find_invariant_problems(allocator._engine)
    assert len(problems) > 5
    with pytest.raises(InvariantError) as info:
        allocator.check_invariants()
    assert str(info.value) == "; ".join(problems[:5])


def test_an_allocation_hands_out_evicted_blocks_last_evicted_first() -> None:
    allocator = _make(LRUPolicy(), total_count=3)
    (older,) = _chain(allocator, [11])
    allocator.advance_clock()
    (newer,) = _chain(allocator, [21])
    allocator.release_memory_blocks([older, newer])
    handed_out = allocator.allocate_memory_blocks(2)
    assert handed_out.dtype == torch.int32 and handed_out.tolist() == [newer, older]


# ---------------------------------------------------------------------- routing


def _routing_allocator() -> KVBlockAllocator:
    return KVBlockAllocator(
        total_count=10,
        paused_count=2,
        block_size_tokens=2,
        device="cpu",
        routing_num_layers=1,
        routing_top_k=1,
    )


def _rows(count: int) -> torch.Tensor:
    return torch.ones((count, 1, 1), dtype=torch.int64)


def test_routing_calls_say_exactly_what_is_wrong() -> None:
    allocator = _routing_allocator()
    (held,) = allocator.allocate_memory_blocks(1).tolist()
    free_id = int(allocator.pool.free_ids()[-1])
    cases: list[tuple[Callable[[], Any], str]] = [
        (
            lambda: allocator.store_routing_per_block(_rows(1), [0.5], [0]),
            "token_block_ids must contain only ints",
        ),
        (
            lambda: allocator.store_routing_per_block(_rows(1), [held], [0.5]),
            "token_positions must contain only ints",
        ),
        (
            lambda: allocator.store_routing_per_block(_rows(2), [held], [0]),
            "lengths differ: 2 routing rows, 1 block IDs, 1 positions",
        ),
        (
            lambda: allocator.store_routing_per_block(_rows(1), [99], [0]),
            r"token_block_ids holds block 99, outside \[0, 9\)",
        ),
        (
            lambda: allocator.store_routing_per_block(_rows(1), [held], [5]),
            r"token_positions must lie in \[0, 2\), got \[5, 5\]",
        ),
        (
            lambda: allocator.store_routing_per_block(_rows(1), [free_id], [0]),
            rf"store_routing_per_block: block {free_id} \(free\) is not referenced",
        ),
        (
            lambda: allocator.store_block_routing(99, _rows(1)),
            r"block_id holds block 99, outside \[0, 9\)",
        ),
        (
            lambda: allocator.store_block_routing(held, _rows(3)),
            "routing has 3 rows; a block holds 2 tokens",
        ),
        (
            lambda: allocator.store_block_routing(free_id, _rows(1)),
            rf"store_block_routing: block {free_id} \(free\) is not referenced",
        ),
        (
            lambda: allocator.store_block_routing(held, [[[1]]]),
            "routing must be a tensor or an array, got list",
        ),
        (
            lambda: allocator.store_block_routing(held, torch.ones((1, 1, 1), device="meta")),
            r"routing must be on the CPU \(copy it off the device first\), got meta",
        ),
        (lambda: allocator.get_block_routing(99), r"block_id holds block 99, outside \[0, 9\)"),
        (
            lambda: allocator.reconstruct_routing_from_blocks([held], "2"),
            "total_tokens must be an int, got '2'",
        ),
        (
            lambda: allocator.reconstruct_routing_from_blocks([held], 3),
            r"total_tokens 3 outside \[0, 2\] for 1 blocks",
        ),
        (
            lambda: allocator.match_prefix(torch.tensor([1.5])),
            "block_hashes must have an integer dtype, got torch.float32",
        ),
    ]
    for call, message in cases:
        with pytest.raises(Exception, match=f"^{message}$"):
            call()
    unrouted = _make(LRUPolicy())
    with pytest.raises(
        Exception,
        match=r"^MoE routing is not configured \(set routing_num_layers and routing_top_k\)$",
    ):
        unrouted.get_block_routing(0)


def test_routing_of_a_block_held_active_and_paused_is_stored_and_read_back() -> None:
    allocator = _routing_allocator()
    _, block = allocator.allocate_memory_blocks(2).tolist()  # not block 0
    allocator.acquire_blocks([block])
    allocator.pause([block])
    allocator.store_routing_per_block(torch.tensor([[[3]], [[4]]]), [block, block], [0, 1])
    routing = allocator.reconstruct_routing_from_blocks([block], 2)
    assert routing is not None and routing.flatten().tolist() == [3, 4]


# ---------------------------------------------------------------------- retention


def test_retention_durations_may_be_zero_and_are_checked() -> None:
    allocator = KVBlockAllocator(
        total_count=8, block_size_tokens=2, device="cpu", eviction_policy="priority"
    )
    allocator.set_retention_priority([11], 5, duration=0)
    with pytest.raises(Exception, match=r"^duration must be an int >= 0 or None, got -1$"):
        allocator.set_retention_priority([11], 5, duration=-1)
    with pytest.raises(
        Exception,
        match=r"^block_hashes must be a sequence of ints or a 1-D integer tensor, got str$",
    ):
        allocator.set_retention_priority("ab", 5)


def test_a_pin_holds_until_its_duration_has_passed() -> None:
    allocator = KVBlockAllocator(
        total_count=8, block_size_tokens=2, device="cpu", eviction_policy="priority"
    )
    (pinned,) = _chain(allocator, [11])
    allocator.advance_clock()
    (other,) = _chain(allocator, [21])
    allocator.release_memory_blocks([pinned, other])
    allocator.set_retention_priority([11], 90, duration=10)
    allocator.update_timestamps([other])  # lets the policy see the clock, well before expiry
    assert allocator.evict_cached_blocks(1) == 1
    assert allocator.is_hash_registered(11) and not allocator.is_hash_registered(21)


def test_counts_and_policy_arguments_are_integers() -> None:
    policy = FlakyLRU()
    allocator = _make(policy)
    (block,) = _chain(allocator, [11])
    active, paused = allocator.reference_counts([block])
    assert active.dtype == torch.int32 and paused.dtype == torch.int32
    allocator.release_memory_blocks([block])
    assert [type(arg) for arg in policy.insert_args[0]] == [int] * 5


def test_the_general_path_appends_to_the_last_run_and_keeps_the_lora_name() -> None:
    policy = RegistrationLog()
    allocator = KVBlockAllocator(
        total_count=12,
        block_size_tokens=2,
        device="cpu",
        kv_events_capacity=100,
        eviction_policy=policy,
    )
    _chain(allocator, [21])
    _chain(allocator, [22])
    ids = allocator.allocate_memory_blocks(6).tolist()
    allocator.take_events()
    policy.registered.clear()
    held = allocator.register_kv_block_hashes(ids, [31, 21, 33, 22, 35, 36], lora_name="a")
    assert held.tolist() == [True, False, True, False, True, True]
    assert policy.registered == [([31], 0), ([33], 1), ([35, 36], 1)]
    events = allocator.take_events()
    assert [event.block_hashes for event in events] == [
        (wire_hash(31),),
        (wire_hash(33),),
        (wire_hash(35), wire_hash(36)),
    ]
    assert [event.lora_name for event in events] == ["a"] * 3
