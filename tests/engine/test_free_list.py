"""The lowest-first free list (issue 17 part 4; DESIGN.md, "Locality").

A hypothesis state machine drives :class:`SortedFreeList` at several page
sizes against a naive model of the documented hand-out order; unit tests pin
the order through the allocator on both engines, the evicting path, the
configuration's refusals and the engine choice. The differential test
(tests/native/test_differential.py) checks that both engines hand out the
same IDs in lowest-first mode, with and without pages, step by step.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from prefixcache import AllocatorConfig, KVBlockAllocator
from prefixcache.engine.free_list import SortedFreeList
from prefixcache.engine.native_engine import native_available
from prefixcache.errors import CapacityError, ConfigError, InvalidArgumentError

ENGINES = [
    "python",
    pytest.param(
        "native",
        marks=pytest.mark.skipif(not native_available(), reason="the native engine is not built"),
    ),
]


def model_acquire(free: set[int], count: int, page_size: int, num_usable: int) -> list[int]:
    """The documented order, computed the slow way: whole pages, partly used pages, broken pages."""
    num_pages = -(-num_usable // page_size)

    def blocks(page: int) -> range:
        return range(page * page_size, min(page * page_size + page_size, num_usable))

    whole = [
        page
        for page in range(num_pages)
        if len(blocks(page)) == page_size and all(b in free for b in blocks(page))
    ]
    num_whole = min(count // page_size, len(whole))
    taken = [b for page in whole[:num_whole] for b in blocks(page)]
    in_whole = {b for page in whole for b in blocks(page)}
    partial = sorted(b for b in free if b not in in_whole)
    taken += partial[: count - len(taken)]
    for page in whole[num_whole:]:
        if len(taken) == count:
            break
        taken += list(blocks(page))[: count - len(taken)]
    return taken


class FreeListMachine(RuleBasedStateMachine):
    """SortedFreeList against a set and :func:`model_acquire`."""

    @initialize(total_count=st.integers(2, 26), page_size=st.integers(1, 4))
    def build(self, total_count: int, page_size: int) -> None:
        self.free_list = SortedFreeList(total_count, "cpu", page_size=page_size)
        self.num_usable = total_count - 1
        self.page_size = page_size
        self.free = set(range(self.num_usable))
        self.held: list[int] = []

    @rule(data=st.data())
    def acquire(self, data: st.DataObject) -> None:
        count = data.draw(st.integers(0, len(self.free)))
        expected = model_acquire(self.free, count, self.page_size, self.num_usable)
        got = self.free_list.acquire(count)
        assert got.dtype == np.int32
        assert got.tolist() == expected
        self.free -= set(expected)
        self.held += expected

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if not self.held:
            return
        chosen = data.draw(st.lists(st.sampled_from(self.held), unique=True, max_size=8))
        self.free_list.release(np.asarray(chosen, dtype=np.int32))
        self.free |= set(chosen)
        self.held = [b for b in self.held if b not in chosen]

    @rule(data=st.data())
    def rebuild(self, data: st.DataObject) -> None:
        free = data.draw(st.sets(st.integers(0, self.num_usable - 1)))
        self.free_list.rebuild(np.asarray(sorted(free), dtype=np.int32))
        self.free = set(free)
        self.held = [b for b in range(self.num_usable) if b not in free]

    @rule()
    def acquire_too_many(self) -> None:
        with pytest.raises(CapacityError):
            self.free_list.acquire(len(self.free) + 1)

    @invariant()
    def same_free_set(self) -> None:
        assert self.free_list.num_free == len(self.free)
        assert self.free_list.free_ids().tolist() == sorted(self.free, reverse=True)
        whole = sum(
            1
            for page in range(self.num_usable // self.page_size)
            if all(
                b in self.free for b in range(page * self.page_size, (page + 1) * self.page_size)
            )
        )
        assert self.free_list.free_pages() == whole


FreeListMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFreeListMachine = FreeListMachine.TestCase


@pytest.mark.parametrize("engine", ENGINES)
def test_lowest_first_hands_out_the_lowest_free_ids_ascending(engine: str) -> None:
    allocator = KVBlockAllocator(total_count=17, device="cpu", engine=engine, free_list="lowest")
    first = allocator.allocate_memory_blocks(6)
    assert first.tolist() == [0, 1, 2, 3, 4, 5]
    allocator.release_memory_blocks(first[[1, 3, 4]])
    assert allocator.allocate_memory_blocks(4).tolist() == [1, 3, 4, 6]
    stack = KVBlockAllocator(total_count=17, device="cpu", engine=engine)
    ids = stack.allocate_memory_blocks(6)
    stack.release_memory_blocks(ids[[1, 3, 4]])
    assert stack.allocate_memory_blocks(4).tolist() != [1, 3, 4, 6]  # LIFO: 4, 3, 1, 6
    allocator.check_invariants()


@pytest.mark.parametrize("engine", ENGINES)
def test_evicting_allocation_goes_through_the_list_in_order(engine: str) -> None:
    allocator = KVBlockAllocator(
        total_count=9, device="cpu", engine=engine, free_list="lowest", block_size_tokens=1
    )
    ids = allocator.allocate_memory_blocks(8)
    hashes = allocator.hash_tokens(list(range(4)))
    allocator.register_kv_block_hashes(ids[4:], hashes)
    allocator.release_memory_blocks(ids[4:])  # 4..7 cached
    allocator.release_memory_blocks(ids[[2, 0]])  # 0, 2 free
    got = allocator.allocate_memory_blocks(4)  # 2 free + 2 evicted (the chain's tail: 7, 6)
    assert got.tolist() == [0, 2, 6, 7]
    allocator.check_invariants()


def test_page_aligned_requests_start_at_whole_pages_and_small_ones_fill_holes() -> None:
    allocator = KVBlockAllocator(
        total_count=17, device="cpu", free_list="lowest", page_size_blocks=4
    )
    assert allocator.engine == "python"
    one = allocator.allocate_memory_blocks(1)  # breaks page 0
    assert one.tolist() == [0]
    run = allocator.allocate_memory_blocks(5)  # page 1 whole, then the hole in page 0
    assert run.tolist() == [4, 5, 6, 7, 1]
    pages = allocator.allocate_memory_blocks(8)
    assert pages.tolist() == [8, 9, 10, 11, 12, 13, 14, 15]
    allocator.check_invariants()


def test_free_list_configuration_is_checked() -> None:
    with pytest.raises(ConfigError, match="free_list"):
        AllocatorConfig(total_count=8, free_list="sorted")
    with pytest.raises(ConfigError, match="page_size_blocks"):
        AllocatorConfig(total_count=8, page_size_blocks=0)
    with pytest.raises(ConfigError, match="needs free_list='lowest'"):
        AllocatorConfig(total_count=8, page_size_blocks=2)
    with pytest.raises(ConfigError):
        SortedFreeList(8, "cpu", page_size=0)


@pytest.mark.skipif(not native_available(), reason="the native engine is not built")
def test_both_engines_hand_out_pages_alike_and_auto_runs_native() -> None:
    allocators = [
        KVBlockAllocator(
            total_count=21, device="cpu", engine=engine, free_list="lowest", page_size_blocks=4
        )
        for engine in ("python", "native")
    ]
    orders = []
    for allocator in allocators:
        order = [allocator.allocate_memory_blocks(n).tolist() for n in (1, 5, 3)]
        allocator.release_memory_blocks(order[1][:2])
        order += [allocator.allocate_memory_blocks(n).tolist() for n in (6, 2)]
        orders.append(order)
        assert allocator._engine.find_problems() == []
    assert orders[0] == orders[1]
    assert orders[0][:2] == [[0], [4, 5, 6, 7, 1]]
    paged = KVBlockAllocator(total_count=9, device="cpu", free_list="lowest", page_size_blocks=2)
    assert paged.engine in ("native", "python")  # PREFIXCACHE_ENGINE may force python


def test_sorted_free_list_refuses_bad_counts_before_changing() -> None:
    free_list = SortedFreeList(6, "cpu")
    with pytest.raises(InvalidArgumentError):
        free_list.acquire(-1)
    with pytest.raises(InvalidArgumentError):
        free_list.acquire(1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        free_list.release(np.arange(1, dtype=np.int32))  # nothing is handed out
    assert free_list.num_free == 5
    assert free_list.free_ids().tolist() == [4, 3, 2, 1, 0]
