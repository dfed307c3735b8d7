"""Bad input at the native boundary: the library's own exception, and nothing changes.

Calls the extension's ``Engine`` directly (what the facade calls, and what the
fused request path binds on the allocator), with wrong dtypes, bools,
non-contiguous and read-only arrays, negative and out-of-range IDs, huge
counts, hashes outside 64 bits and tokens outside int32, then a hypothesis
fuzz of arbitrary values for every argument.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import KVBlockAllocator
from prefixcache.engine.native_engine import native_available
from prefixcache.errors import (
    BlockStateError,
    CapacityError,
    HashConflictError,
    InvalidArgumentError,
    InvalidBlockIdError,
    InvalidTensorError,
    PrefixCacheError,
    ReferenceCountError,
)

pytestmark = pytest.mark.skipif(
    not native_available(), reason="the native engine (prefixcache.engine._native) is not built"
)

TOTAL = 12
USABLE = TOTAL - 1


def _engine() -> Any:
    """A native engine with some state: two held blocks, a cached chain of two."""
    from prefixcache.engine import _native  # type: ignore[attr-defined]

    engine = _native.Engine(TOTAL, 2, "lru", True, 2)
    held = engine.allocate(4)
    engine.register(held, [11, 12, 13, 14])
    engine.release(np.frombuffer(held, dtype=np.int32)[2:].copy())
    return engine


def _digest(engine: Any) -> tuple[Any, ...]:
    everything = np.arange(USABLE)
    active, paused = engine.reference_counts(everything)
    return (
        engine.counters(),
        engine.num_free,
        engine.num_active,
        engine.num_paused,
        engine.num_cached,
        engine.free_ids().tolist(),
        active.tolist(),
        paused.tolist(),
        engine.registered_chains(),
        engine.group_depth,
    )


def _refused(engine: Any, error: type[Exception], call: Any) -> None:
    before = _digest(engine)
    with pytest.raises(error):
        call()
    assert _digest(engine) == before
    assert engine.find_problems() == []


BAD_ID_ARRAYS = [
    (np.array([0.0, 1.0]), InvalidTensorError),
    (np.array([True, False]), InvalidTensorError),
    (np.array(["a"]), InvalidTensorError),
    (np.zeros((2, 2), dtype=np.int32), InvalidTensorError),
    (np.array([-1], dtype=np.int64), InvalidBlockIdError),
    (np.array([USABLE], dtype=np.int32), InvalidBlockIdError),
    (np.array([2**40], dtype=np.int64), InvalidBlockIdError),
    (np.array([2**64 - 1], dtype=np.uint64), InvalidBlockIdError),
    ([0, True], InvalidTensorError),
    ([0, 1.0], InvalidTensorError),
    ([2**70], InvalidTensorError),  # past int64: the input rule's "integer out of range"
    ([-(2**70)], InvalidTensorError),
    ("01", InvalidTensorError),
    (None, InvalidTensorError),
    (3, InvalidTensorError),
]


@pytest.mark.parametrize(("ids", "error"), BAD_ID_ARRAYS)
@pytest.mark.parametrize("method", ["release", "acquire", "touch", "release_request"])
def test_bad_ids_are_refused_before_any_change(method: str, ids: Any, error: type) -> None:
    engine = _engine()
    _refused(engine, error, lambda: getattr(engine, method)(ids))


@pytest.mark.parametrize(("ids", "error"), BAD_ID_ARRAYS)
def test_bad_ids_are_refused_by_move_take_hit_and_register(ids: Any, error: type) -> None:
    engine = _engine()
    _refused(engine, error, lambda: engine.move(ids, True))
    _refused(engine, error, lambda: engine.take_hit(ids, 1, True))
    _refused(engine, error, lambda: engine.register(ids, [21, 22]))


def test_state_errors_are_the_python_engine_s() -> None:
    engine = _engine()
    free = int(engine.free_ids()[0])
    _refused(engine, ReferenceCountError, lambda: engine.release([free]))
    _refused(engine, ReferenceCountError, lambda: engine.release([0, 0]))
    _refused(engine, ReferenceCountError, lambda: engine.release([0], paused=True))
    _refused(engine, BlockStateError, lambda: engine.acquire([free]))
    _refused(engine, BlockStateError, lambda: engine.touch([0, free]))
    _refused(engine, BlockStateError, lambda: engine.register([free], [21]))
    _refused(engine, HashConflictError, lambda: engine.register([0], [99]))
    _refused(engine, HashConflictError, lambda: engine.register([0, 1], [11, 21], 77))


def test_flags_must_be_bools() -> None:
    engine = _engine()
    for flag in (1, 0, "yes", None, np.int8(1)):
        _refused(engine, InvalidArgumentError, lambda f=flag: engine.release([0], f))
        _refused(engine, InvalidArgumentError, lambda f=flag: engine.move([0], f))
        _refused(engine, InvalidArgumentError, lambda f=flag: engine.take_hit([0], 1, f))
    engine.release([0], np.bool_(False))  # numpy's bool is a bool
    assert engine.num_active == 1


@pytest.mark.parametrize("count", [True, -1, 1.5, "3", None, -(2**70)])
def test_counts_must_be_non_negative_ints(count: Any) -> None:
    engine = _engine()
    _refused(engine, InvalidArgumentError, lambda: engine.allocate(count))
    _refused(engine, InvalidArgumentError, lambda: engine.evict(count))
    _refused(engine, InvalidArgumentError, lambda: engine.advance_clock(count))


def test_huge_counts_are_not_satisfiable_and_change_nothing() -> None:
    engine = _engine()
    before = _digest(engine)
    _refused(engine, InvalidArgumentError, lambda: engine.allocate(2**70))  # past int64
    assert engine.allocate(np.int64(2**40)) is None  # an int, more than the pool holds
    assert _digest(engine) == before
    _refused(engine, InvalidArgumentError, lambda: engine.advance_clock(2**70))
    assert engine.evict(2**70) == 2  # every cached block, no more


@pytest.mark.parametrize(
    "hashes", [[2**63], [-(2**63) - 1], [2**64 + 5], np.array([2**63], dtype=np.uint64)]
)
def test_hashes_outside_64_bits_are_refused(hashes: Any) -> None:
    engine = _engine()
    _refused(engine, InvalidArgumentError, lambda: engine.lookup(hashes))
    _refused(engine, InvalidArgumentError, lambda: engine.register([0], hashes))


def test_hash_lists_hold_ints_and_no_sentinels() -> None:
    engine = _engine()
    _refused(engine, InvalidTensorError, lambda: engine.lookup([11, True]))
    _refused(engine, InvalidTensorError, lambda: engine.lookup([11, "12"]))
    _refused(engine, InvalidTensorError, lambda: engine.lookup(np.array([1.5])))
    _refused(engine, InvalidArgumentError, lambda: engine.register([0], [0]))
    _refused(engine, InvalidArgumentError, lambda: engine.register([0], [-1]))
    _refused(engine, InvalidArgumentError, lambda: engine.register([0, 1], [11]))
    _refused(engine, InvalidArgumentError, lambda: engine.register([0], [11], True))
    _refused(engine, InvalidArgumentError, lambda: engine.register([0], [11], 2**64))
    assert engine.lookup([11, 12, 13]).tolist() == [0, 1, 2]


def test_admit_request_refuses_bad_rows_and_tokens_without_writing() -> None:
    engine = _engine()
    tokens = np.arange(6, dtype=np.int32)
    read_only = np.zeros(4, dtype=np.int32)
    read_only.flags.writeable = False
    bad_rows = [
        (read_only, InvalidTensorError),
        (np.zeros(4, dtype=np.int64), InvalidTensorError),
        (np.zeros(4, dtype=np.uint32), InvalidTensorError),
        (np.zeros(8, dtype=np.int32)[::2], InvalidTensorError),
        (np.zeros((2, 4), dtype=np.int32), InvalidTensorError),
        (np.zeros(2, dtype=np.int32), InvalidArgumentError),
        ([0, 0, 0, 0], InvalidTensorError),
        (b"\0" * 16, InvalidTensorError),
    ]
    for row, error in bad_rows:
        _refused(engine, error, lambda r=row: engine.admit_request(tokens, r))
    row = np.full(4, -7, dtype=np.int32)
    for bad_tokens, error in [
        (np.array([2**31], dtype=np.int64), InvalidArgumentError),
        (np.array([-(2**31) - 1], dtype=np.int64), InvalidArgumentError),
        (np.array([0.5]), InvalidTensorError),
        (np.array([True]), InvalidTensorError),
        ([1, "2"], InvalidArgumentError),
        ([1, True], InvalidArgumentError),
        ([2**40], InvalidArgumentError),
        ("tokens", InvalidArgumentError),
    ]:
        _refused(engine, error, lambda t=bad_tokens: engine.admit_request(t, row))
    assert (row == -7).all()


def test_admit_request_that_cannot_fit_changes_nothing() -> None:
    engine = _engine()
    row = np.full(64, -7, dtype=np.int32)
    _refused(engine, CapacityError, lambda: engine.admit_request(np.arange(40), row))
    assert (row == -7).all()


def test_cpu_tensors_are_read_and_written_in_place() -> None:
    engine = _engine()
    row = torch.full((4,), -7, dtype=torch.int32)
    address = row.data_ptr()
    assert engine.admit_request(torch.arange(6, dtype=torch.int32), row) == 0
    assert row.data_ptr() == address
    assert row.tolist() == [4, 5, 6, -7]  # written in place: the next three free blocks
    engine.release_request(row[:3])
    assert engine.num_active == 2


@settings(max_examples=150, deadline=None)
@given(
    value=st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True),
        st.text(max_size=3),
        st.binary(max_size=9),
        st.lists(st.one_of(st.integers(-(2**65), 2**65), st.booleans()), max_size=4),
        st.sampled_from(
            [
                np.array([1, 2], dtype=np.int16),
                np.array([1, 2], dtype=np.uint8),
                np.array([1.0]),
                np.arange(10, dtype=np.int32)[::3],
                np.zeros((1, 1), dtype=np.int64),
                np.array([], dtype=np.int64),
                torch.arange(3),
                memoryview(b"\x01\x02"),
            ]
        ),
    ),
    method=st.sampled_from(
        [
            "allocate",
            "release",
            "release_request",
            "acquire",
            "touch",
            "lookup",
            "evict",
            "advance_clock",
            "reference_counts",
            "block_of",
            "hash_of",
            "registrations",
            "describe_state",
            "hash_tokens",
        ]
    ),
)
def test_any_value_is_accepted_or_refused_with_the_library_s_error(value: Any, method: str) -> None:
    engine = _engine()
    before = _digest(engine)
    try:
        getattr(engine, method)(value)
    except PrefixCacheError:
        assert _digest(engine) == before
    assert engine.find_problems() == []


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40),
    split=st.integers(0, 10),
    salt=st.sampled_from([None, "weights-v2"]),
)
def test_hash_tokens_continues_a_chain_as_the_facade_does(
    tokens: list[int], split: int, salt: str | None
) -> None:
    """``hash_tokens(tokens, parent)``: a session's next turn hashes only its new tokens."""
    allocator = KVBlockAllocator(
        total_count=16, block_size_tokens=4, device="cpu", engine="native", hash_salt=salt
    )
    core = allocator._engine.core
    head, tail = tokens[: 4 * split], tokens[4 * split :]
    assert core.hash_tokens(tokens) == allocator.hash_tokens(tokens)
    chain = allocator.hash_tokens(head)
    parent = chain[-1] if chain else None
    assert core.hash_tokens(tail, parent) == allocator.hash_tokens(tail, parent=parent)
    assert chain + core.hash_tokens(tail, parent=parent) == allocator.hash_tokens(tokens)
    for bad in (0, -1, 2**63, True, "1", 1.0):
        with pytest.raises(InvalidArgumentError, match="parent"):
            core.hash_tokens(tail, bad)
