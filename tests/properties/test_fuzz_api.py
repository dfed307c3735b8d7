"""API fuzzing: arbitrary arguments never escape as anything but the library's own errors.

Hypothesis throws values of every shape at every public method of
:class:`KVBlockAllocator`, :class:`BlockPool`, :class:`BlockTable`,
:class:`KVCache` and at :func:`compute_block_hashes`: wrong dtypes, floats,
NaN, negative and huge ints, nested lists, dicts, numpy arrays of every
dtype, empty, 0-D and 2-D tensors, tensors on the ``meta`` device, None,
strings, bytes, bools, mixed with plausible values (valid IDs, registered
hashes) so that calls get past the first check. Each call either succeeds
(and the invariants still hold) or raises a
:class:`~prefixcache.errors.PrefixCacheError` and changes nothing; a bare
``TypeError``/``IndexError``/``RuntimeError``/``OverflowError``/``KeyError``
from torch, numpy or Python fails the test.

The number of examples comes from a hypothesis profile chosen by the
``PREFIXCACHE_FUZZ_PROFILE`` environment variable: ``fuzz-ci`` (default,
seconds) or ``fuzz-long`` (thousands of examples per method)::

    PREFIXCACHE_FUZZ_PROFILE=fuzz-long python -m pytest tests/properties/test_fuzz_api.py

Every input-validation bug the fuzzers found has a regression test at the end
of this file.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from prefixcache import (
    AllocatorConfig,
    BlockPool,
    BlockTable,
    InvalidArgumentError,
    KVBlockAllocator,
    KVCache,
    PrefixCacheError,
    compute_block_hashes,
    root_hash,
)
from prefixcache.testing import pool_digest, state_digest

settings.register_profile(
    "fuzz-ci",
    max_examples=25,
    derandomize=True,  # the same examples on every CI run
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "fuzz-long",
    max_examples=3_000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
FUZZ = settings.get_profile(os.environ.get("PREFIXCACHE_FUZZ_PROFILE", "fuzz-ci"))

TOTAL_COUNT = 16
BLOCK_SIZE = 4
NUM_LAYERS = 2
TOP_K = 2
HASHES_A = [101, 102, 103]
HASHES_C = [201, 202]

# ---------------------------------------------------------------------- values

NUMPY_DTYPES = [
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.bool_,
    np.complex64,
]
TORCH_DTYPES = [
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
    torch.complex64,
]
NUMPY_INTS = [np.int8(5), np.int64(2), np.uint8(9), np.uint64(2**64 - 1), np.int32(0)]
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, TOTAL_COUNT + 2),
    st.integers(-(2**80), 2**80),
    st.floats(),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.complex_numbers(max_magnitude=10),
    st.sampled_from(
        [np.int64(3), np.uint64(2**64 - 1), np.float32(1.5), np.bool_(True), np.int8(-1)]
    ),
)
arrays = hnp.arrays(dtype=st.sampled_from(NUMPY_DTYPES), shape=SHAPES)
int_arrays = hnp.arrays(
    dtype=st.sampled_from(NUMPY_DTYPES[:8]),
    shape=hnp.array_shapes(min_dims=1, max_dims=1, min_side=0, max_side=5),
    elements=st.integers(0, 20),
)
tensors = st.one_of(
    arrays.map(lambda a: torch.from_numpy(np.ascontiguousarray(a))),
    st.builds(
        lambda shape, dtype: torch.zeros(shape, dtype=dtype), SHAPES, st.sampled_from(TORCH_DTYPES)
    ),
    st.builds(
        lambda shape, dtype: torch.empty(shape, dtype=dtype, device="meta"),
        SHAPES,
        st.sampled_from(TORCH_DTYPES),
    ),
    int_arrays.map(lambda a: torch.from_numpy(a.astype(np.int64))[::2]),  # non-contiguous
    st.just(torch.ones(3, requires_grad=True)),
)
plausible_ids = st.one_of(
    st.lists(st.integers(0, TOTAL_COUNT - 2), max_size=5),
    st.lists(st.integers(0, TOTAL_COUNT - 2), max_size=5).map(
        lambda ids: torch.tensor(ids, dtype=torch.int32)
    ),
    int_arrays,
)
plausible_hashes = st.lists(
    st.sampled_from([*HASHES_A, *HASHES_C, 7, 0, -1, 2**63 - 1, 2**64]), max_size=4
)
nested = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(st.text(max_size=2), children, max_size=2),
    ),
    max_leaves=6,
)
anything = st.one_of(nested, arrays, tensors, plausible_ids, plausible_hashes)
"""Any argument at all, including plausible ones so that calls get past their first check."""

# ---------------------------------------------------------------------- allocator


def populated_allocator(**overrides: Any) -> KVBlockAllocator:
    """A small allocator with active, paused, cached, unhashed and free blocks, routing, events."""
    options: dict[str, Any] = {
        "total_count": TOTAL_COUNT,
        "paused_count": 4,
        "block_size_tokens": BLOCK_SIZE,
        "device": "cpu",
        "routing_num_layers": NUM_LAYERS,
        "routing_top_k": TOP_K,
        "routing_num_experts": 8,
        "kv_events_capacity": 64,
    }
    options.update(overrides)
    allocator = KVBlockAllocator(**options)
    verify = allocator.verify_prefix_hits
    chain_a = allocator.allocate_memory_blocks(3)
    allocator.register_kv_block_hashes(chain_a, HASHES_A, fingerprints=HASHES_A if verify else None)
    allocator.store_block_routing(
        int(chain_a[0]), torch.ones(BLOCK_SIZE, NUM_LAYERS, TOP_K, dtype=torch.int64)
    )
    chain_c = allocator.allocate_memory_blocks(2)
    allocator.register_kv_block_hashes(chain_c, HASHES_C, fingerprints=HASHES_C if verify else None)
    allocator.release_memory_blocks(chain_c)
    allocator.allocate_memory_blocks(1)
    allocator.pause(allocator.allocate_memory_blocks(1))
    allocator.take_events()
    allocator.check_invariants()
    return allocator


IN_GROUP = "release_memory_blocks(in free_group)"
"""A release queued inside an open free group: refused ones must leave the queue as it was."""


A = anything
FLAG = st.booleans()
"""A keyword flag: non-bool flags are a known bug (see the reproducers at the end)."""

CONFIG_FIELDS = sorted(field.name for field in dataclasses.fields(AllocatorConfig))

ALLOCATOR_METHODS: dict[str, tuple[tuple[st.SearchStrategy[Any], ...], Callable[..., object]]] = {
    "is_memory_available": ((A,), lambda a, n: a.is_memory_available(n)),
    "allocate_memory_blocks": ((A,), lambda a, n: a.allocate_memory_blocks(n)),
    "release_memory_blocks": ((A,), lambda a, ids: a.release_memory_blocks(ids)),
    "release_memory_blocks(paused)": (
        (A, FLAG),
        lambda a, ids, paused: a.release_memory_blocks(ids, paused=paused),
    ),
    IN_GROUP: ((A,), lambda a, ids: a.release_memory_blocks(ids)),
    "hash_tokens": (
        (A, A, A, A),
        lambda a, t, parent, salt, keys: a.hash_tokens(
            t, parent=parent, salt=salt, extra_keys=keys
        ),
    ),
    "fingerprint_tokens": (
        (A, A, A, A),
        lambda a, t, parent, salt, keys: a.fingerprint_tokens(
            t, parent=parent, salt=salt, extra_keys=keys
        ),
    ),
    "match_prefix": (
        (A, FLAG, A),
        lambda a, h, acquire, fp: a.match_prefix(h, acquire=acquire, fingerprints=fp),
    ),
    "is_hash_registered": ((A,), lambda a, h: a.is_hash_registered(h)),
    "acquire_blocks": ((A,), lambda a, ids: a.acquire_blocks(ids)),
    "register_kv_block_hashes": (
        (A, A, A, A, A, A),
        lambda a, ids, h, parent, tokens, lora, fp: a.register_kv_block_hashes(
            ids, h, parent_hash=parent, token_ids=tokens, lora_name=lora, fingerprints=fp
        ),
    ),
    "pause": ((A,), lambda a, ids: a.pause(ids)),
    "resume": ((A,), lambda a, ids: a.resume(ids)),
    "reference_counts": ((A,), lambda a, ids: a.reference_counts(ids)),
    "advance_clock": ((A,), lambda a, ticks: a.advance_clock(ticks)),
    "update_timestamps": ((A,), lambda a, ids: a.update_timestamps(ids)),
    "set_retention_priority": (
        (A, A, A),
        lambda a, h, priority, duration: a.set_retention_priority(h, priority, duration=duration),
    ),
    "evict_cached_blocks": ((A,), lambda a, n: a.evict_cached_blocks(n)),
    "evict_lru_blocks": ((A,), lambda a, n: a.evict_lru_blocks(n)),
    "store_routing_per_block": (
        (A, A, A),
        lambda a, r, ids, pos: a.store_routing_per_block(r, ids, pos),
    ),
    "store_block_routing": ((A, A), lambda a, block_id, r: a.store_block_routing(block_id, r)),
    "get_block_routing": ((A,), lambda a, block_id: a.get_block_routing(block_id)),
    "reconstruct_routing_from_blocks": (
        (A, A),
        lambda a, ids, total: a.reconstruct_routing_from_blocks(ids, total),
    ),
}
"""Every public allocator method that takes arguments: (a strategy per argument, call)."""

NO_ARGUMENT_METHODS = [
    "get_total_used",
    "get_active_used",
    "get_paused_used",
    "get_active_avail",
    "get_paused_avail",
    "get_evictable_block_count",
    "stats",
    "take_events",
    "snapshot",
    "check_invariants",
    "reset",
]


def _bare_error(where: str, args: tuple[Any, ...], exc: BaseException) -> str:
    frame = exc.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    origin = "?" if frame is None else f"{frame.tb_frame.f_code.co_filename}:{frame.tb_lineno}"
    return f"{where}{args!r} raised bare {type(exc).__name__}: {exc} (at {origin})"


def check_call(
    where: str, args: tuple[Any, ...], call: Callable[[], object], state: Callable[[], Any]
) -> object:
    """Run ``call``: it succeeds, or raises a PrefixCacheError and leaves ``state()`` as it was."""
    before = state()
    try:
        return call()
    except PrefixCacheError:
        assert state() == before, f"{where}{args!r} raised but changed state"
    except Exception as exc:  # anything else is the bug this file hunts
        pytest.fail(_bare_error(where, args, exc))
    return None


@pytest.mark.parametrize("verify", [False, True], ids=["default", "verify"])
@pytest.mark.parametrize("method", sorted(ALLOCATOR_METHODS))
@FUZZ
@given(data=st.data())
def test_allocator_method_refuses_garbage_cleanly(method: str, verify: bool, data: Any) -> None:
    strategies, call = ALLOCATOR_METHODS[method]
    args = tuple(data.draw(strategy, label=f"arg{i}") for i, strategy in enumerate(strategies))
    allocator = populated_allocator(
        eviction_policy="ref_zero" if data.draw(st.booleans(), label="ref_zero") else "lru",
        verify_prefix_hits=verify,
    )
    with ExitStack() as group:
        if method == IN_GROUP:
            group.enter_context(allocator.free_group())
        check_call(method, args, lambda: call(allocator, *args), lambda: state_digest(allocator))
    allocator.check_invariants()


@pytest.mark.parametrize("method", NO_ARGUMENT_METHODS)
def test_allocator_method_without_arguments_keeps_invariants(method: str) -> None:
    allocator = populated_allocator()
    getattr(allocator, method)()
    allocator.check_invariants()


@FUZZ
@given(options=st.dictionaries(st.sampled_from(CONFIG_FIELDS), anything))
def test_allocator_construction_refuses_garbage_cleanly(options: dict[str, Any]) -> None:
    options.setdefault("total_count", TOTAL_COUNT)
    options.setdefault("device", "cpu")
    allocator = check_call(
        "KVBlockAllocator", (options,), lambda: KVBlockAllocator(**options), lambda: None
    )
    if allocator is not None:
        assert isinstance(allocator, KVBlockAllocator)
        allocator.check_invariants()


# ---------------------------------------------------------------------- pool, table, cache


@FUZZ
@given(
    value=st.one_of(
        st.integers(-3, 8), st.integers(-(2**70), 2**70), st.sampled_from(NUMPY_INTS), anything
    )
)
def test_pool_acquire_refuses_garbage_cleanly(value: Any) -> None:
    """Counts of every int type, sign and size, and values of every other type.

    ``release`` is left out: it does not check its IDs, by design (see the
    BlockPool docstring); the allocator checks them before they reach it.
    """
    pool = BlockPool(8, "cpu")
    pool.acquire(3)
    result = check_call(
        "BlockPool.acquire", (value,), lambda: pool.acquire(value), lambda: pool_digest(pool)
    )
    free = pool.free_ids()
    assert len(np.unique(free)) == len(free) == pool.num_free <= pool.num_usable
    if result is not None:
        assert isinstance(result, np.ndarray) and result.dtype == np.int32
        assert not set(result.tolist()) & set(free.tolist())


TABLE_METHODS: dict[str, tuple[int, Callable[..., object]]] = {
    "add_request": (1, lambda t, ids: t.add_request(ids)),
    "append_blocks": (2, lambda t, slot, ids: t.append_blocks(slot, ids)),
    "remove_request": (1, lambda t, slot: t.remove_request(slot)),
    "blocks_of": (1, lambda t, slot: t.blocks_of(slot)),
    "num_blocks": (1, lambda t, slot: t.num_blocks(slot)),
    "is_active": (1, lambda t, slot: t.is_active(slot)),
}


def table_digest(table: BlockTable) -> tuple[Any, ...]:
    return (table.device_table.tolist(), table.num_requests, table._lengths.tolist())


@pytest.mark.parametrize("method", sorted(TABLE_METHODS))
@FUZZ
@given(data=st.data())
def test_block_table_method_refuses_garbage_cleanly(method: str, data: Any) -> None:
    num_args, call = TABLE_METHODS[method]
    slot_or_anything = st.one_of(st.integers(-1, 3), anything)
    args = tuple(data.draw(slot_or_anything, label=f"arg{i}") for i in range(num_args))
    table = BlockTable(max_requests=3, max_blocks_per_request=4, dummy_block_id=9, device="cpu")
    table.add_request([1, 2])
    check_call(
        f"BlockTable.{method}", args, lambda: call(table, *args), lambda: table_digest(table)
    )


@FUZZ
@given(args=st.tuples(anything, anything, anything), device=st.one_of(anything, st.just("cpu")))
def test_block_table_construction_refuses_garbage_cleanly(
    args: tuple[Any, Any, Any], device: Any
) -> None:
    check_call("BlockTable", (*args, device), lambda: BlockTable(*args, device=device), lambda: 0)


def _kv_values(draw: Any, shape_of: tuple[int, ...]) -> Any:
    return draw(
        st.one_of(
            anything,
            st.just(torch.zeros(shape_of, dtype=torch.float32)),
            st.just(torch.zeros(shape_of, dtype=torch.float16)),
        )
    )


@FUZZ
@given(data=st.data())
def test_kv_cache_write_and_gather_refuse_garbage_cleanly(data: Any) -> None:
    cache = KVCache(2, num_blocks=4, block_size=2, k_heads=1, k_head_dim=2, dtype=torch.float32)
    layer = data.draw(st.one_of(st.integers(-1, 2), anything), label="layer")
    ids = data.draw(anything, label="block_ids")
    offsets = data.draw(anything, label="offsets")
    k = _kv_values(data.draw, (1, 1, 2))
    v = _kv_values(data.draw, (1, 1, 2))

    def state() -> bytes:
        return b"".join(t.numpy().tobytes() for t in (*cache.k_caches, *cache.v_caches))

    check_call(
        "KVCache.write",
        (layer, ids, offsets),
        lambda: cache.write(layer, ids, offsets, k, v),
        state,
    )
    check_call("KVCache.gather", (layer, ids), lambda: cache.gather(layer, ids), state)


@FUZZ
@given(
    args=st.lists(anything, min_size=5, max_size=5),
    dtype=st.one_of(anything, st.sampled_from(TORCH_DTYPES)),
)
def test_kv_cache_construction_refuses_garbage_cleanly(args: list[Any], dtype: Any) -> None:
    check_call(
        "KVCache", (*args, dtype), lambda: KVCache(*args, dtype=dtype, device="cpu"), lambda: 0
    )


# ---------------------------------------------------------------------- hashing


@FUZZ
@given(
    tokens=anything,
    block_size=st.one_of(st.integers(-1, 5), anything),
    parent=st.one_of(st.none(), anything),
    salt=st.one_of(st.none(), anything),
    extra_keys=st.one_of(st.none(), anything),
    algo=st.one_of(st.sampled_from(["xxh3_64", "xxh3_128", "sha256"]), anything),
)
def test_compute_block_hashes_refuses_garbage_cleanly(
    tokens: Any, block_size: Any, parent: Any, salt: Any, extra_keys: Any, algo: Any
) -> None:
    args = (tokens, block_size, parent, salt, extra_keys, algo)
    result = check_call(
        "compute_block_hashes",
        args,
        lambda: compute_block_hashes(
            tokens, block_size, parent=parent, salt=salt, extra_keys=extra_keys, algo=algo
        ),
        lambda: 0,
    )
    if result is not None:
        assert all(isinstance(h, int) and h >= 1 for h in result)


@FUZZ
@given(salt=anything, extra_keys=anything, algo=st.one_of(st.just("xxh3_64"), anything))
def test_root_hash_refuses_garbage_cleanly(salt: Any, extra_keys: Any, algo: Any) -> None:
    check_call(
        "root_hash", (salt, extra_keys, algo), lambda: root_hash(salt, extra_keys, algo), lambda: 0
    )


# ---------------------------------------------------------------------- known core bugs


# ---------------------------------------------------------------------- fixed core bugs
# Regression tests of the input-validation bugs the fuzzers found. The hashing
# and config ones live in test_hashing.py and test_config.py.


def test_release_refuses_a_non_bool_paused_flag() -> None:
    allocator = populated_allocator()
    with pytest.raises(PrefixCacheError):
        allocator.release_memory_blocks([], paused=np.array([]))
    with pytest.raises(PrefixCacheError):  # "no" was truthy: the paused partition
        allocator.release_memory_blocks([0], paused="no")


def test_match_prefix_refuses_a_non_bool_acquire_flag() -> None:
    allocator = populated_allocator()
    with pytest.raises(PrefixCacheError):
        allocator.match_prefix(HASHES_A, acquire=torch.tensor([1, 0]))


@pytest.mark.parametrize("method", ["hash_tokens", "fingerprint_tokens"])
def test_hash_tokens_refuses_malformed_extra_keys(method: str) -> None:
    allocator = populated_allocator()
    tokens = list(range(8))
    with pytest.raises(PrefixCacheError):
        getattr(allocator, method)(tokens, extra_keys=np.array(0))
    # compute_block_hashes refuses a str; hash_tokens once split it into
    # characters, so the key "ab" silently hashed like the two keys ("a", "b").
    with pytest.raises(PrefixCacheError):
        getattr(allocator, method)(tokens, extra_keys="ab")


def test_is_hash_registered_refuses_unhashable_values() -> None:
    with pytest.raises(PrefixCacheError):
        populated_allocator().is_hash_registered([101])


@pytest.mark.parametrize("bad", [None, 1.5, True, "2", torch.tensor([1]), np.float64(1.0), -1])
def test_pool_acquire_refuses_negative_and_non_int_counts(bad: Any) -> None:
    pool = BlockPool(4, "cpu")
    with pytest.raises(InvalidArgumentError):  # -1 once returned [] and set num_free to 4 of 3
        pool.acquire(bad)
    assert pool.num_free == pool.num_usable == 3


def test_pool_acquire_takes_numpy_counts_as_ints() -> None:
    pool = BlockPool(4, "cpu")
    assert pool.acquire(np.uint64(2)).tolist() == [0, 1]
    assert type(pool.num_free) is int and pool.num_free == 1


def test_pool_release_refuses_more_ids_than_were_handed_out() -> None:
    pool = BlockPool(4, "cpu")
    pool.acquire(2)
    with pytest.raises(InvalidArgumentError, match="releasing 3 blocks, but only 2"):
        pool.release(np.array([1, 0, 0], dtype=np.int32))  # once a bare numpy ValueError
    assert pool.free_ids().tolist() == [2]
