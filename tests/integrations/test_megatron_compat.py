"""Compat mode of the Megatron drop-in, without megatron-core.

The expected block IDs, stacks and counters are worked out from
megatron-core 0.19.2's ``contexts/kv_block_allocator.py`` (its ``block_bag``
stack: an allocation of ``n`` takes ``block_bag[total_avail - n:total_avail]``,
a release writes the freed IDs at ``block_bag[total_avail:]``).
``test_megatron_compat_differential.py`` checks the same against the real
class in the integration stage.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from prefixcache.errors import (
    BlockStateError,
    InvalidArgumentError,
    InvariantError,
    ReferenceCountError,
)
from prefixcache.integrations.megatron import (
    MegatronCompatAllocator,
    MegatronKVBlockAllocator,
    PrefixCachePolicy,
)
from prefixcache.integrations.megatron.compat_policy import MegatronOrderPolicy


class Context:
    prefix_cache_lru_clock = 0
    block_size_tokens = 4


def build(policy: str = "lru", caching: bool = True, total: int = 9) -> MegatronCompatAllocator:
    return MegatronCompatAllocator(Context(), total, 2, caching, policy)


def ids(tensor: torch.Tensor | None) -> list[int]:
    assert tensor is not None
    return tensor.tolist()


@pytest.mark.parametrize(
    ("policy", "caching"), [("ref_zero", False), ("ref_zero", True), ("lru", True)]
)
def test_ids_come_off_megatrons_stack(policy: str, caching: bool) -> None:
    allocator = build(policy, caching)
    assert ids(allocator.allocate_memory_blocks(3)) == [5, 6, 7]  # the top of arange(9) below 8
    assert ids(allocator.allocate_memory_blocks(2)) == [3, 4]
    allocator.release_memory_blocks(torch.tensor([6, 3, 7], dtype=torch.int32))
    pushed = [6, 3, 7] if not caching else [3, 6, 7]  # as given; sorted once counted down
    assert allocator.block_bag[3:6].tolist() == pushed
    assert allocator.total_avail == 6
    assert ids(allocator.allocate_memory_blocks(2)) == pushed[1:]
    allocator.check_consistency()


def test_an_allocation_is_a_view_of_the_stack() -> None:
    allocator = build("ref_zero", caching=False)
    block_ids = allocator.allocate_memory_blocks(2)
    assert block_ids is not None and block_ids.data_ptr() == allocator.block_bag[6:].data_ptr()


def test_lru_eviction_follows_megatrons_timestamps_then_ids() -> None:
    """The docstring's worked example: A->B->{C(5), F(3)}, A->D(3)->E(5); evict 3: F, C, B."""
    allocator = build("lru", total=12)
    context = allocator.context
    blocks = ids(allocator.allocate_memory_blocks(6))  # [5 .. 10]
    a, b, c, d, e, f = blocks
    allocator.register_kv_block_hashes([a, b, c], [1, 2, 3], [0, 1, 2])
    allocator.register_kv_block_hashes([f], [6], [2])
    allocator.register_kv_block_hashes([d, e], [4, 5], [1, 4])
    for stamp, block in [(1, a), (2, b), (5, c), (3, f), (3, d), (5, e)]:
        context.prefix_cache_lru_clock = stamp
        allocator.update_timestamps(torch.tensor([block]))
    allocator.release_memory_blocks(torch.tensor(blocks, dtype=torch.int32))
    deregistered: list[list[int]] = []
    allocator.on_blocks_deregistered = lambda block_ids, hashes: deregistered.append(block_ids)
    assert allocator.evict_lru_blocks(3)
    assert deregistered == [[f, c, b]]
    assert allocator.block_bag[allocator.total_avail - 3 : allocator.total_avail].tolist() == [
        f,
        c,
        b,
    ]
    allocator.check_consistency()


def test_total_avail_is_writable_as_megatrons_attribute() -> None:
    allocator = build("ref_zero", caching=False)
    allocator.total_avail = 2  # hides IDs 2 .. 7: not handed out
    assert allocator.get_total_used() == 6 and allocator.allocate_memory_blocks(3) is None
    assert ids(allocator.allocate_memory_blocks(2)) == [0, 1]
    with pytest.raises(InvalidArgumentError):
        allocator.total_avail = 8  # would expose 0 and 1, in use
    with pytest.raises(InvalidArgumentError):
        allocator.total_avail = 9  # past the dummy
    allocator.release_memory_blocks(torch.tensor([0, 1], dtype=torch.int32))
    allocator.total_avail = 8
    assert ids(allocator.allocate_memory_blocks(8)) == [0, 1, 2, 3, 4, 5, 6, 7]
    allocator.check_consistency()


def test_raising_total_avail_over_a_used_id_is_refused() -> None:
    allocator = build("lru")
    allocator.allocate_memory_blocks(3)  # 5, 6, 7 in use; the stack's top still holds them
    with pytest.raises(InvalidArgumentError):
        allocator.total_avail = 8
    assert allocator.total_avail == 5


def test_a_free_block_registered_in_lru_mode_is_cached_and_stays_on_the_stack() -> None:
    allocator = build("lru")
    allocator.register_kv_block_hashes([7], [77])
    assert allocator.kv_hash_to_block_id == {77: 7} and allocator.block_ref_counts[7] == 0
    assert int(allocator.get_evictable_block_count()) == 1 and allocator.total_avail == 8
    assert ids(allocator.allocate_memory_blocks(1)) == [7]  # handed out with its hash, as Megatron
    assert allocator.block_hashes[7] == 77 and allocator.block_ref_counts[7] == 1
    allocator.check_consistency()


def test_evicting_a_block_registered_while_free_does_not_push_it_twice() -> None:
    allocator = build("lru")
    allocator.register_kv_block_hashes([7], [77])
    assert allocator.evict_lru_blocks(1)  # Megatron pushes 7 again: it would go out twice
    assert allocator.total_avail == 8 and allocator.kv_hash_to_block_id == {}
    assert sorted(ids(allocator.allocate_memory_blocks(8))) == list(range(8))
    allocator.check_consistency()


def test_ref_zero_mode_refuses_registration_on_a_free_block() -> None:
    allocator = build("ref_zero")
    with pytest.raises(BlockStateError):
        allocator.register_kv_block_hashes([3], [33])
    assert allocator.kv_hash_to_block_id == {}


@pytest.mark.parametrize("caching", [False, True])
def test_a_release_that_corrupts_megatrons_stack_raises_and_changes_nothing(caching: bool) -> None:
    allocator = build("ref_zero", caching)
    allocator.allocate_memory_blocks(2)
    before = (allocator.block_bag.clone(), allocator.total_avail)
    with pytest.raises(BlockStateError):  # a free block
        allocator.release_memory_blocks(torch.tensor([0]))
    with pytest.raises(ReferenceCountError):  # twice in one call
        allocator.release_memory_blocks(torch.tensor([6, 6]))
    assert torch.equal(allocator.block_bag, before[0]) and allocator.total_avail == before[1]
    allocator.check_consistency()


def test_ref_zero_release_calls_the_callback_for_every_freed_block() -> None:
    """Megatron's ``_deregister_blocks`` runs for every block at zero, hashed or not."""
    allocator = build("ref_zero")
    calls: list[Any] = []
    allocator.on_blocks_deregistered = lambda block_ids, hashes: calls.append((block_ids, hashes))
    allocator.allocate_memory_blocks(2)
    allocator.register_kv_block_hashes([7], [70])
    allocator.release_memory_blocks(torch.tensor([7, 6], dtype=torch.int32))
    assert calls == [([6, 7], {70})]


def test_reset_restores_the_stack() -> None:
    allocator = build("lru")
    allocator.allocate_memory_blocks(4)
    allocator.total_avail = 1
    allocator.reset()
    assert allocator.block_bag.tolist() == list(range(9)) and allocator.total_avail == 8
    allocator.check_consistency()


def test_a_chosen_policy_keeps_the_stack_order_and_runs_instead_of_megatrons() -> None:
    allocator = MegatronCompatAllocator(Context(), 9, 2, True, PrefixCachePolicy("s3fifo"))
    assert ids(allocator.allocate_memory_blocks(2)) == [5, 6, 7][1:]
    assert type(allocator.allocator.policy).__name__ == "S3FIFOPolicy"
    assert type(build().allocator.policy).__name__ == "MegatronOrderPolicy"


def test_the_strict_class_is_unchanged() -> None:
    strict = MegatronKVBlockAllocator(Context(), 9, 2, True, "lru")
    with pytest.raises(AttributeError):
        strict.total_avail = 3  # type: ignore[misc]
    with pytest.raises(BlockStateError):
        strict.register_kv_block_hashes([3], [33])


def test_a_pin_on_a_free_block_raises_and_changes_nothing() -> None:
    allocator = build("lru")
    with pytest.raises(BlockStateError):
        allocator.block_ref_counts[torch.tensor([2])] += 1
    assert allocator.block_ref_counts[2] == 0 and allocator.total_avail == 8


def test_a_pin_and_its_rollback_on_a_cached_chain() -> None:
    allocator = build("lru")
    blocks = allocator.allocate_memory_blocks(2)
    assert blocks is not None
    allocator.register_kv_block_hashes(blocks.tolist(), [1, 2], [0, 1])
    allocator.release_memory_blocks(blocks.clone())
    chain = torch.tensor([6, 7])
    allocator.block_ref_counts[chain] += 1  # the context pins a match
    assert int(allocator.get_evictable_block_count()) == 0 and not allocator.evict_lru_blocks(1)
    allocator.block_ref_counts[chain] -= 1  # and rolls it back
    assert int(allocator.get_evictable_block_count()) == 2 and allocator.total_avail == 6
    allocator.check_consistency()


def test_megatrons_availability_test_and_counts() -> None:
    allocator = build("lru")
    blocks = allocator.allocate_memory_blocks(8)
    assert blocks is not None and allocator.get_total_used() == 8
    assert not allocator.is_memory_available(1)
    allocator.register_kv_block_hashes(blocks[:2].tolist(), [1, 2], [0, 1])
    allocator.release_memory_blocks(blocks.clone())  # 2 cached, 6 back on the stack
    assert allocator.is_memory_available(8) and not allocator.is_memory_available(8, 1)
    assert not build("ref_zero").is_memory_available(9)
    plain = build("ref_zero", caching=False)
    assert int(plain.get_evictable_block_count()) == 0 and not plain.evict_lru_blocks(1)
    plain.register_kv_block_hashes([0], [1])  # no caching: nothing happens, as Megatron
    plain.update_timestamps(torch.tensor([0]))
    plain.release_memory_blocks(torch.tensor([], dtype=torch.int32))
    assert plain.evict_lru_blocks(0)


def test_touching_a_cached_leaf_moves_it_in_megatrons_order() -> None:
    allocator = build("lru")
    blocks = allocator.allocate_memory_blocks(2)
    assert blocks is not None
    allocator.register_kv_block_hashes(blocks.tolist(), [1, 2])  # two roots, 6 and 7
    allocator.release_memory_blocks(blocks.clone())
    allocator.context.prefix_cache_lru_clock = 5
    allocator.update_timestamps(torch.tensor([6]))  # 6 is now the newer
    assert allocator.evict_lru_blocks(1) and allocator.kv_hash_to_block_id == {1: 6}
    allocator.reset()
    assert allocator.kv_hash_to_block_id == {} and allocator.evict_lru_blocks(0)


@pytest.mark.parametrize(
    "call",
    [
        lambda a: a.register_kv_block_hashes([8], [1]),  # the dummy
        lambda a: a.release_memory_blocks(torch.tensor([-1])),
        lambda a: a.update_timestamps(torch.tensor([9])),
    ],
)
def test_ids_outside_the_pool_raise(call: Any) -> None:
    allocator = build("lru")
    with pytest.raises(InvalidArgumentError):
        call(allocator)
    allocator.check_consistency()


def test_check_consistency_finds_a_broken_stack() -> None:
    allocator = build("lru")
    allocator.allocate_memory_blocks(1)
    allocator.block_bag[0] = 1  # a caller's write: ID 1 twice on the stack
    with pytest.raises(InvariantError, match="repeats"):
        allocator.check_consistency()


def test_a_failed_touch_leaves_the_timestamps() -> None:
    allocator = build("lru")
    blocks = allocator.allocate_memory_blocks(1)
    assert blocks is not None
    allocator.context.prefix_cache_lru_clock = 3

    def refuse(block_ids: Any) -> None:
        raise BlockStateError("refused")

    allocator.allocator.update_timestamps = refuse  # type: ignore[method-assign]
    with pytest.raises(BlockStateError):
        allocator.update_timestamps(torch.tensor([7, 2]))
    assert allocator.block_timestamps[[7, 2]].tolist() == [0, 0]


def test_megatrons_order_policy_undoes_a_transaction() -> None:
    stamps = {10: (3, 1), 11: (3, 0), 12: (1, 5)}  # engine ID -> (timestamp, Megatron ID)
    policy = MegatronOrderPolicy(stamps.__getitem__)
    policy.insert(10, 0, 0, 1, 0)
    policy.insert(11, 0, 0, 1, 0)
    policy.begin()
    policy.insert(12, 0, 0, 1, 0)
    stamps[11] = (9, 0)
    policy.touch(11, 0)
    assert policy.evict(3) == [12, 10, 11]
    policy.abort()
    assert len(policy) == 2 and 12 not in policy
    assert policy.evict(2) == [11, 10]  # the ties by Megatron's ID again, as before the touch
    policy.clear()
    assert len(policy) == 0
