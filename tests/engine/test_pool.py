"""BlockPool on its own: count types, over-release, LIFO order, the device mirror, sizes.

The allocator always hands the pool plain ints and never over-releases, so
the pool's own checks (count types, over-release) and the device mirror,
which only exists off the CPU, are pinned here (found by mutation testing,
``tests/MUTATION.md``). The mirror's bookkeeping does
not depend on the device: a CPU tensor put in its place shows every copy.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from prefixcache.engine.pool import BlockPool, resolve_device
from prefixcache.errors import CapacityError, ConfigError, InvalidArgumentError
from prefixcache.testing import pool_digest


def _with_cpu_mirror(total_count: int) -> BlockPool:
    """A CPU pool whose mirror is a CPU tensor, so the mirror's contents can be read."""
    pool = BlockPool(total_count, "cpu")
    pool._mirror = torch.full((pool.num_usable,), -1, dtype=torch.int32)
    pool.reset()
    return pool


def _assert_mirror_exact(pool: BlockPool) -> None:
    mirror = pool.device_free_ids
    assert mirror is not None
    assert mirror[: pool.num_free].tolist() == pool.free_ids().tolist()


# --------------------------------------------------------------------------
# acquire: count types
# --------------------------------------------------------------------------


@pytest.mark.parametrize("count", [np.int64(2), np.int32(2), np.uint8(2)])
def test_acquire_takes_numpy_counts_and_keeps_num_free_a_python_int(count: object) -> None:
    pool = BlockPool(8, "cpu")
    assert pool.acquire(count).tolist() == [0, 1]  # type: ignore[arg-type]
    assert pool.num_free == 5 and type(pool.num_free) is int


@pytest.mark.parametrize(
    ("count", "type_name"), [(True, "bool"), (False, "bool"), (2.0, "float"), ("2", "str")]
)
def test_acquire_refuses_non_integer_counts_by_type(count: object, type_name: str) -> None:
    pool = BlockPool(8, "cpu")
    before = pool_digest(pool)
    with pytest.raises(InvalidArgumentError, match=f"^num_blocks must be an int, got {type_name}$"):
        pool.acquire(count)  # type: ignore[arg-type]
    assert pool_digest(pool) == before


def test_acquire_refuses_negative_counts_and_too_many() -> None:
    pool = BlockPool(4, "cpu")
    with pytest.raises(InvalidArgumentError, match="num_blocks must be >= 0, got -1"):
        pool.acquire(-1)
    with pytest.raises(CapacityError, match="asked for 4 blocks, 3 free"):
        pool.acquire(4)
    assert pool_digest(pool) == (3, [2, 1, 0])
    assert pool.acquire(0).tolist() == [] and pool.num_free == 3


# --------------------------------------------------------------------------
# release: over-release is refused before anything is pushed
# --------------------------------------------------------------------------


def test_release_refuses_more_ids_than_are_handed_out() -> None:
    pool = BlockPool(6, "cpu")
    held = pool.acquire(2)
    before = pool_digest(pool)
    with pytest.raises(
        InvalidArgumentError, match=r"^releasing 3 blocks, but only 2 are handed out$"
    ):
        pool.release(np.array([*held.tolist(), 4], dtype=np.int32))
    assert pool_digest(pool) == before
    pool.release(held)
    assert pool.num_free == pool.num_usable
    with pytest.raises(InvalidArgumentError, match="only 0 are handed out"):
        pool.release(np.array([0], dtype=np.int32))


def test_release_pushes_lifo_on_top_of_the_free_ids() -> None:
    pool = BlockPool(6, "cpu")
    first = pool.acquire(3)
    pool.release(first[::-1].copy())
    assert pool.free_ids().tolist() == [4, 3, 2, 1, 0]
    assert pool.acquire(2).tolist() == [0, 1]


# --------------------------------------------------------------------------
# The device mirror
# --------------------------------------------------------------------------


def test_mirror_follows_every_push() -> None:
    pool = _with_cpu_mirror(8)
    _assert_mirror_exact(pool)
    held = pool.acquire(4)
    pool.release(held[2:])
    _assert_mirror_exact(pool)
    pool.release(held[:2][::-1].copy())
    _assert_mirror_exact(pool)
    assert pool.num_free == pool.num_usable
    pool.acquire(7)
    pool.reset()
    _assert_mirror_exact(pool)


def test_a_device_pool_has_an_int32_mirror_of_the_whole_stack() -> None:
    pool = BlockPool(9, "meta")
    mirror = pool.device_free_ids
    assert mirror is not None
    assert mirror.device.type == "meta"
    assert mirror.dtype == torch.int32 and tuple(mirror.shape) == (8,)
    assert BlockPool(9, "cpu").device_free_ids is None


# --------------------------------------------------------------------------
# Construction and devices
# --------------------------------------------------------------------------


def test_the_last_id_is_the_dummy_and_id_0_is_on_top() -> None:
    pool = BlockPool(5, "cpu")
    assert (pool.total_count, pool.num_usable, pool.dummy_block_id) == (5, 4, 4)
    assert pool.free_ids().tolist() == [3, 2, 1, 0]
    assert pool.acquire(4).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("total_count", [1, 0, True, 2.0, "4", None])
def test_total_count_must_be_an_int_of_at_least_two(total_count: object) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"got {total_count!r}") + "$"):
        BlockPool(total_count, "cpu")  # type: ignore[arg-type]


def test_the_smallest_pool_has_one_usable_block() -> None:
    pool = BlockPool(2, "cpu")
    assert pool.acquire(1).tolist() == [0] and pool.dummy_block_id == 1


def test_resolve_device() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(None) == torch.device(expected)
    assert resolve_device("meta") == torch.device("meta")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ConfigError, match="invalid device 'no-such-device'"):
        resolve_device("no-such-device")
    with pytest.raises(ConfigError, match=r"invalid device 3\.5"):
        resolve_device(3.5)  # type: ignore[arg-type]


def test_cuda_is_the_default_device_when_available(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.device("cuda") needs no GPU; only allocating on it does.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(None) == torch.device("cuda")


def test_a_cpu_pool_never_pins_even_when_cuda_is_present(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pinned memory serves only a CUDA mirror's asynchronous copies; without a
    # GPU, torch refuses to pin, so a CPU pool that tried would fail here.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pool = BlockPool(6, "cpu")
    assert pool.device_free_ids is None
    assert pool.acquire(2).tolist() == [0, 1]
