"""Issue 15, item 3: the paused partition never holds more blocks than its budget.

A block held by a running and a paused request counts as active; when the
running request releases it, it becomes paused-only without any check. So the
budget bounds every block holding a paused reference, checked when the pause
gives a block its first one: the pause of a block a running request still
holds is refused when the budget is full, and no later release can overflow
it. ``get_paused_avail()`` says what is left (never clamped: it cannot go
negative), ``check_invariants()`` catches a ledger over the budget.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import BudgetExceededError, KVBlockAllocator
from prefixcache.errors import InvariantError
from prefixcache.testing import changed_fields, state_digest


def paused_books_agree(allocator: KVBlockAllocator) -> None:
    used, avail, budget = (
        allocator.get_paused_used(),
        allocator.get_paused_avail(),
        allocator.paused_count,
    )
    assert used <= budget, f"{used} paused blocks over a budget of {budget}"
    assert avail >= 0 and used + avail <= budget, f"used {used}, avail {avail}, budget {budget}"


@pytest.mark.parametrize("engine", ["python", "native"])
@pytest.mark.parametrize("grouped", [False, True])
def test_releasing_the_running_holder_of_paused_blocks(engine: str, grouped: bool) -> None:
    allocator = KVBlockAllocator(total_count=10, paused_count=1, device="cpu", engine=engine)
    shared = allocator.allocate_memory_blocks(2)
    allocator.acquire_blocks(shared)  # a second request holds both blocks
    with pytest.raises(BudgetExceededError):
        allocator.pause(shared)  # two blocks would hold paused references, budget 1
    assert allocator.get_paused_avail() == 1  # the refusal changed nothing
    allocator.pause(shared[:1])  # it fits: one block, still held by the running request
    paused_books_agree(allocator)
    if grouped:
        with allocator.free_group():
            allocator.release_memory_blocks(shared)
    else:
        allocator.release_memory_blocks(shared)  # the running holder finishes
    paused_books_agree(allocator)
    assert (allocator.get_paused_used(), allocator.get_paused_avail()) == (1, 0)
    allocator.check_invariants()


OPERATIONS = st.lists(
    st.tuples(st.sampled_from(["allocate", "acquire", "pause", "resume", "release"]), st.data()),
    max_size=25,
)


@pytest.mark.parametrize("engine", ["python", "native"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=OPERATIONS, paused_count=st.integers(0, 3))
def test_no_sequence_puts_the_paused_partition_over_budget(
    engine: str, operations: list[tuple[str, st.DataObject]], paused_count: int
) -> None:
    allocator = KVBlockAllocator(
        total_count=10, paused_count=paused_count, device="cpu", engine=engine
    )
    active: list[int] = []  # one entry per active reference held
    paused: list[int] = []
    for name, data in operations:
        if name == "allocate":
            ids = allocator.allocate_memory_blocks(data.draw(st.integers(0, 3)))
            active += [] if ids is None else ids.tolist()
            continue
        pool = paused if name in ("resume",) else active
        if not pool:
            continue
        picks = data.draw(st.lists(st.sampled_from(range(len(pool))), unique=True, min_size=1))
        taken = [pool[i] for i in picks]
        before = state_digest(allocator)
        try:
            if name == "acquire":
                allocator.acquire_blocks(taken)
                active += taken
            elif name == "release":
                allocator.release_memory_blocks(taken)
                for block in taken:
                    active.remove(block)
            elif name == "pause":
                allocator.pause(taken)
                for block in taken:
                    active.remove(block)
                paused += taken
            else:
                allocator.resume(taken)
                for block in taken:
                    paused.remove(block)
                active += taken
        except BudgetExceededError:  # only a pause or a resume can be refused here
            assert name in ("pause", "resume")
            after = state_digest(allocator)
            assert after == before, changed_fields(before, after)
        paused_books_agree(allocator)
        allocator.check_invariants()


# The bookkeeping the fix rests on (lands first): both engines count the blocks
# holding any paused reference, and ``check_invariants`` pins the count.


@pytest.mark.parametrize("engine", ["python", "native"])
def test_blocks_holding_paused_references_are_counted_on_both_engines(engine: str) -> None:
    allocator = KVBlockAllocator(total_count=10, paused_count=3, device="cpu", engine=engine)
    shared = allocator.allocate_memory_blocks(2)
    allocator.acquire_blocks(shared)
    allocator.pause(shared[:1])  # one block held active and paused
    allocator.check_invariants()
    with allocator.free_group():
        allocator.release_memory_blocks(shared)  # the running holders finish
    allocator.check_invariants()
    allocator.resume(shared[:1])
    allocator.pause(shared[:1])
    allocator.release_memory_blocks(shared[:1], paused=True)  # the paused reference leaves
    allocator.check_invariants()
    allocator.reset()
    allocator.check_invariants()


def test_the_python_ledger_follows_each_transition() -> None:
    allocator = KVBlockAllocator(total_count=10, paused_count=3, device="cpu", engine="python")
    ledger = allocator._engine.ledger
    shared = allocator.allocate_memory_blocks(2)
    allocator.acquire_blocks(shared)
    allocator.pause(shared)
    assert (ledger.num_paused, ledger.num_holding_paused) == (0, 2)
    allocator.release_memory_blocks(shared[:1])
    assert (ledger.num_paused, ledger.num_holding_paused) == (1, 2)
    allocator.resume(shared[1:])
    assert (ledger.num_paused, ledger.num_holding_paused) == (1, 1)
    allocator.release_memory_blocks(shared[:1], paused=True)
    assert (ledger.num_paused, ledger.num_holding_paused) == (0, 0)
    allocator.pause(shared[1:])
    allocator.reset()
    assert ledger.num_holding_paused == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda ledger: setattr(ledger, "num_holding_paused", 2), "paused-holding counter 2"),
        (lambda ledger: setattr(ledger, "num_holding_paused", -1), "is negative"),
        (lambda ledger: setattr(ledger, "num_holding_paused", 0), "1 paused-only blocks but"),
        (
            lambda ledger: setattr(ledger, "num_holding_paused", 4),
            "4 blocks hold paused references over a paused budget of 3",
        ),
    ],
)
def test_check_invariants_reports_a_wrong_paused_holding_count(
    change: Callable[[object], None], message: str
) -> None:
    allocator = KVBlockAllocator(total_count=10, paused_count=3, device="cpu", engine="python")
    allocator.pause(allocator.allocate_memory_blocks(1))
    change(allocator._engine.ledger)
    with pytest.raises(InvariantError, match=message):
        allocator.check_invariants()
