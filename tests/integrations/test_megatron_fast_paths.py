"""The Megatron drop-in's native fast paths against its facade path (runs without megatron-core).

On the native engine the drop-in calls the engine directly (allocation,
release, pins written as ``block_ref_counts[ids] += 1``, timestamps,
registration); on the Python engine every call goes through the
:class:`prefixcache.KVBlockAllocator` facade. Both engines hand out the same
IDs in the same order, so the same program must leave every mirror equal,
and both must refuse the same bad input without changing anything.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.engine.native_engine import native_available
from prefixcache.errors import BlockStateError, InvalidArgumentError, ReferenceCountError
from prefixcache.integrations.megatron import MegatronKVBlockAllocator
from prefixcache.testing.megatron_requests import add_request

if not native_available():
    pytest.skip("the native engine is not built", allow_module_level=True)

ENGINES = ("python", "native")
MIRRORS = (
    "block_ref_counts",
    "block_hashes",
    "block_timestamps",
    "block_parent_id",
    "block_child_count",
)


class ClockContext:
    """The two things these calls read from Megatron's context."""

    def __init__(self) -> None:
        self.prefix_cache_lru_clock = 0
        self.block_size_tokens = 4


def build(engine: str, policy: str = "lru", total: int = 12) -> MegatronKVBlockAllocator:
    allocator = MegatronKVBlockAllocator(
        ClockContext(),
        total_count=total,
        paused_count=2,
        enable_prefix_caching=True,
        prefix_caching_eviction_policy=policy,
        engine=engine,
    )
    assert allocator.allocator.engine == engine
    return allocator


def state(allocator: MegatronKVBlockAllocator) -> dict[str, Any]:
    seen = {name: getattr(allocator, name).tolist() for name in MIRRORS if hasattr(allocator, name)}
    seen["kv_hash_to_block_id"] = dict(allocator.kv_hash_to_block_id)
    seen["total_avail"] = allocator.total_avail
    seen["evictable"] = int(allocator.get_evictable_block_count())
    return seen


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["lru", "ref_zero"]),
    st.lists(
        st.tuples(
            st.sampled_from(["admit", "finish", "unpin"]),
            st.lists(st.integers(1, 4), min_size=1, max_size=5),
        ),
        max_size=30,
    ),
)
def test_both_engines_leave_the_same_mirrors_after_every_step(policy: str, steps: list) -> None:
    allocators = [build(engine, policy) for engine in ENGINES]
    dropped: list[list[tuple[list[int], set[int]]]] = [[], []]
    for allocator, calls in zip(allocators, dropped, strict=True):
        allocator.on_blocks_deregistered = lambda ids, hashes, calls=calls: calls.append(
            (ids, hashes)
        )
    running: list[list[torch.Tensor]] = [[], []]
    for action, tokens in steps:
        hashes = [int("".join(map(str, tokens[: k + 1]))) for k in range(len(tokens))]
        results = []
        for allocator, held in zip(allocators, running, strict=True):
            if action == "admit" or not held:
                got = add_request(allocator, hashes)
                if got is not None:
                    held.append(got)
                results.append(None if got is None else got.tolist())
            elif action == "finish":
                allocator.release_memory_blocks(held.pop(0))
            else:  # a request's references dropped by a tensor write (its IDs are distinct)
                allocator.block_ref_counts[held.pop(0)] -= 1
        assert results[:1] == results[1:]  # the same IDs, or both short
        assert state(allocators[0]) == state(allocators[1])
        assert dropped[0] == dropped[1]
        for allocator in allocators:
            allocator.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_repeated_id_in_a_pin_takes_one_reference_as_a_tensor_write_does(engine: str) -> None:
    allocator = build(engine)
    held = add_request(allocator, [1, 2])
    assert held is not None
    first = held[:1]
    allocator.block_ref_counts[torch.cat([first, first])] += 1
    assert allocator.block_ref_counts[held].tolist() == [2, 1]
    allocator.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("by_write", [True, False])
def test_a_last_release_in_ref_zero_mode_calls_back_after_the_counts_drop(
    engine: str, by_write: bool
) -> None:
    allocator = build(engine, "ref_zero")
    calls: list[tuple[list[int], set[int], list[int]]] = []
    allocator.on_blocks_deregistered = lambda ids, hashes: calls.append(
        (sorted(ids), hashes, allocator.block_ref_counts[ids].tolist())
    )
    held = add_request(allocator, [7, 8])
    assert held is not None
    if by_write:
        allocator.block_ref_counts[held] -= 1
    else:
        allocator.release_memory_blocks(held)
    # Megatron's release drops the counts, then calls on_blocks_deregistered.
    assert calls == [(sorted(held.tolist()), {7, 8}, [0, 0])]
    assert allocator.kv_hash_to_block_id == {} and allocator.total_avail == 11
    assert allocator.block_hashes[held].tolist() == [-1, -1]
    allocator.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
def test_refused_pins_and_counts_change_nothing(engine: str) -> None:
    allocator = build(engine)
    held = add_request(allocator, [1, 2])
    assert held is not None
    allocator.release_memory_blocks(held)  # both cached now
    before = state(allocator)
    with pytest.raises(ReferenceCountError):
        allocator.block_ref_counts[held] -= 1
    with pytest.raises(BlockStateError):
        allocator.block_ref_counts[torch.tensor([5, 6])] += 1  # free blocks
    for bad in (-1, "3", True, 2.0):
        with pytest.raises(InvalidArgumentError):
            allocator.allocate_memory_blocks(bad)
    with pytest.raises(InvalidArgumentError):
        allocator.register_kv_block_hashes([0], [0])  # 0 is Megatron's root sentinel
    assert state(allocator) == before
    assert allocator.allocate_memory_blocks(0).dtype == torch.int32
    allocator.check_consistency()
