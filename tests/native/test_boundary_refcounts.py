"""The C boundary keeps its references straight and holds nothing across Python code.

Issue 28, items 1 and 2: a conversion method (a tensor-like ``numpy()``) that returns
something other than a buffer was released twice (an interpreter abort after enough
calls: "deallocating None"), and a conversion that calls back into the same allocator
during ``admit_request`` resized the scratch buffer the outer call still read. Each test
fails on the code before the fix (the first aborts the process; the re-entrant one reads
freed memory, which ASan reports in ``.ci/sanitize``).
"""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np
import pytest

from prefixcache import (
    InvalidTensorError,
    KVBlockAllocator,
    PrefixCacheError,
    ReentrantCallError,
)
from prefixcache.engine.native_engine import native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="the native engine is not built")

# Calls per refused conversion; under AddressSanitizer the first double release is caught.
CALLS = int(os.environ.get("PREFIXCACHE_BOUNDARY_CALLS", "3000"))


class Converts:
    """A tensor-like object whose ``numpy()`` returns ``result`` (or calls it)."""

    def __init__(self, result: object) -> None:
        self.result = result

    def numpy(self) -> object:
        return self.result() if callable(self.result) else self.result


def native(**config: object) -> KVBlockAllocator:
    allocator = KVBlockAllocator(
        total_count=64, block_size_tokens=4, device="cpu", engine="native", **config
    )
    assert allocator.engine == "native"
    return allocator


@pytest.mark.parametrize(
    "returned", [None, 10**30, "no buffer here", object(), [1, 2]], ids=lambda v: type(v).__name__
)
def test_a_conversion_returning_no_buffer_is_refused_and_released_once(returned: object) -> None:
    allocator = native()
    row = np.zeros(8, dtype=np.int32)
    bad = Converts(returned)
    before = sys.getrefcount(returned)
    for _ in range(CALLS):  # the double release aborted within a few thousand calls
        with pytest.raises(InvalidTensorError):
            allocator.admit_request(bad, row)
        with pytest.raises(InvalidTensorError):
            allocator.admit_request(list(range(8)), bad)
        with pytest.raises(InvalidTensorError):
            allocator.release_request(bad)
    if returned is not None:  # None's count moves with everything else the process does
        assert sys.getrefcount(returned) == before
    allocator.check_invariants()
    assert allocator.get_total_used() == 0


def test_native_entry_points_leave_argument_refcounts_as_they_were() -> None:
    allocator = native()
    tokens = list(range(10))
    array_tokens = np.arange(10, dtype=np.int64)
    row = np.zeros(8, dtype=np.int32)
    watched = [tokens, array_tokens, row]
    before = [sys.getrefcount(item) for item in watched]
    for _ in range(200):
        num_hit = allocator.admit_request(tokens, row)
        allocator.release_request(row[:3])
        allocator.admit_request(array_tokens, row)
        allocator.release_request(row[:3])
        ids = allocator.allocate_block_ids(2)
        allocator.release_request(ids)
        assert num_hit in (0, 2)
    assert [sys.getrefcount(item) for item in watched] == before


def test_a_conversion_that_reenters_the_allocator_does_not_corrupt_the_outer_call() -> None:
    allocator = native()
    reference = native()
    inner_tokens = list(range(100, 100 + 4 * 12))  # longer than the outer prompt: a resize
    inner_row = np.zeros(16, dtype=np.int32)
    outer_row = np.zeros(8, dtype=np.int32)

    refused: list[ReentrantCallError] = []

    def reenter() -> np.ndarray:
        try:  # would resize the scratch token buffer the outer call reads
            allocator.admit_request(inner_tokens, inner_row)
        except ReentrantCallError as error:
            refused.append(error)
        return outer_row

    outer_tokens = list(range(9))
    num_hit = allocator.admit_request(outer_tokens, Converts(reenter))
    assert num_hit == 0
    assert len(refused) == 1  # the inner call was refused (tests/native/test_reentry.py)
    # The outer request was admitted from its own tokens: the same hashes as on a clean
    # allocator, and its three blocks are registered under them.
    expected_row = np.zeros(8, dtype=np.int32)
    reference.admit_request(outer_tokens, expected_row)
    assert allocator.hash_tokens(outer_tokens) == reference.hash_tokens(outer_tokens)
    for block_hash, block_id in zip(
        allocator.hash_tokens(outer_tokens), outer_row[:2].tolist(), strict=True
    ):
        assert allocator.match_prefix([block_hash]).tolist() == [block_id]
    allocator.check_invariants()
    assert allocator.get_active_used() == 3


def test_every_engine_method_leaves_its_arguments_refcounts_as_they_were() -> None:
    """Each method of ``_native.Engine``, called many times, successes and refusals alike."""
    from prefixcache.engine import _native  # here: the module is absent when not built

    ids, hashes = np.array([2, 3], dtype=np.int32), [11, 12]
    tokens, row = np.arange(9, dtype=np.int64), np.zeros(8, dtype=np.int32)
    bad = [1, "x"]  # refused mid-list
    calls: list[tuple[str, tuple[object, ...]]] = [
        ("allocate", (2,)),
        ("release", (ids,)),
        ("release_request", (ids,)),
        ("acquire", (ids,)),
        ("touch", (ids,)),
        ("move", (ids, True)),
        ("lookup", (hashes,)),
        ("take_hit", (ids, 2, True)),
        ("pin_chain", (3, 2, 2)),
        ("release_pinned", (ids, 2)),
        ("reclaimable", (ids,)),
        ("num_evictable", (3,)),
        ("pinned_tails", ()),
        ("register", (ids, hashes)),
        ("block_of", (11,)),
        ("hash_of", (2,)),
        ("registrations", (ids,)),
        ("reference_counts", (ids,)),
        ("describe_state", (2,)),
        ("relocate", (ids, np.array([20, 21], dtype=np.int32))),
        ("evict", (1,)),
        ("evict_blocks", (ids,)),
        ("advance_clock", (1,)),
        ("hash_tokens", (tokens,)),
        ("admit_request", (tokens, row)),
        ("registered_chains", ()),
        ("counters", ()),
        ("free_ids", ()),
        ("take_changes", ()),
        ("find_problems", ()),
        ("memory_bytes", ()),
        ("release", (bad,)),
        ("lookup", (bad,)),
        ("evict_blocks", (bad,)),
        ("admit_request", (bad, row)),
    ]
    methods = {name for name in dir(_native.Engine) if not name.startswith("_")}
    attributes = {"num_free", "num_active", "num_paused", "num_holding_paused", "num_cached"}
    attributes |= {"num_registered", "clock", "num_usable", "paused_count", "active_count"}
    attributes |= {"group_depth", "block_size", "root_hash", "retains_unreferenced"}
    attributes |= {"can_pin", "pin_bound"}
    untested = {"reset", "open_group", "close_group", "set_retention", "has_retention"}
    assert methods - attributes - untested == {name for name, _ in calls}
    for name, args in calls:
        engine = _native.Engine(32, 4, "lru", True, block_size=4)
        engine.allocate(4)
        before = [sys.getrefcount(arg) for arg in args]
        for _ in range(50):
            with contextlib.suppress(PrefixCacheError):
                getattr(engine, name)(*args)
        assert [sys.getrefcount(arg) for arg in args] == before, name


def test_every_native_policy_method_leaves_its_arguments_refcounts_as_they_were() -> None:
    """Each method of ``_native.NativePolicy`` (an option-heavy one: priority), many calls."""
    from prefixcache.engine import _native  # here: the module is absent when not built

    big = 10**12 + 7  # not a cached small int: its count moves only by this test
    hashes = [big, big + 1]
    calls: list[tuple[str, tuple[object, ...]]] = [
        ("insert", (3, big, big, 1, 0)),
        ("touch", (3, big)),
        ("discard", (3,)),
        ("evict", (2,)),
        ("evicts_first", (4, big, big, 1, 0)),
        ("relocate", (3, 5, big, big, 1, 0)),
        ("on_register", (hashes, 0)),
        ("on_hit", (hashes,)),
        ("on_hit", (["x"],)),  # refused
        ("on_end", (hashes,)),
        ("on_end", (["x"],)),  # refused
        ("set_retention", (big, 2, big)),
        ("clear", ()),
        ("memory_bytes", ()),
        ("insert", (3, "x", 1, 1, 0)),  # refused
        ("__copy__", ()),
        ("__deepcopy__", ({},)),
    ]
    copies = {"__copy__", "__deepcopy__"}
    methods = {
        name for name in dir(_native.NativePolicy) if not name.startswith("_") or name in copies
    }
    assert methods == {name for name, _ in calls}
    for name, args in calls:
        policy = _native.NativePolicy("priority", 16)
        policy.insert(1, 101, 1, 1, 0)
        before = [sys.getrefcount(arg) for arg in args]
        for _ in range(50):
            with contextlib.suppress(PrefixCacheError, KeyError, TypeError):
                getattr(policy, name)(*args)
        assert [sys.getrefcount(arg) for arg in args] == before, name
