"""KV cache events recorded by the allocator: one per hash transition, after commit."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from prefixcache import KVBlockAllocator
from prefixcache.engine.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventLog,
    wire_hash,
)
from prefixcache.errors import ConfigError, HashConflictError, InvalidArgumentError

BLOCK = 4  # tokens a block, as the conftest allocator


@pytest.fixture
def events_on(make: Callable[..., KVBlockAllocator]) -> KVBlockAllocator:
    """An LRU allocator (15 usable blocks of 4 tokens, 4 pausable) recording up to 100 events."""
    return make(kv_events_capacity=100, paused_count=4)


def tokens(first: int, num_blocks: int) -> list[int]:
    return list(range(first, first + num_blocks * BLOCK))


def resident(allocator: KVBlockAllocator) -> set[int]:
    """Hashes the allocator holds, read through the public API."""
    return {block_hash for block_hash, _ in allocator.registry.items()}


def replay_events(events: list) -> set[int]:
    """The resident set a router would rebuild from ``events``."""
    held: set[int] = set()
    for event in events:
        if isinstance(event, BlockStored):
            assert not held & set(event.block_hashes), "a resident hash was announced again"
            held |= set(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= held, "removal of a hash never stored"
            held -= set(event.block_hashes)
        else:
            held.clear()
    return held


def test_events_off_by_default(allocator: KVBlockAllocator) -> None:
    with pytest.raises(ConfigError):
        allocator.take_events()
    with pytest.raises(ConfigError):
        allocator.snapshot()


def test_registration_records_one_stored_run(events_on: KVBlockAllocator) -> None:
    ids = events_on.allocate_memory_blocks(2)
    events_on.register_kv_block_hashes(ids, [11, 12], token_ids=tokens(0, 2), lora_name="ad")
    assert events_on.take_events() == [
        BlockStored((11, 12), None, tuple(tokens(0, 2)), BLOCK, lora_name="ad", medium="GPU")
    ]
    assert events_on.take_events() == []  # drained


def test_allocation_release_and_hits_record_nothing(events_on: KVBlockAllocator) -> None:
    ids = events_on.allocate_memory_blocks(2)
    events_on.register_kv_block_hashes(ids, [11, 12])
    events_on.take_events()
    events_on.release_memory_blocks(ids)  # LRU: cached, still resident
    hit = events_on.match_prefix([11, 12], acquire=True)
    events_on.pause(hit)
    events_on.resume(hit)
    assert len(hit) == 2
    assert events_on.take_events() == []


def test_stored_twice_is_announced_once(events_on: KVBlockAllocator) -> None:
    ids = events_on.allocate_memory_blocks(2)
    events_on.register_kv_block_hashes(ids, [11, 12])
    events_on.register_kv_block_hashes(ids, [11, 12])  # idempotent re-registration
    events_on.register_kv_block_hashes(ids[1:], [12], parent_hash=11)
    assert len(events_on.take_events()) == 1


def test_refused_duplicate_is_not_announced_and_chain_continues(
    events_on: KVBlockAllocator,
) -> None:
    first = events_on.allocate_memory_blocks(1)
    events_on.register_kv_block_hashes(first, [11])
    events_on.take_events()
    other = events_on.allocate_memory_blocks(2)
    registered = events_on.register_kv_block_hashes(other, [11, 12], token_ids=tokens(0, 2))
    assert registered.tolist() == [False, True]
    # Only the new hash, continuing the holder of 11, with its own tokens.
    assert events_on.take_events() == [
        BlockStored((12,), 11, tuple(tokens(BLOCK, 1)), BLOCK, medium="GPU")
    ]


def test_removal_only_when_the_hash_goes(events_on: KVBlockAllocator) -> None:
    ids = events_on.allocate_memory_blocks(2)
    events_on.register_kv_block_hashes(ids, [11, 12])
    twin = events_on.allocate_memory_blocks(1)
    events_on.register_kv_block_hashes(twin, [11])  # refused: 11 stays with ids[0]
    events_on.take_events()
    events_on.release_memory_blocks(twin)  # an unhashed block freed: no transition
    assert events_on.take_events() == []
    events_on.release_memory_blocks(ids)
    assert events_on.evict_cached_blocks(1) == 1  # the leaf 12 goes, 11 stays
    assert events_on.take_events() == [BlockRemoved((12,), "GPU")]
    assert events_on.evict_cached_blocks(1) == 1
    assert events_on.take_events() == [BlockRemoved((11,), "GPU")]


def test_ref_zero_release_drops_hashes(make: Callable[..., KVBlockAllocator]) -> None:
    allocator = make("ref_zero", kv_events_capacity=100)
    ids = allocator.allocate_memory_blocks(3)
    allocator.register_kv_block_hashes(ids, [11, 12, 13])
    allocator.take_events()
    allocator.release_memory_blocks(ids)
    events = allocator.take_events()
    assert len(events) == 1 and isinstance(events[0], BlockRemoved)
    assert set(events[0].block_hashes) == {11, 12, 13}
    assert events[0].block_hashes[0] == 13  # children before parents
    assert resident(allocator) == set()


def test_eviction_under_allocation_pressure(events_on: KVBlockAllocator) -> None:
    for chain in range(3):  # 3 chains of 5 blocks fill the 15 usable blocks
        ids = events_on.allocate_memory_blocks(5)
        hashes = [100 * chain + k + 1 for k in range(5)]
        events_on.register_kv_block_hashes(ids, hashes)
        events_on.release_memory_blocks(ids)
    events_on.take_events()
    assert events_on.allocate_memory_blocks(4) is not None
    removed = [h for e in events_on.take_events() for h in e.block_hashes]
    assert len(removed) == 4
    assert not set(removed) & resident(events_on)
    assert events_on.stats().num_evicted_blocks == 4


def test_evicting_a_pinned_parent_removes_the_held_children(
    events_on: KVBlockAllocator,
) -> None:
    parent = events_on.allocate_memory_blocks(1)
    events_on.register_kv_block_hashes(parent, [11])
    child = events_on.allocate_memory_blocks(1)
    events_on.register_kv_block_hashes(child, [12], parent_hash=11)
    events_on.release_memory_blocks(parent)  # cached with a referenced child: no leaf
    events_on.take_events()
    assert events_on.evict_cached_blocks(1) == 1
    assert events_on.take_events() == [BlockRemoved((12, 11), "GPU")]
    assert resident(events_on) == set()


def test_reset_records_all_cleared_and_snapshot_is_empty(events_on: KVBlockAllocator) -> None:
    ids = events_on.allocate_memory_blocks(2)
    events_on.register_kv_block_hashes(ids, [11, 12])
    events_on.reset()
    assert events_on.take_events()[-1] == AllBlocksCleared()
    assert events_on.snapshot() == []


def test_bounded_queue_drops_oldest_and_counts(make: Callable[..., KVBlockAllocator]) -> None:
    allocator = make(kv_events_capacity=2)
    for block_hash in (11, 12, 13):
        allocator.register_kv_block_hashes(allocator.allocate_memory_blocks(1), [block_hash])
    assert allocator.events is not None
    assert allocator.events.num_dropped == 1
    assert allocator.events.num_recorded == 3
    assert [e.block_hashes for e in allocator.take_events()] == [(12,), (13,)]


def test_snapshot_lists_parents_first_with_tokens(events_on: KVBlockAllocator) -> None:
    root = events_on.allocate_memory_blocks(2)
    events_on.register_kv_block_hashes(root, [11, 12], token_ids=tokens(0, 2), lora_name="ad")
    branch = events_on.allocate_memory_blocks(1)
    events_on.register_kv_block_hashes(branch, [21], parent_hash=11, token_ids=tokens(50, 1))
    snapshot = events_on.snapshot()
    order = [event.block_hashes[0] for event in snapshot]
    parents = {event.block_hashes[0]: event.parent_block_hash for event in snapshot}
    assert parents == {11: None, 12: 11, 21: 11}
    for block_hash, parent in parents.items():
        assert parent is None or order.index(parent) < order.index(block_hash)
    by_hash = {event.block_hashes[0]: event for event in snapshot}
    assert by_hash[12].token_ids == tuple(tokens(BLOCK, 1))
    assert by_hash[12].lora_name == "ad"
    assert by_hash[21].token_ids == tuple(tokens(50, 1))
    assert events_on.take_events() != []  # snapshot does not consume the queue


def test_events_rebuild_the_resident_set(events_on: KVBlockAllocator) -> None:
    log: list = []
    for round_ in range(6):
        ids = events_on.allocate_memory_blocks(4)
        hashes = [1000 * (round_ % 4) + k + 1 for k in range(4)]
        events_on.register_kv_block_hashes(ids, hashes)
        events_on.release_memory_blocks(ids)
        log += events_on.take_events()
        assert replay_events(log) == resident(events_on)


@pytest.mark.parametrize(
    ("width", "value"), [(128, (7 << 64) | 5), (256, (1 << 255) | (3 << 128) | (9 << 64) | 2)]
)
def test_wire_hash_folds_wide_hashes(width: int, value: int) -> None:
    words = [(value >> shift) & ((1 << 64) - 1) for shift in range(0, width, 64)]
    expected = 0
    for word in words:
        expected ^= word
    assert wire_hash(value) == (expected & ((1 << 63) - 1)) or 1
    assert 0 <= wire_hash(value) < 1 << 63
    assert wire_hash(12345) == 12345  # 63-bit hashes pass unchanged


def test_wide_hashes_reach_the_events_folded(make: Callable[..., KVBlockAllocator]) -> None:
    allocator = make(kv_events_capacity=10, hash_algo="xxh3_128")
    hashes = allocator.hash_tokens(tokens(0, 2))
    assert max(hashes) >= 1 << 64  # really wide
    allocator.register_kv_block_hashes(allocator.allocate_memory_blocks(2), hashes)
    (event,) = allocator.take_events()
    assert event.block_hashes == tuple(wire_hash(h) for h in hashes)
    assert all(0 <= h < 1 << 63 for h in event.block_hashes)


def test_failing_calls_record_nothing(events_on: KVBlockAllocator) -> None:
    ids = events_on.allocate_memory_blocks(2)
    events_on.register_kv_block_hashes(ids[:1], [11])
    events_on.take_events()
    with pytest.raises(HashConflictError):  # block 0 already carries 11
        events_on.register_kv_block_hashes(ids, [99, 12])
    with pytest.raises(HashConflictError):  # unknown parent, checked before any change
        events_on.register_kv_block_hashes(ids[1:], [12], parent_hash=777)
    with pytest.raises(InvalidArgumentError):  # wrong token count
        events_on.register_kv_block_hashes(ids[1:], [12], parent_hash=11, token_ids=[1, 2])
    assert events_on.take_events() == []
    assert resident(events_on) == {11}


def test_log_record_stored_splits_tokens_per_block() -> None:
    log = KVEventLog(capacity=4, block_size=2)
    log.record_stored([5, 6], None, [1, 2, 3, 4], None)
    snapshot_event = log.stored_event_for(6, 5)
    assert snapshot_event.token_ids == (3, 4)
    assert snapshot_event.parent_block_hash == 5
