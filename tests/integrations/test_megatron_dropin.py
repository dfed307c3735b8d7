"""The Megatron drop-in against a fake context: runs without megatron-core.

The fake context has only what Megatron's allocator reads from a
``DynamicInferenceContext`` (the LRU clock, the block size, the request
tables, the token-to-block tables). The pins are written the way Megatron's
``add_request`` writes them: ``block_ref_counts[ids] += 1``.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import types
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.errors import (
    BlockStateError,
    ConfigError,
    InvalidArgumentError,
    InvariantError,
    ReferenceCountError,
)
from prefixcache.integrations import megatron
from prefixcache.integrations.megatron import (
    MegatronCompatAllocator,
    MegatronKVBlockAllocator,
    PrefixCachePolicy,
)
from prefixcache.testing.megatron_requests import add_request

LRU_ONLY = ("block_timestamps", "block_parent_id", "block_child_count")
CACHING_ONLY = ("block_hashes", "kv_hash_to_block_id", "block_ref_counts")


class FakeContext:
    """What Megatron's allocator reads from its context, nothing more."""

    def __init__(self, max_requests: int = 4, max_blocks: int = 8, block_size: int = 4) -> None:
        self.prefix_cache_lru_clock = 0
        self.block_size_tokens = block_size
        self.paused_request_count = 0
        self.total_request_count = 0
        self.request_to_kv_block_ids = torch.full((max_requests, max_blocks), -1, dtype=torch.int32)
        self.request_kv_block_counts = torch.zeros(max_requests, dtype=torch.int32)
        self.active_token_count = 0
        self.token_to_block_idx = torch.zeros(64, dtype=torch.int32)
        self.token_to_local_position_within_kv_block = torch.zeros(64, dtype=torch.int32)


def build(policy: Any = "lru", total: int = 9, caching: bool = True, **options: Any):
    context = FakeContext()
    allocator = MegatronKVBlockAllocator(
        context,
        total_count=total,
        paused_count=2,
        enable_prefix_caching=caching,
        prefix_caching_eviction_policy=policy,
        **options,
    )
    return context, allocator


def serve(allocator: MegatronKVBlockAllocator, hashes: list[int]) -> torch.Tensor:
    """Megatron's add_request for a prompt of full blocks; MemoryError when the pool is short."""
    block_ids = add_request(allocator, hashes)
    if block_ids is None:
        raise MemoryError
    return block_ids


# ---------------------------------------------------------------------- the surface


@pytest.mark.parametrize(
    ("policy", "caching", "present", "absent"),
    [
        ("lru", True, CACHING_ONLY + LRU_ONLY, ()),
        ("ref_zero", True, CACHING_ONLY, LRU_ONLY),
        ("lru", False, (), CACHING_ONLY + LRU_ONLY),
        (PrefixCachePolicy("s3fifo"), True, CACHING_ONLY + LRU_ONLY, ()),
    ],
)
def test_attributes_exist_in_the_modes_megatron_has_them(policy, caching, present, absent) -> None:
    _, allocator = build(policy, caching=caching)
    for name in present:
        assert hasattr(allocator, name), name
    for name in absent:
        assert not hasattr(allocator, name), name
    assert (allocator.total_count, allocator.total_avail) == (9, 8)
    assert (allocator.active_count, allocator.paused_count, allocator.dummy_block_idx) == (6, 2, 8)
    assert allocator.on_blocks_deregistered is None and allocator.block_routing == {}


def test_tensors_have_megatrons_dtypes_on_the_cpu() -> None:
    _, allocator = build()
    dtypes = {
        "block_ref_counts": torch.int32,
        "block_hashes": torch.int64,
        "block_timestamps": torch.int64,
        "block_parent_id": torch.int64,
        "block_child_count": torch.int64,
    }
    for name, dtype in dtypes.items():
        tensor = getattr(allocator, name)
        assert tensor.dtype == dtype and tensor.device.type == "cpu" and tensor.shape == (9,)
    assert allocator.block_hashes.eq(-1).all() and allocator.block_parent_id.eq(-1).all()
    assert allocator.block_bag.dtype == torch.int32
    assert allocator.get_evictable_block_count().dtype == torch.int64


def test_allocation_returns_int32_or_none_when_short() -> None:
    _, allocator = build(caching=False)
    ids = allocator.allocate_memory_blocks(5)
    assert ids is not None and ids.dtype == torch.int32 and len(set(ids.tolist())) == 5
    assert 8 not in ids.tolist()  # the dummy block is never handed out
    assert allocator.allocate_memory_blocks(4) is None
    assert allocator.total_avail == 3 and allocator.get_total_used() == 5
    allocator.release_memory_blocks(ids)
    allocator.release_memory_blocks(torch.tensor([], dtype=torch.int32))
    assert allocator.total_avail == 8
    assert not allocator.evict_lru_blocks(1) and allocator.evict_lru_blocks(0)


def test_a_double_release_is_refused_where_megatron_would_corrupt_its_stack() -> None:
    _, allocator = build(caching=False)
    ids = allocator.allocate_memory_blocks(2)
    allocator.release_memory_blocks(ids)
    with pytest.raises(ReferenceCountError):
        allocator.release_memory_blocks(ids)
    assert allocator.total_avail == 8


def test_usage_is_read_from_the_context_tables() -> None:
    context, allocator = build(caching=False)
    context.total_request_count, context.paused_request_count = 3, 1
    context.request_kv_block_counts[:3] = torch.tensor([2, 3, 1], dtype=torch.int32)
    assert (allocator.get_paused_used(), allocator.get_active_used()) == (2, 4)
    assert (allocator.get_paused_avail(), allocator.get_active_avail()) == (0, 2)
    _, caching = build()
    caching.context.total_request_count, caching.context.paused_request_count = 2, 1
    caching.context.request_to_kv_block_ids[:2, :2] = torch.tensor([[1, 2], [2, 3]])
    assert (caching.get_paused_used(), caching.get_active_used()) == (2, 2)
    caching.context.total_request_count = caching.context.paused_request_count = 0
    assert caching.get_active_used() == caching.get_paused_used() == 0
    assert str(caching) == "using: total 0/8; active 0/6; paused 0/2"


# ---------------------------------------------------------------------- prefix caching


def test_lru_mode_caches_released_blocks_and_a_pin_hits_them() -> None:
    _, allocator = build()
    first = serve(allocator, [11, 12, 13])
    assert allocator.block_ref_counts[first].tolist() == [1, 1, 1]
    assert allocator.block_hashes[first].tolist() == [11, 12, 13]
    assert allocator.block_parent_id[first].tolist() == [-1, *first[:2].tolist()]
    assert allocator.block_child_count[first].tolist() == [1, 1, 0]
    allocator.release_memory_blocks(first)
    assert int(allocator.get_evictable_block_count()) == 3 and allocator.total_avail == 5
    second = serve(allocator, [11, 12, 99])
    assert second[:2].tolist() == first[:2].tolist()
    assert allocator.block_ref_counts[second].tolist() == [1, 1, 1]
    assert allocator.block_timestamps[second[:2]].tolist() == [1, 1]
    allocator.check_consistency()


def test_eviction_goes_through_the_policy_and_updates_the_mirrors() -> None:
    _, allocator = build()
    seen: list[tuple[list[int], set[int]]] = []
    allocator.on_blocks_deregistered = lambda ids, hashes: seen.append((ids, hashes))
    first = serve(allocator, [1, 2, 3, 4])
    allocator.release_memory_blocks(first)
    second = serve(allocator, [5, 6, 7, 8])  # takes the other four free blocks
    allocator.release_memory_blocks(second)
    assert allocator.total_avail == 0 and allocator.is_memory_available(8)
    assert not allocator.is_memory_available(8, potential_matched_count=1)
    third = allocator.allocate_memory_blocks(2)
    assert third is not None
    assert seen == [([int(first[3]), int(first[2])], {3, 4})]  # oldest chain, from its leaf
    assert set(allocator.kv_hash_to_block_id) == {1, 2, 5, 6, 7, 8}
    assert allocator.block_child_count[first[1]] == 0
    assert allocator.block_ref_counts[third].tolist() == [1, 1]
    allocator.check_consistency()
    assert allocator.evict_lru_blocks(2) and not allocator.evict_lru_blocks(9)
    allocator.check_consistency()


def test_ref_zero_mode_deregisters_at_the_last_release() -> None:
    _, allocator = build("ref_zero")
    first = serve(allocator, [1, 2])
    second = serve(allocator, [1, 2, 3])
    assert allocator.block_ref_counts[first].tolist() == [2, 2]
    allocator.release_memory_blocks(first)
    assert set(allocator.kv_hash_to_block_id) == {1, 2, 3}
    allocator.release_memory_blocks(second)
    assert allocator.kv_hash_to_block_id == {} and allocator.total_avail == 8
    assert not allocator.is_memory_available(9)
    allocator.update_timestamps(first)  # a no-op in ref-zero mode, as Megatron's
    allocator.check_consistency()


def test_a_failed_allocation_rolls_the_pin_back_as_add_request_does() -> None:
    _, allocator = build()
    held = serve(allocator, [1, 2, 3])
    allocator.release_memory_blocks(held[2:])
    with pytest.raises(MemoryError):
        serve(allocator, [1, 2, 9, 10, 11, 12, 13, 14, 15])
    assert allocator.block_ref_counts[held].tolist() == [1, 1, 0]
    allocator.check_consistency()


def test_a_pin_on_a_free_block_is_refused_and_undone() -> None:
    _, allocator = build()
    with pytest.raises(BlockStateError):
        allocator.block_ref_counts[torch.tensor([3])] += 1
    assert allocator.block_ref_counts.sum() == 0
    held = serve(allocator, [1])
    with pytest.raises(ReferenceCountError):
        allocator.block_ref_counts[held] -= 2
    assert allocator.block_ref_counts[held].tolist() == [1]


def test_a_write_that_takes_and_drops_at_once_is_undone_whole_when_the_drop_fails() -> None:
    _, allocator = build()
    a, b = serve(allocator, [1]), serve(allocator, [2])
    index = torch.cat([a, b])
    with pytest.raises(ReferenceCountError):
        allocator.block_ref_counts[index] = torch.tensor([3, -1], dtype=torch.int32)
    assert allocator.block_ref_counts[index].tolist() == [1, 1]
    allocator.block_ref_counts[index] = torch.tensor([2, 0], dtype=torch.int32)
    assert int(allocator.get_evictable_block_count()) == 1
    allocator.check_consistency()


def test_registration_splits_runs_and_roots_an_unknown_parent() -> None:
    _, allocator = build()
    ids = allocator.allocate_memory_blocks(4)
    allocator.register_kv_block_hashes(ids.tolist(), [1, 2, 3, 4], [0, 1, 77, 3])
    assert allocator.block_parent_id[ids].tolist() == [-1, int(ids[0]), -1, int(ids[2])]
    allocator.register_kv_block_hashes([], [])
    with pytest.raises(InvalidArgumentError):
        allocator.register_kv_block_hashes([1, 2], [5])
    other = allocator.allocate_memory_blocks(1)
    allocator.register_kv_block_hashes(other.tolist(), [1])  # held by ids[0]: stays there
    assert allocator.kv_hash_to_block_id[1] == int(ids[0]) and allocator.block_hashes[other] == -1
    allocator.register_kv_block_hashes(ids[:1].tolist(), [1])  # again: idempotent
    assert allocator.block_child_count[ids[0]] == 1
    allocator.check_consistency()


def test_registration_does_nothing_without_prefix_caching() -> None:
    _, allocator = build(caching=False)
    ids = allocator.allocate_memory_blocks(1)
    allocator.register_kv_block_hashes(ids.tolist(), [5], [0])
    assert allocator.stats().num_registered == 0


def test_reset_returns_every_mirror_to_its_start() -> None:
    _, allocator = build()
    serve(allocator, [1, 2])
    allocator.block_routing[0] = np.zeros(1)
    allocator.reset()
    assert allocator.total_avail == 8 and allocator.kv_hash_to_block_id == {}
    assert allocator.block_ref_counts.sum() == 0 and allocator.block_hashes.eq(-1).all()
    assert allocator.block_timestamps.sum() == 0 and allocator.block_routing == {}
    allocator.check_consistency()
    _, ref_zero = build("ref_zero")
    serve(ref_zero, [1])
    ref_zero.reset()
    ref_zero.check_consistency()


def test_block_bag_lists_the_free_blocks_first() -> None:
    _, allocator = build()
    held = serve(allocator, [1, 2])
    allocator.release_memory_blocks(held[1:])
    bag = allocator.block_bag
    assert sorted(bag.tolist()) == list(range(9)) and bag[-1] == 8
    assert set(bag[: allocator.total_avail].tolist()).isdisjoint(held.tolist())


def test_check_consistency_notices_a_mirror_written_behind_its_back() -> None:
    _, allocator = build()
    held = serve(allocator, [1, 2])
    allocator._ref_counts[held[0]] = 5
    with pytest.raises(InvariantError, match="block_ref_counts"):
        allocator.check_consistency()
    allocator._ref_counts[held[0]] = 1
    allocator.kv_hash_to_block_id[42] = 0
    with pytest.raises(InvariantError, match="kv_hash_to_block_id"):
        allocator.check_consistency()
    del allocator.kv_hash_to_block_id[42]
    allocator.block_hashes[0] = 7
    with pytest.raises(InvariantError, match="block_hashes"):
        allocator.check_consistency()
    build(caching=False)[1].check_consistency()


# ---------------------------------------------------------------------- prefixcache's side


def test_a_prefixcache_policy_is_selected_by_a_value_equal_to_megatrons_lru() -> None:
    choice = PrefixCachePolicy({"name": "s3fifo"})
    assert choice == "lru" and repr(choice) == "PrefixCachePolicy({'name': 's3fifo'})"
    _, allocator = build(choice)
    assert type(allocator.allocator.policy).__name__ == "S3FIFOPolicy"
    _, default = build("lru", cached_policy="fifo")
    assert type(default.allocator.policy).__name__ == "FIFOPolicy"
    with pytest.raises(ConfigError):
        PrefixCachePolicy("ref_zero")


def test_bad_policies_and_options_are_refused() -> None:
    with pytest.raises(ConfigError, match="REF_ZERO or LRU"):
        build("mru")
    with pytest.raises(ConfigError, match="unknown options"):
        build(colour="red")


def test_events_and_stats_come_from_the_backing_allocator() -> None:
    _, allocator = build(kv_events_capacity=16)
    held = serve(allocator, [1, 2])
    allocator.release_memory_blocks(held)
    assert allocator.evict_lru_blocks(2)
    kinds = [type(event).__name__ for event in allocator.take_events()]
    assert kinds == ["BlockStored", "BlockRemoved"]
    assert allocator.stats().num_evicted_blocks == 2
    allocator.reset()
    assert [type(event).__name__ for event in allocator.take_events()] == ["AllBlocksCleared"]
    _, quiet = build()
    with pytest.raises(ConfigError, match="events are off"):
        quiet.take_events()


# ---------------------------------------------------------------------- MoE routing


def test_routing_is_stored_per_block_and_reconstructed_in_order() -> None:
    context, allocator = build()
    ids = allocator.allocate_memory_blocks(2).tolist()
    context.active_token_count = 6
    context.token_to_block_idx[:6] = torch.tensor([ids[0]] * 4 + [ids[1], 8])
    context.token_to_local_position_within_kv_block[:6] = torch.tensor([0, 1, 2, 3, 0, 0])
    routing = np.arange(6 * 2 * 1).reshape(6, 2, 1)
    allocator.store_routing_per_block(routing)
    assert set(allocator.block_routing) == set(ids)  # the dummy block stores nothing
    rebuilt = allocator.reconstruct_routing_from_blocks(ids, 5)
    assert rebuilt is not None and rebuilt.tolist() == routing[:5].tolist()
    assert allocator.reconstruct_routing_from_blocks(ids, 4).tolist() == routing[:4].tolist()
    assert allocator.reconstruct_routing_from_blocks(ids, 9) is None
    assert allocator.reconstruct_routing_from_blocks([3], 1) is None
    assert allocator.reconstruct_routing_from_blocks([], 0) is None
    allocator.store_routing_per_block(None)
    with pytest.raises(InvalidArgumentError):
        allocator.store_routing_per_block(routing[:2])
    context.active_token_count = 0
    allocator.store_routing_per_block(routing)
    allocator.release_memory_blocks(torch.tensor(ids, dtype=torch.int32))
    again = allocator.allocate_memory_blocks(8)
    assert again is not None and allocator.block_routing == {}  # stale routing dropped


# ---------------------------------------------------------------------- a random program


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["lru", "ref_zero", PrefixCachePolicy("slru")]),
    st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(1, 4), min_size=1, max_size=4)),
        max_size=25,
    ),
)
def test_mirrors_match_the_allocator_after_every_step(policy: Any, steps: list) -> None:
    _, allocator = build(policy, total=12)
    running: list[torch.Tensor] = []
    for finish, tokens in steps:
        if finish and running:
            allocator.release_memory_blocks(running.pop(0))
        else:
            hashes = [int("".join(map(str, tokens[: k + 1]))) for k in range(len(tokens))]
            with contextlib.suppress(MemoryError):
                running.append(serve(allocator, hashes))
        allocator.check_consistency()
        held = torch.cat(running) if running else torch.tensor([], dtype=torch.int32)
        expected = torch.zeros(12, dtype=torch.int32).scatter_add_(
            0, held.long(), torch.ones_like(held)
        )
        assert torch.equal(allocator.block_ref_counts, expected)


# ---------------------------------------------------------------------- switching


def test_install_needs_megatron_core(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise megatron.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(megatron.importlib.metadata, "version", missing)
    with pytest.raises(ConfigError, match="not installed"):
        megatron.install()
    monkeypatch.setattr(megatron.importlib.metadata, "version", lambda name: "0.20.0")
    with pytest.raises(ConfigError, match=r"supports megatron-core 0\.19\.x; found 0\.20\.0"):
        megatron.install()


def _fake_megatron(monkeypatch: pytest.MonkeyPatch) -> tuple[type, list[types.ModuleType]]:
    class Original:
        pass

    names = [
        "megatron",
        "megatron.core",
        "megatron.core.inference",
        "megatron.core.inference.contexts",
        "megatron.core.inference.contexts.kv_block_allocator",
        "megatron.core.inference.contexts.dynamic_context",
    ]
    modules = [types.ModuleType(name) for name in names]
    for parent, child in itertools.pairwise(modules):
        setattr(parent, child.__name__.rpartition(".")[2], child)
    for module in modules[3:]:
        module.KVBlockAllocator = Original  # type: ignore[attr-defined]
    for module in modules:
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(megatron.importlib.metadata, "version", lambda name: "0.19.2")
    return Original, modules[3:]


def test_install_replaces_every_binding_and_uninstall_puts_them_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original, bound = _fake_megatron(monkeypatch)
    with pytest.raises(ConfigError, match="unknown options"):
        megatron.install(colour="red")
    with megatron.installed(strict=True, cached_policy="fifo", engine="python"):
        assert all(module.KVBlockAllocator is MegatronKVBlockAllocator for module in bound)
        _, allocator = build("lru")
        assert type(allocator.allocator.policy).__name__ == "FIFOPolicy"
        assert allocator.allocator.engine == "python"
        megatron.install()  # again: new options and the default, compat mode, bound everywhere
        assert all(module.KVBlockAllocator is MegatronCompatAllocator for module in bound)
        assert type(build("lru")[1].allocator.policy).__name__ == "LRUPolicy"
    assert all(module.KVBlockAllocator is original for module in bound)
    _, allocator = build("lru")
    assert type(allocator.allocator.policy).__name__ == "LRUPolicy"


def test_attach_switches_an_idle_context_and_keeps_its_callback() -> None:
    context, old = build("ref_zero")
    context.kv_block_allocator = old

    def callback(ids: list[int], hashes: set[int]) -> None:
        pass

    old.on_blocks_deregistered = callback
    new = megatron.attach(context)
    assert context.kv_block_allocator is new and new.on_blocks_deregistered is callback
    assert (new.total_count, new.paused_count, new.prefix_caching_eviction_policy) == (
        9,
        2,
        "ref_zero",
    )
    new.allocate_memory_blocks(1)
    with pytest.raises(ConfigError, match="holds 1 blocks"):
        megatron.attach(context)


def test_without_prefix_caching_every_call_still_answers() -> None:
    _, allocator = build(caching=False)
    assert allocator.is_memory_available(8) and not allocator.is_memory_available(9)
    ids = allocator.allocate_memory_blocks(3)
    assert allocator.block_bag[:5].tolist() == sorted(set(range(8)) - set(ids.tolist()))
    allocator.store_block_routing(0, np.array([0]), np.ones((1, 2, 1)))
    allocator.store_block_routing(0, np.array([1]), np.ones((1, 2, 1)))
    assert allocator.get_block_routing(0)[:2].sum() == 4
    allocator.reset()
    assert allocator.total_avail == 8 and allocator.block_routing == {}


@pytest.mark.parametrize("index", [3, slice(3, 5), np.int64(3)], ids=["int", "slice", "np-int"])
def test_in_place_writes_by_int_or_slice_reach_the_allocator(index: Any) -> None:
    """Issue 28, item 9: ``t[i] += k`` with a basic index used to write a view of the mirror
    before ``__setitem__`` saw it, so the mirror and the allocator disagreed silently."""
    _, allocator = build()
    allocator.allocate_memory_blocks(8)  # every usable block held once
    block_ids = torch.arange(9)[index].reshape(-1).tolist()  # the mirror is indexed by ID
    allocator.block_ref_counts[index] += 1  # an extra reference each
    counts = allocator.allocator.reference_counts(block_ids)[0].tolist()
    assert counts == [2] * len(block_ids)
    assert allocator.block_ref_counts[torch.tensor(block_ids)].tolist() == counts
    allocator.block_ref_counts[index] -= 1
    assert allocator.allocator.reference_counts(block_ids)[0].tolist() == [1] * len(block_ids)
    allocator.check_consistency()


@pytest.mark.parametrize(("total", "paused"), [(10, 9), (10, 12), (2, 1)])
def test_no_active_block_left_is_refused_as_megatron_asserts(total: int, paused: int) -> None:
    with pytest.raises(ConfigError, match="active_count"):
        MegatronKVBlockAllocator(FakeContext(), total_count=total, paused_count=paused)
