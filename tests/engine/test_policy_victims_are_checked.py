"""A policy's victims are checked, and the ref-zero policy tracks nothing.

A victim that is not a cached leaf (active, inner, past the pool, negative)
is refused; the ref-zero policy refuses every call that would track a block.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prefixcache.policies import LRUPolicy, RefZeroPolicy

from prefixcache import (
    InvariantError,
    KVBlockAllocator,
)

Make = Callable[..., KVBlockAllocator]


class VictimOfChoice(LRUPolicy):
    """An LRU that names a fixed block as its victim, right or wrong."""

    def __init__(self, victim: int) -> None:
        super().__init__()
        self.victim = victim

    def evict(self, num_blocks: int) -> list[int]:
        super().evict(num_blocks)
        return [self.victim]


# ---------------------------------------------------------------------- policies


@pytest.mark.parametrize("victim", [0, 1, 99, -1], ids=["active", "inner", "past", "negative"])
def test_a_victim_that_is_not_a_cached_leaf_is_refused(victim: int, make_small: Make) -> None:
    allocator = make_small(VictimOfChoice(victim))
    allocator.allocate_memory_blocks(1)  # block 0 stays active
    chain = allocator.allocate_memory_blocks(2)  # blocks 1 (inner) and 2 (leaf)
    allocator.register_kv_block_hashes(chain, [11, 12])
    allocator.release_memory_blocks(chain)
    with pytest.raises(InvariantError, match=r"chose \[.*\], not one cached leaf"):
        allocator.evict_cached_blocks(1)


def test_ref_zero_refuses_to_track_anything() -> None:
    policy = RefZeroPolicy()
    with pytest.raises(RuntimeError):
        policy.insert(1, 11, 0, 1, 0)
    with pytest.raises(KeyError):
        policy.discard(1)
    with pytest.raises(KeyError):
        policy.touch(1, 5)
    assert policy.evict(3) == [] and len(policy) == 0 and 1 not in policy
