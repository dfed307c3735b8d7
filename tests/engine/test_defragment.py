"""Defragmentation (issue 17 part 5; DESIGN.md, "Defragmentation").

A hypothesis state machine serves requests from an allocator (each engine,
each free list) with a real :class:`KVCache` and :class:`BlockTable`: every
block is written with a unique value when handed out, prefix hits share
registered blocks, requests finish and blocks are evicted, and now and then
the pool is defragmented (plan, copy, relocate, rewrite the table) or a stale
plan is refused. After every step a shadow model says what each running
request's table row must read and what every registered hash's block must
hold, and the allocator's invariants hold. Unit tests pin the refusals
(nothing changes), the policy's order, routing and the fragmentation figure.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixcache import KVBlockAllocator
from prefixcache.engine.defragment import DefragmentPlan, largest_free_run, plan_compaction
from prefixcache.engine.native_engine import native_available
from prefixcache.errors import BlockStateError, ConfigError, InvalidArgumentError
from prefixcache.serving.block_table import BlockTable
from prefixcache.serving.kv_cache import KVCache
from prefixcache.testing import changed_fields, state_digest

TOTAL_COUNT = 16
ENGINES = [
    "python",
    pytest.param(
        "native",
        marks=pytest.mark.skipif(not native_available(), reason="the native engine is not built"),
    ),
]


class DefragmentMachine(RuleBasedStateMachine):
    """Requests over a KV cache and a block table, defragmented at random; a shadow model."""

    engine = "python"
    free_list = "stack"
    policy = "lru"

    @initialize()
    def build(self) -> None:
        self.allocator = KVBlockAllocator(
            total_count=TOTAL_COUNT,
            device="cpu",
            engine=self.engine,
            free_list=self.free_list,
            eviction_policy=self.policy,
            block_size_tokens=1,
        )
        self.cache = KVCache(
            1, TOTAL_COUNT, block_size=1, k_heads=1, k_head_dim=1, dtype=torch.float32, device="cpu"
        )
        self.table = BlockTable(8, TOTAL_COUNT, self.allocator.dummy_block_id, device="cpu")
        self.values = itertools.count(1)
        self.content: dict[int, float] = {}  # hash -> the value its block holds
        self.chains: list[list[int]] = []  # registered hash chains, to hit again
        self.rows: dict[int, list[float]] = {}  # slot -> the values its row must read
        self.next_hash = itertools.count(1)

    # ------------------------------------------------------------------ serving

    @precondition(lambda self: self.table.num_free_slots > 0)
    @rule(count=st.integers(1, 5), register=st.booleans(), data=st.data())
    def new_request(self, count: int, register: bool, data: st.DataObject) -> None:
        prefix: list[int] = []
        hit = torch.empty(0, dtype=torch.int32)
        if self.chains and data.draw(st.booleans()):
            chain = data.draw(st.sampled_from(self.chains))
            prefix = chain[: data.draw(st.integers(1, len(chain)))]
            hit = self.allocator.match_prefix(prefix, acquire=True)
            prefix = prefix[: len(hit)]
        ids = self.allocator.allocate_memory_blocks(count)
        if ids is None:
            if len(hit):
                self.allocator.release_memory_blocks(hit)
            return
        values = [float(next(self.values)) for _ in range(count)]
        fill = torch.tensor(values, dtype=torch.float32).reshape(count, 1, 1)
        self.cache.write(0, ids, [0] * count, fill, fill)
        expected = [self.content[h] for h in prefix] + values
        if register:
            hashes = [next(self.next_hash) for _ in range(count)]
            parent = prefix[-1] if prefix else None
            self.allocator.register_kv_block_hashes(ids, hashes, parent_hash=parent)
            self.content.update(zip(hashes, values, strict=True))
            self.chains.append(prefix + hashes)
        slot = self.table.add_request(torch.cat((hit, ids)))
        self.rows[slot] = expected

    @precondition(lambda self: bool(self.rows))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.rows)))
        self.allocator.release_memory_blocks(self.table.remove_request(slot))
        del self.rows[slot]

    @rule(count=st.integers(1, 4))
    def evict(self, count: int) -> None:
        self.allocator.evict_cached_blocks(count)

    # ------------------------------------------------------------------ layout

    @rule()
    def defragment(self) -> None:
        plan = self.allocator.plan_defragment()
        assert self.allocator.apply_defragment(plan, copy=self.cache.copy_blocks) == len(plan)
        self.table.apply_moves(plan.sources, plan.destinations)
        stats = self.allocator.stats()
        assert stats.largest_free_run == stats.num_free and stats.fragmentation == 0.0
        assert sorted(self.allocator._engine.free_ids().tolist()) == list(
            range(stats.num_usable - stats.num_free, stats.num_usable)
        )

    @rule()
    def stale_plan_is_refused(self) -> None:
        plan = self.allocator.plan_defragment()
        taken = self.allocator.allocate_memory_blocks(1)
        if taken is None:
            return
        before = state_digest(self.allocator)
        kv_before = self.cache.k_caches[0].clone()
        if int(taken[0]) in plan.destinations.tolist():
            with pytest.raises(BlockStateError):
                self.allocator.apply_defragment(plan, copy=self.cache.copy_blocks)
            assert torch.equal(self.cache.k_caches[0], kv_before)  # refused before the copy
            after = state_digest(self.allocator)
            assert after == before, changed_fields(before, after)
        self.allocator.release_memory_blocks(taken)

    # ------------------------------------------------------------------ the shadow model

    @invariant()
    def rows_read_their_values(self) -> None:
        self.allocator.check_invariants()
        for slot, expected in self.rows.items():
            keys, _ = self.cache.gather(0, self.table.blocks_of(slot))
            assert keys.flatten().tolist() == expected

    @invariant()
    def every_hash_maps_to_its_content(self) -> None:
        for block_hash, value in self.content.items():
            block_id = self.allocator._engine.block_of(block_hash)
            if block_id is not None:
                assert self.cache.k_caches[0][block_id].item() == value


def _machine(engine: str, free_list: str, policy: str) -> type[DefragmentMachine]:
    return type(
        f"Defragment_{engine}_{free_list}_{policy}",
        (DefragmentMachine,),
        {"engine": engine, "free_list": free_list, "policy": policy},
    )


@pytest.mark.slow  # the full suite (--full)
@pytest.mark.parametrize("policy", ["lru", "fifo", "ref_zero"])
@pytest.mark.parametrize("free_list", ["stack", "lowest"])
@pytest.mark.parametrize("engine", ENGINES)
def test_defragmentation_keeps_every_block_content_and_table(
    engine: str, free_list: str, policy: str
) -> None:
    machine = _machine(engine, free_list, policy)
    machine.TestCase.settings = settings(
        max_examples=25,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    machine.TestCase().runTest()


# ---------------------------------------------------------------------- units


def _scattered(engine: str, **config: object) -> KVBlockAllocator:
    """Blocks 0..9 handed out; 1, 3, 5 freed; 6..9 a cached chain; 0, 2, 4 running."""
    allocator = KVBlockAllocator(
        total_count=13, device="cpu", engine=engine, block_size_tokens=1, **config
    )
    ids = allocator.allocate_memory_blocks(10)
    allocator.register_kv_block_hashes(ids[6:], [11, 12, 13, 14])
    allocator.release_memory_blocks(ids[[1, 3, 5, 6, 7, 8, 9]])
    return allocator


def test_plan_moves_the_live_blocks_past_the_live_count_into_the_holes() -> None:
    plan = plan_compaction(np.array([1, 3, 5, 10, 11], dtype=np.int32), 12)
    assert plan.moves == [(7, 1), (8, 3), (9, 5)]  # 7 live blocks: 0..6 after
    assert largest_free_run(np.array([1, 3, 5, 10, 11]), 12) == 2
    assert largest_free_run(np.array([], dtype=np.int32), 12) == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_cached_chain_keeps_its_hashes_links_and_eviction_order(engine: str) -> None:
    allocator = _scattered(engine)
    plan = allocator.plan_defragment()
    assert plan.moves == [(7, 1), (8, 3), (9, 5)]
    chains_before = allocator._engine.registered_chains()
    assert allocator.stats().fragmentation == pytest.approx(3 / 5)  # free 1, 3, 5, 10-11
    allocator.apply_defragment(plan)
    allocator.check_invariants()
    assert allocator._engine.registered_chains() == chains_before
    assert [allocator._engine.block_of(h) for h in (11, 12, 13, 14)] == [6, 1, 3, 5]
    assert allocator.match_prefix([11, 12, 13, 14]).tolist() == [6, 1, 3, 5]
    assert allocator.stats().fragmentation == 0.0
    # The chain is still eaten from its end: the leaf (hash 14, now block 5) goes first.
    assert allocator.evict_cached_blocks(1) == 1
    assert allocator._engine.block_of(14) is None and allocator._engine.block_of(13) == 3


@pytest.mark.parametrize("engine", ENGINES)
def test_refused_plans_change_nothing(engine: str) -> None:
    allocator = _scattered(engine)
    before = state_digest(allocator)
    copies: list[tuple[list[int], list[int]]] = []

    def copy(sources: torch.Tensor, destinations: torch.Tensor) -> None:
        copies.append((sources.tolist(), destinations.tolist()))

    refusals = [
        (DefragmentPlan(np.array([1], np.int32), np.array([3], np.int32)), BlockStateError),
        (DefragmentPlan(np.array([0], np.int32), np.array([2], np.int32)), BlockStateError),
        (
            DefragmentPlan(np.array([0, 2], np.int32), np.array([1, 1], np.int32)),
            InvalidArgumentError,
        ),
        (DefragmentPlan(np.array([0], np.int32), np.array([0], np.int32)), InvalidArgumentError),
        (DefragmentPlan(np.array([0, 2], np.int32), np.array([1], np.int32)), InvalidArgumentError),
        (DefragmentPlan(np.array([12], np.int32), np.array([1], np.int32)), Exception),
        ([(0, 1)], InvalidArgumentError),
    ]
    for plan, error in refusals:
        with pytest.raises(error):
            allocator.apply_defragment(plan, copy=copy)  # type: ignore[arg-type]
    with allocator.free_group(), pytest.raises(BlockStateError, match="free group"):
        allocator.apply_defragment(allocator.plan_defragment(), copy=copy)
    assert copies == []  # every refusal came before the copy

    def failing_copy(sources: torch.Tensor, destinations: torch.Tensor) -> None:
        raise RuntimeError("device out of memory")

    with pytest.raises(RuntimeError):
        allocator.apply_defragment(allocator.plan_defragment(), copy=failing_copy)
    after = state_digest(allocator)
    assert after == before, changed_fields(before, after)


@pytest.mark.parametrize("engine", ENGINES)
def test_routing_moves_with_its_block(engine: str) -> None:
    allocator = _scattered(engine, routing_num_layers=1, routing_top_k=1)
    allocator.store_block_routing(4, np.array([[[7]]], dtype=np.int16))
    plan = DefragmentPlan(np.array([4], np.int32), np.array([1], np.int32))
    allocator.apply_defragment(plan)
    assert allocator.get_block_routing(4) is None
    assert allocator.get_block_routing(1).flatten().tolist() == [7]


@pytest.mark.parametrize("policy", ["lru", "fifo"])
@pytest.mark.parametrize("engine", ENGINES)
def test_relocated_leaves_keep_their_eviction_order(engine: str, policy: str) -> None:
    """Touched in reverse ID order, the leaves are evicted against ID order, before and after."""
    allocator = KVBlockAllocator(
        total_count=9, device="cpu", engine=engine, eviction_policy=policy, block_size_tokens=1
    )
    ids = allocator.allocate_memory_blocks(8)
    for position, block_id in enumerate(ids.tolist()[4:]):
        allocator.register_kv_block_hashes([block_id], [100 + position])
    for block_id in ids.tolist()[7:3:-1]:
        allocator.update_timestamps([block_id])  # 103 oldest, 100 newest
    allocator.release_memory_blocks(ids)
    plan = allocator.plan_defragment()
    assert plan.moves == [(4, 0), (5, 1), (6, 2), (7, 3)]
    allocator.apply_defragment(plan)
    gone: list[int] = []
    for _ in range(4):
        assert allocator.evict_cached_blocks(1) == 1
        gone += [
            p for p in range(4) if allocator._engine.block_of(100 + p) is None and p not in gone
        ]
    assert gone == [3, 2, 1, 0]


def test_legacy_policy_is_refused() -> None:
    class Legacy:
        def __init__(self) -> None:
            self.tracked: list[int] = []

        def insert(self, block_id: int, *args: int) -> None:
            self.tracked.append(block_id)

        def discard(self, block_id: int) -> None:
            self.tracked.remove(block_id)

        def touch(self, block_id: int, now: int) -> None:
            pass

        def evict(self, num_blocks: int) -> list[int]:
            victims, self.tracked = self.tracked[:num_blocks], self.tracked[num_blocks:]
            return victims

        def clear(self) -> None:
            self.tracked.clear()

        def __len__(self) -> int:
            return len(self.tracked)

        def __contains__(self, block_id: object) -> bool:
            return block_id in self.tracked

    with pytest.warns(DeprecationWarning):
        allocator = _scattered("python", eviction_policy=Legacy())
    with pytest.raises(ConfigError, match="EvictionPolicy"):
        allocator.apply_defragment(allocator.plan_defragment())


def test_block_table_and_kv_cache_follow_the_moves() -> None:
    table = BlockTable(3, 4, dummy_block_id=9, device="cpu")
    first = table.add_request([5, 7])
    second = table.add_request([8, 2, 7])
    assert table.apply_moves([7, 8], [0, 1]) == 3
    assert table.blocks_of(first).tolist() == [5, 0]
    assert table.blocks_of(second).tolist() == [1, 2, 0]
    assert table.device_table[first].tolist() == [5, 0, 9, 9]
    with pytest.raises(InvalidArgumentError):
        table.apply_moves([1, 2], [3, 3])
    with pytest.raises(InvalidArgumentError):
        table.apply_moves([1], [3, 4])
    assert table.blocks_of(second).tolist() == [1, 2, 0]
    cache = KVCache(2, 6, block_size=2, k_heads=1, k_head_dim=1, dtype=torch.float32, device="cpu")
    for layer in range(2):
        cache.k_caches[layer][:, :, 0, 0] = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    cache.copy_blocks([4, 5], [0, 1])
    assert cache.k_caches[1][:2].flatten().tolist() == [8.0, 9.0, 10.0, 11.0]
    with pytest.raises(InvalidArgumentError):
        cache.copy_blocks([6], [0])
    with pytest.raises(InvalidArgumentError):
        cache.copy_blocks([1, 2], [0])
