"""A device copy that raises inside the pool leaves the allocator exactly as it was.

The fault-injection harness raises at the entry of each pool method. A real
device mirror can also fail half-way through one: after the host stack is
written, in the copy to the device. The pool then keeps ``num_free`` and the
host stack as before, so the allocator's rollback of its policy calls is
enough. A stand-in mirror whose ``copy_`` raises plays the failing device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from prefixcache import KVBlockAllocator
from prefixcache.engine.pool import BlockPool

Digest = Callable[[KVBlockAllocator], Any]


class DeviceLost(RuntimeError):
    """What the failing mirror raises, as a CUDA error would."""


class FailingMirror:
    """Stands in for the device tensor: every slice copy raises."""

    def __getitem__(self, index: slice) -> FailingMirror:
        return self

    def copy_(self, source: Any, non_blocking: bool = False) -> None:
        raise DeviceLost("device copy failed")


def _allocator_with_cached_and_held_blocks() -> tuple[KVBlockAllocator, list[int]]:
    """Three cached blocks, and four held ones (two of them registered)."""
    allocator = KVBlockAllocator(total_count=16, block_size_tokens=2, device="cpu")
    cached = allocator.allocate_memory_blocks(3)
    assert cached is not None
    allocator.register_kv_block_hashes(cached, [11, 12, 13])
    allocator.release_memory_blocks(cached)
    held = allocator.allocate_memory_blocks(4)
    assert held is not None
    allocator.register_kv_block_hashes(held[:2], [21, 22])
    return allocator, held.tolist()


def test_a_failed_device_copy_in_release_changes_nothing(digest: Digest) -> None:
    allocator, held = _allocator_with_cached_and_held_blocks()
    before = digest(allocator)
    allocator.pool._mirror = FailingMirror()  # type: ignore[assignment]
    with pytest.raises(DeviceLost):
        allocator.release_memory_blocks(held)
    assert digest(allocator) == before
    allocator.pool._mirror = None
    allocator.release_memory_blocks(held)  # the same call succeeds once the device is back
    allocator.check_invariants()


def test_a_failed_device_copy_in_reset_changes_nothing(digest: Digest) -> None:
    allocator, _ = _allocator_with_cached_and_held_blocks()
    before = digest(allocator)
    allocator.pool._mirror = FailingMirror()  # type: ignore[assignment]
    with pytest.raises(DeviceLost):
        allocator.reset()
    assert digest(allocator) == before
    allocator.check_invariants()


def test_the_pool_keeps_its_free_stack_when_a_push_or_reset_copy_fails() -> None:
    pool = BlockPool(9, device="cpu")
    taken = pool.acquire(5)
    free_before = pool.free_ids()
    pool._mirror = FailingMirror()  # type: ignore[assignment]
    with pytest.raises(DeviceLost):
        pool.release(taken[:2])
    with pytest.raises(DeviceLost):
        pool.reset()
    assert pool.num_free == len(free_before)
    np.testing.assert_array_equal(pool.free_ids(), free_before)
