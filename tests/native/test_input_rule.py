"""One input rule, enforced alike by both engines (README, "Input rules").

Issue 28, item 4: through the native request path (``admit_request``, ``release_request``,
``allocate_block_ids``) list subclasses, numpy-integer lists, big-endian and strided arrays
were refused while the Python engine took them, memoryviews and ``array.array`` rows were
taken while the Python engine refused them, ``bytes`` were tokens on one engine only, a 2-D
memoryview raised a bare ``NotImplementedError``, and an integer past 64 bits was a
different error. The rule now: a 1-D integer array, CPU tensor or buffer (any byte order
and stride; ``out_row`` must be writable, C-contiguous int32) or a list or tuple (subclasses
too) of ints (Python ints or numpy integers, never bools); bytes, bytearray and str are
never IDs or tokens. This test generates a catalogue of inputs and requires the same
outcome (result, or exception type) from both engines, and never a bare exception.
"""

from __future__ import annotations

import array
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import KVBlockAllocator, PrefixCacheError
from prefixcache.engine.native_engine import native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="the native engine is not built")


class ListSubclass(list):  # type: ignore[type-arg]
    """A list subclass, as some callers keep token lists."""


def catalogue(values: list[int]) -> dict[str, object]:
    """The same values in every container a caller might pass."""
    ints = np.asarray(values, dtype=np.int64)
    small = bool(ints.size == 0 or (ints.min() >= 0 and ints.max() < 256))
    kinds: dict[str, object] = {
        "list": list(values),
        "tuple": tuple(values),
        "list-subclass": ListSubclass(values),
        "numpy-int-list": [np.int64(v) for v in values],
        "numpy-int32-tuple": tuple(np.int32(v) for v in values if -(2**31) <= v < 2**31),
        "np-int32": ints.astype(np.int32),
        "np-int64": ints,
        "np-uint16": ints.astype(np.uint16) if small else ints,
        "np-big-endian": ints.astype(">i8"),
        "np-strided": np.repeat(ints, 2)[::2],
        "np-2d": ints.reshape(1, -1),
        "np-bool": ints.astype(bool),
        "np-float": ints.astype(np.float64),
        "memoryview": memoryview(ints.astype(np.int32)),
        "memoryview-strided": memoryview(np.repeat(ints.astype(np.int32), 2))[::2],
        "memoryview-2d": memoryview(ints.astype(np.int32).reshape(1, -1)),
        "array-i": array.array("i", [v for v in values if -(2**31) <= v < 2**31]),
        "bytes": bytes(ints.astype(np.uint8)) if small else b"\x01\x02",
        "bytearray": bytearray(ints.astype(np.int32).tobytes()),
        "torch-int64": torch.tensor(values, dtype=torch.int64),
        "torch-int32-strided": torch.tensor(values, dtype=torch.int32).repeat(2)[::2]
        if values
        else torch.zeros(0, dtype=torch.int32),
        "list-of-floats": [float(v) for v in values],
        "list-with-bool": [True, *values],
        "list-past-int64": [2**70, *values],
        "str": "12345",
        "none": None,
    }
    return kinds


VALUE_SETS = {
    "ids": [1, 2, 3, 4, 5],
    "repeated": [3, 3, 3],
    "out-of-range": [1, 40],
    "negative": [-1, 2],
    "empty": [],
}


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        result = call()
    except PrefixCacheError as error:
        return ("raised", type(error).__name__)
    except Exception as error:  # a bare exception is a failure of the rule
        return ("BARE", f"{type(error).__name__}: {error}")
    if isinstance(result, tuple):
        return ("ok", tuple(r.tolist() if hasattr(r, "tolist") else r for r in result))
    return ("ok", result.tolist() if hasattr(result, "tolist") else result)


def build(engine: str) -> KVBlockAllocator:
    allocator = KVBlockAllocator(total_count=32, block_size_tokens=2, device="cpu", engine=engine)
    assert allocator.engine == engine
    return allocator


def admit_tokens(allocator: KVBlockAllocator, value: object) -> object:
    row = np.zeros(16, dtype=np.int32)
    return allocator.admit_request(value, row), row, allocator.get_total_used()


def admit_row(allocator: KVBlockAllocator, value: object) -> object:
    return allocator.admit_request([1, 2, 3, 4, 5], value), allocator.get_total_used()


def release(allocator: KVBlockAllocator, value: object) -> object:
    allocator.allocate_block_ids(8)
    allocator.acquire_blocks([3, 3, 3])
    allocator.release_request(value)
    return allocator.get_total_used(), allocator.reference_counts(list(range(8)))[0]


def match(allocator: KVBlockAllocator, value: object) -> object:
    allocator.admit_request(list(range(10)), np.zeros(8, dtype=np.int32))
    return allocator.match_prefix(value), allocator.get_total_used()


CALLS = {
    "admit-tokens": admit_tokens,
    "admit-row": admit_row,
    "release": release,
    "match-hashes": match,
}


@pytest.mark.parametrize("values", list(VALUE_SETS), ids=str)
@pytest.mark.parametrize("call", list(CALLS), ids=str)
def test_both_engines_apply_one_input_rule(call: str, values: str) -> None:
    differences = []
    run = CALLS[call]
    for kind, value in catalogue(VALUE_SETS[values]).items():
        results = [
            outcome(lambda e=engine, v=value: run(build(e), v)) for engine in ("python", "native")
        ]
        if results[0] != results[1] or "BARE" in (results[0][0], results[1][0]):
            differences.append((kind, results))
    assert not differences, differences


@pytest.mark.parametrize(
    "count", [0, 3, -1, 2**63, 2**70, True, 2.0, np.int64(2), None, "3"], ids=repr
)
def test_block_counts_follow_one_rule(count: object) -> None:
    results = [
        outcome(lambda e=engine: build(e).allocate_block_ids(count))
        for engine in ("python", "native")
    ]
    assert results[0] == results[1] and results[0][0] != "BARE", results


DTYPES = [
    *(np.dtype(f"{order}{kind}{size}") for order in "<>" for kind in "iu" for size in (1, 2, 4, 8)),
    np.dtype(bool),
    np.dtype(np.float32),
    np.dtype(">f8"),
]
"""Every integer width in both byte orders, and the dtypes the rule refuses."""


@st.composite
def buffers(draw: st.DrawFn) -> np.ndarray:
    """An array as a caller might build one: any dtype, byte order, shape, stride, writability."""
    dtype = draw(st.sampled_from(DTYPES), label="dtype")
    values = draw(st.lists(st.integers(-3, 40), max_size=6), label="values")
    base = np.array(values, dtype=np.int64).astype(dtype)
    layout = draw(st.sampled_from(["flat", "strided", "reversed", "2-d", "fortran", "0-d"]))
    if layout == "strided":
        base = np.repeat(base, 2)[::2]
    elif layout == "reversed":
        base = base[::-1]
    elif layout == "2-d":
        base = base.reshape(1, -1)
    elif layout == "fortran":
        base = np.asfortranarray(np.stack([base, base])) if base.size else base
    elif layout == "0-d":
        base = base[:1].reshape(()) if base.size else base
    base.flags.writeable = draw(st.booleans(), label="writable")
    return base


@settings(max_examples=120, deadline=None, derandomize=True)
@given(array=buffers(), call=st.sampled_from(sorted(CALLS)), as_tensor=st.booleans())
def test_generated_buffers_follow_one_rule(array: np.ndarray, call: str, as_tensor: bool) -> None:
    """Generated arrays (and their tensors) through every call: one outcome, never bare."""
    value: object = array
    if as_tensor and array.dtype.isnative and array.dtype.kind in "iub":
        value = torch.from_numpy(array.copy())  # torch has no big-endian or read-only views
    results = [
        outcome(lambda e=engine: CALLS[call](build(e), value)) for engine in ("python", "native")
    ]
    assert results[0] == results[1] and "BARE" not in (results[0][0], results[1][0]), results
