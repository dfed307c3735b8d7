"""Reference counts and the paused/active partitions at their edges.

Batches past the small-batch size and releases across calls and free groups
count every occurrence; a block held both active and paused; the paused
budget bounds every block holding a paused reference, and a pause that adds
no such block passes a full budget; a resume that activates no block passes an
over-full active partition; resume may fill the active budget exactly; counts
may be numpy integers, and counts and policy arguments come back as integers.

``tests/MUTATION.md`` lists the mutants these tests kill and the survivors that are equivalent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from prefixcache.policies import LRUPolicy

from prefixcache import BudgetExceededError, KVBlockAllocator, PrefixCacheError

Make = Callable[..., KVBlockAllocator]
Chain = Callable[..., list[int]]
Flaky = Callable[..., tuple[Any, KVBlockAllocator]]


# ---------------------------------------------------------------------- planner paths


def test_counts_in_numpy_integers_are_accepted(make_small: Make) -> None:
    allocator = make_small(LRUPolicy())
    ids = allocator.allocate_memory_blocks(np.int64(2))
    assert ids is not None and len(ids) == 2
    assert allocator.is_memory_available(np.int32(7)) and not allocator.is_memory_available(10)


# ---------------------------------------------------------------------- large batches


def test_batches_past_the_small_batch_size_count_each_occurrence(make_small: Make) -> None:
    allocator = make_small(LRUPolicy(), total_count=700)
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


def test_releases_count_every_reference_across_calls(make_small: Make) -> None:
    allocator = make_small(LRUPolicy())
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


def test_a_group_applies_every_queued_reference(make_small: Make) -> None:
    allocator = make_small(LRUPolicy())
    (block,) = allocator.allocate_memory_blocks(1).tolist()
    allocator.acquire_blocks([block])
    with allocator.free_group():
        allocator.release_memory_blocks([block, block])
    assert allocator.get_total_used() == 0
    assert allocator.reference_counts([block])[0].tolist() == [0]


# ---------------------------------------------------------------------- partitions


def test_a_paused_release_of_a_block_still_active_keeps_it_active(make_small: Make) -> None:
    allocator = make_small(paused_count=3)
    (block,) = allocator.allocate_memory_blocks(1).tolist()
    allocator.acquire_blocks([block])
    allocator.pause([block])  # one active, one paused reference
    allocator.release_memory_blocks([block], paused=True)
    active, paused = allocator.reference_counts([block])
    assert (active.tolist(), paused.tolist()) == ([1], [0])
    assert (allocator.get_active_used(), allocator.get_paused_used()) == (1, 0)
    assert block not in allocator.pool.free_ids().tolist()
    allocator.check_invariants()


def test_acquiring_a_paused_block_with_a_cached_leaf_moves_each_to_its_state(
    make_small: Make, chain: Chain
) -> None:
    allocator = make_small(paused_count=3)
    (held,) = chain(allocator, [11])
    (cached,) = chain(allocator, [21])
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


def test_acquiring_an_active_block_with_a_cached_one_discards_only_the_cached(
    make_small: Make, chain: Chain
) -> None:
    allocator = make_small(LRUPolicy())
    (active,) = chain(allocator, [11])
    (cached,) = chain(allocator, [21])
    allocator.release_memory_blocks([cached])
    allocator.acquire_blocks([active, cached])
    assert [t.tolist() for t in allocator.reference_counts([active, cached])] == [[2, 1], [0, 0]]
    assert allocator.get_active_used() == 2 and len(allocator.policy) == 0
    allocator.check_invariants()


def test_a_block_held_active_and_paused_can_be_registered_acquired_and_touched(
    make_small: Make,
) -> None:
    allocator = make_small(paused_count=3)
    first, second = allocator.allocate_memory_blocks(2).tolist()
    allocator.acquire_blocks([first, second])
    allocator.pause([first, second])  # each: one active, one paused reference
    allocator.update_timestamps([first])
    allocator.acquire_blocks([first])
    assert allocator.register_kv_block_hashes([second], [11]).tolist() == [True]
    assert [t.tolist() for t in allocator.reference_counts([first, second])] == [[2, 1], [1, 1]]


def test_the_policy_hears_the_hand_outs_and_depth_of_a_released_leaf(
    chain: Chain, flaky: Flaky
) -> None:
    policy, allocator = flaky()
    root, leaf = chain(allocator, [11, 12])
    allocator.match_prefix([11, 12], acquire=True)
    allocator.match_prefix([11, 12], acquire=True)
    allocator.release_memory_blocks([root, leaf] * 3)
    ((block_id, block_hash, last_access, num_accesses, depth),) = policy.insert_args
    assert (block_id, block_hash, num_accesses, depth) == (leaf, 12, 3, 1)
    assert type(last_access) is int and last_access == allocator.clock
    chain(allocator, [21])
    refused, taken = allocator.allocate_memory_blocks(2).tolist()
    # 21 is held by another block: the general path registers 22 under that holder.
    assert allocator.register_kv_block_hashes([refused, taken], [21, 22]).tolist() == [False, True]
    allocator.release_memory_blocks([refused, taken])
    assert policy.insert_args[-1][0] == taken
    assert policy.insert_args[-1][3:] == (1, 1)  # one hand-out since registration; depth 1


def test_move_references_refuses_with_the_partition_named(make_small: Make) -> None:
    allocator = make_small(paused_count=3)
    (block,) = allocator.allocate_memory_blocks(1).tolist()
    with pytest.raises(Exception, match=rf"^block {block} \(active\) holds 0 paused reference"):
        allocator.resume([block])
    allocator.pause([block])
    with pytest.raises(Exception, match=rf"^block {block} \(paused\) holds 0 active reference"):
        allocator.pause([block])


def test_pausing_a_block_active_twice_keeps_it_counted_active(make_small: Make) -> None:
    allocator = make_small(paused_count=3)
    (block,) = allocator.allocate_memory_blocks(1).tolist()
    allocator.acquire_blocks([block, block])
    allocator.pause([block])
    allocator.pause([block])  # (2 active, 1 paused) -> (1, 2): still active
    assert (allocator.get_active_used(), allocator.get_paused_used()) == (1, 0)
    allocator.check_invariants()


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_pause_that_adds_no_paused_holder_passes_a_full_paused_budget(
    engine: str, refuses: Callable[..., PrefixCacheError]
) -> None:
    """The paused budget bounds the blocks holding any paused reference (issue 15, item 3).

    Before, the budget counted paused-only blocks: pausing a block that a
    running request also held passed as "still active", and when that
    request finished the block became paused-only over the budget. Now such a
    pause takes budget; one that gives no block its *first* paused reference
    still passes a full budget, since it adds no block the budget must cover.
    """
    allocator = KVBlockAllocator(
        total_count=8, paused_count=1, block_size_tokens=2, device="cpu", engine=engine
    )
    first, second = allocator.allocate_memory_blocks(2).tolist()
    allocator.acquire_blocks([first, first, second])  # three running holders of first
    allocator.pause([first])  # first still runs, but holds a paused reference: budget full
    assert (allocator.get_paused_used(), allocator.get_paused_avail()) == (0, 0)
    allocator.pause([first])  # no new holder: passes the full budget
    error = refuses(allocator, BudgetExceededError, allocator.pause, [second])
    assert "1 more block(s)" in str(error) and "paused budget is 1" in str(error)
    refuses(allocator, BudgetExceededError, allocator.pause, [first, second])  # one new: refused
    allocator.release_memory_blocks([first])  # the running holder finishes: paused only
    assert (allocator.get_paused_used(), allocator.get_paused_avail()) == (1, 0)
    allocator.release_memory_blocks([first, first], paused=True)  # both paused references
    allocator.pause([second])  # the budget has room again
    assert allocator.get_paused_avail() == 0
    allocator.check_invariants()


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


# ---------------------------------------------------------------------- retention


def test_counts_and_policy_arguments_are_integers(chain: Chain, flaky: Flaky) -> None:
    policy, allocator = flaky()
    (block,) = chain(allocator, [11])
    active, paused = allocator.reference_counts([block])
    assert active.dtype == torch.int32 and paused.dtype == torch.int32
    allocator.release_memory_blocks([block])
    assert [type(arg) for arg in policy.insert_args[0]] == [int] * 5
