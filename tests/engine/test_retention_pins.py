"""Retention pins: durations may be zero and are checked, a pin holds until it expires.

``tests/MUTATION.md`` lists the mutants these tests kill and the survivors that are equivalent.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from prefixcache import KVBlockAllocator

Chain = Callable[..., list[int]]


# ---------------------------------------------------------------------- retention


def test_retention_durations_may_be_zero_and_are_checked() -> None:
    allocator = KVBlockAllocator(
        total_count=8, block_size_tokens=2, device="cpu", eviction_policy="priority"
    )
    allocator.set_retention_priority([11], 5, duration=0)
    with pytest.raises(Exception, match=r"^duration must be an int in \[0, \d+\], got -1$"):
        allocator.set_retention_priority([11], 5, duration=-1)
    with pytest.raises(
        Exception,
        match=r"^block_hashes must be a sequence of ints or a 1-D integer tensor, got str$",
    ):
        allocator.set_retention_priority("ab", 5)


def test_a_pin_holds_until_its_duration_has_passed(chain: Chain) -> None:
    allocator = KVBlockAllocator(
        total_count=8, block_size_tokens=2, device="cpu", eviction_policy="priority"
    )
    (pinned,) = chain(allocator, [11])
    allocator.advance_clock()
    (other,) = chain(allocator, [21])
    allocator.release_memory_blocks([pinned, other])
    allocator.set_retention_priority([11], 90, duration=10)
    allocator.update_timestamps([other])  # lets the policy see the clock, well before expiry
    assert allocator.evict_cached_blocks(1) == 1
    assert allocator.is_hash_registered(11) and not allocator.is_hash_registered(21)
