"""Registration's general path: runs of new hashes, their depths, events, repeats.

Extending a registered prefix hangs the new blocks under its end; a chain
continued from a cached leaf takes it out of the policy; new hashes are
split into runs with their depths (and appended to the last run, with the
LoRA name on their events); a hash repeated in one call is held by its first
block (a bug this found, now fixed); the snapshot lists parents first; with
prefix caching off, registration returns false flags.

``tests/MUTATION.md`` lists the mutants these tests kill and the survivors that are equivalent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from prefixcache.policies import LRUPolicy

from prefixcache import KVBlockAllocator
from prefixcache.engine.events import wire_hash

Make = Callable[..., KVBlockAllocator]
Chain = Callable[..., list[int]]


def _events_allocator(**kwargs: Any) -> KVBlockAllocator:
    return KVBlockAllocator(
        total_count=12, block_size_tokens=2, device="cpu", kv_events_capacity=100, **kwargs
    )


class RegistrationLog(LRUPolicy):
    """LRU that records the registration hook's calls."""

    def __init__(self) -> None:
        super().__init__()
        self.registered: list[tuple[list[int], int]] = []

    def on_register(self, block_hashes: list[int], first_depth: int) -> None:
        self.registered.append((list(block_hashes), first_depth))


# ---------------------------------------------------------------------- registration


def test_extending_a_registered_prefix_hangs_the_new_blocks_under_its_end(chain: Chain) -> None:
    allocator = _events_allocator(kv_events_medium="CPU_TIER")
    first, second = chain(allocator, [11, 12])
    (third,) = allocator.allocate_memory_blocks(1).tolist()
    allocator.take_events()
    held = allocator.register_kv_block_hashes(
        [first, second, third], [11, 12, 13], token_ids=[1, 2, 3, 4, 5, 6], lora_name="a"
    )
    assert held.dtype == torch.bool and held.tolist() == [True, True, True]
    assert int(allocator.registry.parent_of[third]) == second
    (event,) = allocator.take_events()
    assert event.block_hashes == (wire_hash(13),)
    assert event.parent_block_hash == wire_hash(12)
    assert event.token_ids == (5, 6) and event.lora_name == "a" and event.medium == "CPU_TIER"


def test_a_chain_continued_from_a_cached_leaf_takes_it_out_of_the_policy(chain: Chain) -> None:
    allocator = _events_allocator()
    (parent,) = chain(allocator, [11])
    allocator.release_memory_blocks([parent])
    assert parent in allocator.policy
    (child,) = allocator.allocate_memory_blocks(1).tolist()
    allocator.take_events()
    allocator.register_kv_block_hashes([child], [12], parent_hash=11)
    assert parent not in allocator.policy
    (event,) = allocator.take_events()
    assert event.parent_block_hash == wire_hash(11)
    allocator.check_invariants()


def test_the_general_path_splits_new_hashes_into_runs_with_their_depths(chain: Chain) -> None:
    policy = RegistrationLog()
    allocator = _events_allocator(eviction_policy=policy)
    (root,) = chain(allocator, [10])
    (holder,) = chain(allocator, [12], parent_hash=10)
    ids = allocator.allocate_memory_blocks(5).tolist()
    allocator.take_events()
    policy.registered.clear()
    # 11 new under the root block; 12 held by `holder`; 13, 14 new under it; 14 again.
    held = allocator.register_kv_block_hashes(
        ids, [11, 12, 13, 14, 14], parent_hash=10, token_ids=list(range(10))
    )
    assert held.tolist() == [True, False, True, True, False]
    assert policy.registered == [([11], 1), ([13, 14], 2)]
    events = allocator.take_events()
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in events] == [
        ((wire_hash(11),), wire_hash(10), (0, 1)),
        ((wire_hash(13), wire_hash(14)), wire_hash(12), (4, 5, 6, 7)),
    ]
    assert int(allocator.registry.parent_of[ids[0]]) == root
    assert int(allocator.registry.parent_of[ids[2]]) == holder
    assert int(allocator.registry.parent_of[ids[3]]) == ids[2]


def test_a_hash_repeated_in_one_call_is_held_by_its_first_block(chain: Chain) -> None:
    policy = RegistrationLog()
    allocator = KVBlockAllocator(
        total_count=8, block_size_tokens=2, device="cpu", eviction_policy=policy
    )
    (root,) = chain(allocator, [10])
    refused, first, second, third = allocator.allocate_memory_blocks(4).tolist()
    policy.registered.clear()
    held = allocator.register_kv_block_hashes([refused, first, second, third], [10, 11, 11, 12])
    assert held.tolist() == [False, True, False, True]
    assert policy.registered == [([11], 1), ([12], 2)]
    assert int(allocator.registry.parent_of[first]) == root
    assert int(allocator.registry.parent_of[third]) == first
    allocator.check_invariants()


def test_a_hash_repeated_in_a_fresh_chain_is_held_by_its_first_block(make_small: Make) -> None:
    allocator = make_small(LRUPolicy())
    first, second, third = allocator.allocate_memory_blocks(3).tolist()
    held = allocator.register_kv_block_hashes([first, second, third], [11, 11, 12])
    assert held.tolist() == [True, False, True]
    allocator.check_invariants()


def test_the_snapshot_lists_parents_before_children_whatever_their_hashes(chain: Chain) -> None:
    allocator = _events_allocator()
    chain(allocator, [50, 10, 30])
    snapshot = allocator.snapshot()
    assert [event.block_hashes for event in snapshot] == [
        (wire_hash(50),),
        (wire_hash(10),),
        (wire_hash(30),),
    ]
    assert [event.parent_block_hash for event in snapshot] == [None, wire_hash(50), wire_hash(10)]


def test_with_prefix_caching_off_registration_returns_false_flags() -> None:
    allocator = KVBlockAllocator(
        total_count=8, block_size_tokens=2, device="cpu", enable_prefix_caching=False
    )
    ids = allocator.allocate_memory_blocks(2)
    held = allocator.register_kv_block_hashes(ids, [1, 2])
    assert held.dtype == torch.bool and held.tolist() == [False, False]


# ---------------------------------------------------------------------- retention


def test_the_general_path_appends_to_the_last_run_and_keeps_the_lora_name(chain: Chain) -> None:
    policy = RegistrationLog()
    allocator = _events_allocator(eviction_policy=policy)
    chain(allocator, [21])
    chain(allocator, [22])
    ids = allocator.allocate_memory_blocks(6).tolist()
    allocator.take_events()
    policy.registered.clear()
    held = allocator.register_kv_block_hashes(ids, [31, 21, 33, 22, 35, 36], lora_name="a")
    assert held.tolist() == [True, False, True, False, True, True]
    assert policy.registered == [([31], 0), ([33], 1), ([35, 36], 1)]
    events = allocator.take_events()
    assert [event.block_hashes for event in events] == [
        (wire_hash(31),),
        (wire_hash(33),),
        (wire_hash(35), wire_hash(36)),
    ]
    assert [event.lora_name for event in events] == ["a"] * 3
