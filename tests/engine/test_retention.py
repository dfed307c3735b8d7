"""set_retention_priority through the allocator: pinning a prefix, expiry, refusals."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from prefixcache import (
    ConfigError,
    InvalidArgumentError,
    KVBlockAllocator,
    PrefixCacheError,
    compute_block_hashes,
)

BLOCK_SIZE = 2


def cached_prompts(allocator: KVBlockAllocator, *prompts: list[int]) -> list[list[int]]:
    """Serve and release each prompt in turn, so each ends cached; return their hashes."""
    chains = []
    for prompt in prompts:
        hashes = compute_block_hashes(prompt, BLOCK_SIZE)
        ids = allocator.allocate_memory_blocks(len(hashes))
        allocator.register_kv_block_hashes(ids, hashes)
        allocator.release_memory_blocks(ids)
        chains.append(hashes)
    return chains


def make(**policy_args: Any) -> KVBlockAllocator:
    return KVBlockAllocator(
        total_count=5,  # four usable blocks: two cached chains of two fill the pool
        block_size_tokens=BLOCK_SIZE,
        device="cpu",
        eviction_policy={"name": "priority", "max_retained_fraction": 1.0, **policy_args},
    )


def test_a_pinned_prefix_outlives_a_newer_one() -> None:
    allocator = make()
    system, other = cached_prompts(allocator, [1, 2, 3, 4], [5, 6, 7, 8])
    allocator.set_retention_priority(system, 90)
    assert allocator.allocate_memory_blocks(2) is not None  # LRU would take the older chain
    assert all(allocator.is_hash_registered(h) for h in system)
    assert not any(allocator.is_hash_registered(h) for h in other)


def test_without_a_pin_the_older_prefix_goes() -> None:
    allocator = make()
    system, other = cached_prompts(allocator, [1, 2, 3, 4], [5, 6, 7, 8])
    allocator.allocate_memory_blocks(2)
    assert not any(allocator.is_hash_registered(h) for h in system)
    assert all(allocator.is_hash_registered(h) for h in other)


def test_a_pin_expires_after_its_duration() -> None:
    allocator = make(clock=None)
    system, other = cached_prompts(allocator, [1, 2, 3, 4], [5, 6, 7, 8])
    allocator.set_retention_priority(system, 90, duration=2)
    allocator.advance_clock(3)
    allocator.update_timestamps(allocator.match_prefix(other))  # lets the policy see the clock
    allocator.allocate_memory_blocks(2)
    assert not any(allocator.is_hash_registered(h) for h in system)


def test_a_pin_set_before_the_prefix_is_cached_applies_when_it_is() -> None:
    allocator = make()
    system = compute_block_hashes([1, 2, 3, 4], BLOCK_SIZE)
    allocator.set_retention_priority(system, 90)
    cached_prompts(allocator, [1, 2, 3, 4], [5, 6, 7, 8])
    allocator.allocate_memory_blocks(2)
    assert all(allocator.is_hash_registered(h) for h in system)


@pytest.mark.parametrize(
    ("hashes", "priority", "duration"),
    [
        ("abc", 90, None),
        ([1.5], 90, None),
        ([7], 9.5, None),
        ([7], True, None),
        ([7], 90, -1),
        ([7], 90, 2.0),
        ([7], 90, False),
    ],
)
def test_malformed_arguments_are_refused_and_change_nothing(
    hashes: Any, priority: Any, duration: Any, digest: Callable[[KVBlockAllocator], Any]
) -> None:
    allocator = make()
    cached_prompts(allocator, [1, 2, 3, 4])
    before = digest(allocator)
    with pytest.raises(PrefixCacheError):
        allocator.set_retention_priority(hashes, priority, duration=duration)
    assert digest(allocator) == before


def test_a_policy_without_priorities_refuses() -> None:
    allocator = KVBlockAllocator(total_count=5, device="cpu")
    with pytest.raises(ConfigError, match="does not support retention priorities"):
        allocator.set_retention_priority([7], 90)


def test_a_bad_priority_is_an_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError, match="priority must be an int"):
        make().set_retention_priority([7], "high")  # type: ignore[arg-type]
