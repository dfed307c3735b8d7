"""Host bookkeeping versus device mirrors, and BlockPool on its own.

An allocator built with ``device="meta"`` keeps its device mirror on the meta
device, whose tensors hold no values: any read of a device-side value raises.
A full workout passing on it proves the hot paths never read device memory
(DESIGN.md "Device and host").
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixcache import (
    BlockPool,
    CapacityError,
    ConfigError,
    InvalidTensorError,
    KVBlockAllocator,
)
from prefixcache.engine.native_engine import native_available


@pytest.fixture(
    params=[(policy, engine) for policy in ("lru", "ref_zero") for engine in ("python", "native")],
    ids=lambda param: "-".join(param),
)
def meta_allocator(request: pytest.FixtureRequest) -> KVBlockAllocator:
    policy, engine = request.param
    if engine == "native" and not native_available():
        pytest.skip("the native engine is not built")
    return KVBlockAllocator(
        engine=engine,
        total_count=16,
        paused_count=4,
        block_size_tokens=4,
        eviction_policy=policy,
        device="meta",
        routing_num_layers=2,
        routing_top_k=2,
    )


def test_meta_allocator_runs_every_operation(meta_allocator: KVBlockAllocator) -> None:
    allocator = meta_allocator
    mirror = allocator.device_free_ids()
    assert mirror is not None and mirror.device.type == "meta"
    assert mirror.dtype == torch.int32 and mirror.shape == (15,)

    tokens = list(range(12))
    chain = allocator.hash_tokens(tokens)
    blocks = allocator.allocate_memory_blocks(3)
    assert blocks.device.type == "cpu", "IDs come back on the host"
    assert allocator.register_kv_block_hashes(blocks, chain).tolist() == [True] * 3
    allocator.store_routing_per_block(
        torch.zeros(12, 2, 2, dtype=torch.int16),
        blocks.repeat_interleave(4),
        torch.arange(4).repeat(3),
    )
    allocator.update_timestamps(blocks)
    allocator.check_invariants()

    other = allocator.allocate_memory_blocks(2)
    allocator.pause(other)
    allocator.resume(other[:1])
    allocator.release_memory_blocks(other[1:], paused=True)
    allocator.check_invariants()

    with allocator.free_group():
        allocator.release_memory_blocks(blocks)
        allocator.release_memory_blocks(other[:1])
    allocator.check_invariants()

    matched = allocator.match_prefix(chain, acquire=True)
    if allocator.policy.retains_unreferenced:
        assert matched.tolist() == blocks.tolist()
        assert allocator.reconstruct_routing_from_blocks(matched, 12) is not None
        allocator.release_memory_blocks(matched)
        assert allocator.evict_cached_blocks(1) == 1
        assert allocator.evict_lru_blocks(1) is True
    else:
        assert matched.numel() == 0
    allocator.check_invariants()

    assert allocator.allocate_memory_blocks(allocator.num_usable) is not None
    allocator.check_invariants()
    allocator.reset()
    allocator.check_invariants()
    assert allocator.device_free_ids() is mirror, "one tensor, one address, every refresh"
    assert "total 0/15" in str(allocator)


def test_meta_mirror_values_are_unreadable() -> None:
    """The premise of the test above: reading a meta tensor's values fails."""
    pool = BlockPool(4, "meta")
    with pytest.raises((NotImplementedError, RuntimeError)):
        pool.device_free_ids.tolist()


def test_block_ids_on_a_device_are_refused_not_copied_back() -> None:
    allocator = KVBlockAllocator(total_count=8, device="meta")
    with pytest.raises(InvalidTensorError, match="meta"):
        allocator.release_memory_blocks(torch.zeros(1, dtype=torch.int32, device="meta"))


def test_cpu_pool_has_no_mirror() -> None:
    assert BlockPool(4, "cpu").device_free_ids is None


def test_default_device_is_cuda_when_available_else_cpu() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert BlockPool(4).device.type == expected
    assert KVBlockAllocator(total_count=4).device.type == expected


# ---------------------------------------------------------------- BlockPool


def test_pool_layout_and_dummy_block() -> None:
    pool = BlockPool(8, "cpu")
    assert pool.total_count == 8
    assert pool.num_usable == 7
    assert pool.dummy_block_id == 7
    assert pool.num_free == 7
    assert sorted(pool.free_ids().tolist()) == list(range(7))
    assert pool.dummy_block_id not in pool.acquire(7).tolist()


def test_pool_acquire_pops_from_the_top_lowest_id_first() -> None:
    pool = BlockPool(8, "cpu")
    first = pool.acquire(3)
    assert first.dtype == np.int32
    assert first.tolist() == [0, 1, 2]
    assert pool.num_free == 4
    assert pool.acquire(0).tolist() == []


def test_pool_is_lifo() -> None:
    pool = BlockPool(8, "cpu")
    pool.acquire(7)
    pool.release(np.array([5, 3], dtype=np.int32))
    pool.release(np.array([6], dtype=np.int32))
    assert pool.free_ids().tolist() == [5, 3, 6]
    assert pool.acquire(1).tolist() == [6]
    assert pool.acquire(2).tolist() == [3, 5]
    assert pool.num_free == 0


def test_pool_returns_copies_not_views() -> None:
    pool = BlockPool(8, "cpu")
    taken = pool.acquire(3)
    assert not np.shares_memory(taken, pool._stack)
    taken[:] = 99
    assert 99 not in pool.free_ids().tolist()
    kept = taken.copy()
    pool.release(np.array([2, 1, 0], dtype=np.int32))  # rewrites the slots taken came from
    pool.acquire(2)
    assert np.array_equal(taken, kept)
    snapshot = pool.free_ids()
    snapshot[:] = -1
    assert -1 not in pool.free_ids().tolist()


def test_pool_capacity_error_changes_nothing() -> None:
    pool = BlockPool(4, "cpu")
    pool.acquire(2)
    before = pool.free_ids().tolist()
    with pytest.raises(CapacityError, match="3"):
        pool.acquire(3)
    assert pool.num_free == 1
    assert pool.free_ids().tolist() == before


def test_pool_reset_restores_the_initial_stack() -> None:
    pool = BlockPool(6, "cpu")
    initial = pool.free_ids().tolist()
    pool.acquire(4)
    pool.release(np.array([2], dtype=np.int32))
    pool.reset()
    assert pool.free_ids().tolist() == initial
    assert pool.num_free == 5
    assert pool.acquire(2).tolist() == [0, 1]


def test_pool_with_a_meta_mirror_works_without_reading_it() -> None:
    pool = BlockPool(6, "meta")
    taken = pool.acquire(3)
    pool.release(taken[::-1].copy())
    pool.reset()
    assert pool.device_free_ids.device.type == "meta"
    assert pool.num_free == 5


@pytest.mark.parametrize("total_count", [1, 0, -3, 2.0, True, None])
def test_pool_refuses_fewer_than_two_blocks(total_count: object) -> None:
    with pytest.raises(ConfigError):
        BlockPool(total_count, "cpu")  # type: ignore[arg-type]


def test_pool_refuses_an_unknown_device() -> None:
    with pytest.raises(ConfigError):
        BlockPool(4, "no_such_device")


def test_smallest_pool_has_one_usable_block() -> None:
    allocator = KVBlockAllocator(total_count=2, device="cpu")
    assert allocator.dummy_block_id == 1
    assert allocator.allocate_memory_blocks(1).tolist() == [0]
    assert allocator.allocate_memory_blocks(1) is None
    allocator.check_invariants()
