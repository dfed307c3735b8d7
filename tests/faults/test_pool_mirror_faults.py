"""A device copy that raises leaves the allocator, or a standalone pool, exactly as it was.

The fault-injection harness raises at the entry of each pool method. A real
device copy can also fail: in the allocator's mirror of the free IDs, which
only reads the engine, and in a standalone :class:`BlockPool`'s own mirror,
after the host stack is written. The pool then keeps ``num_free`` and the host
stack as before. A stand-in mirror whose ``copy_`` raises plays the failing
device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from prefixcache import KVBlockAllocator
from prefixcache.engine.native_engine import native_available
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


def _allocator_with_cached_and_held_blocks(engine: str) -> tuple[KVBlockAllocator, list[int]]:
    """Three cached blocks, and four held ones (two of them registered)."""
    allocator = KVBlockAllocator(total_count=16, block_size_tokens=2, device="cpu", engine=engine)
    cached = allocator.allocate_memory_blocks(3)
    assert cached is not None
    allocator.register_kv_block_hashes(cached, [11, 12, 13])
    allocator.release_memory_blocks(cached)
    held = allocator.allocate_memory_blocks(4)
    assert held is not None
    allocator.register_kv_block_hashes(held[:2], [21, 22])
    return allocator, held.tolist()


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_failed_device_copy_of_the_free_ids_changes_nothing(digest: Digest, engine: str) -> None:
    """The allocator's mirror (``device_free_ids``) only reads the engine: a failed copy
    leaves the allocator as it was, and the next refresh succeeds."""
    if engine == "native" and not native_available():
        pytest.skip("the native engine is not built")
    allocator, held = _allocator_with_cached_and_held_blocks(engine)
    allocator._free_ids_mirror.tensor = FailingMirror()  # type: ignore[assignment]
    before = digest(allocator)
    with pytest.raises(DeviceLost):
        allocator.device_free_ids()
    assert digest(allocator) == before
    allocator._free_ids_mirror.tensor = torch.full((15,), -1, dtype=torch.int32)
    allocator.release_memory_blocks(held)
    mirror = allocator.device_free_ids()
    assert mirror is not None
    free = allocator.stats().num_free
    assert mirror[:free].tolist() == allocator._engine.free_ids().tolist()
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
