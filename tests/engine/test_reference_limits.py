"""Counts never wrap: a reference past 2**31 - 1 is refused, hand-outs count in 64 bits.

Issue 28, item 3: reference counts and per-block hand-out counts were int32 in both engines
and wrapped after 2**31 references to one block (``check_invariants`` then reported a
negative count). Reference counts stay int32 (no request holds two billion references to
one block) and a call that would pass the limit is refused before anything changes, with
the same error on both engines; hand-out counts, which a hot system prompt passes within
days, are int64.
"""

from __future__ import annotations

import numpy as np
import pytest

from prefixcache import KVBlockAllocator, ReferenceCountError
from prefixcache.engine.native_engine import native_available
from prefixcache.testing import changed_fields, state_digest

LIMIT = 2**31 - 1
PAST_THE_LIMIT = "2\\*\\*31 - 1"


def test_python_engine_refuses_a_reference_past_the_limit() -> None:
    allocator = KVBlockAllocator(total_count=8, paused_count=2, device="cpu", engine="python")
    (block,) = allocator.allocate_memory_blocks(1).tolist()
    allocator._engine.refs.active[block] = LIMIT - 2  # white box: 2**31 calls take minutes
    before = state_digest(allocator)
    with pytest.raises(ReferenceCountError, match=PAST_THE_LIMIT):
        allocator.acquire_blocks([block, block, block])
    with pytest.raises(ReferenceCountError, match=PAST_THE_LIMIT):
        allocator.acquire_blocks(np.array([block] * 3))
    after = state_digest(allocator)
    assert after == before, changed_fields(before, after)
    allocator.acquire_blocks([block, block])  # exactly to the limit
    assert allocator.reference_counts([block])[0].tolist() == [LIMIT]


@pytest.mark.slow  # the full suite (--full)
@pytest.mark.skipif(not native_available(), reason="the native engine is not built")
def test_native_engine_refuses_a_reference_past_the_limit() -> None:
    allocator = KVBlockAllocator(total_count=8, paused_count=2, device="cpu", engine="native")
    (block,) = allocator.allocate_memory_blocks(1).tolist()
    chunk = np.full(2**26, block, dtype=np.int32)  # 256 MiB, acquired 31 times then a part
    held = 1
    while held + len(chunk) <= LIMIT:
        allocator.acquire_blocks(chunk)
        held += len(chunk)
    before = state_digest(allocator)
    with pytest.raises(ReferenceCountError, match=PAST_THE_LIMIT):
        allocator.acquire_blocks(chunk[: LIMIT - held + 1])
    after = state_digest(allocator)
    assert after == before, changed_fields(before, after)
    allocator.acquire_blocks(chunk[: LIMIT - held])  # exactly to the limit
    assert allocator.reference_counts([block])[0].tolist() == [LIMIT]
    allocator.check_invariants()
