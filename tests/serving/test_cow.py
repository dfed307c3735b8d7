"""PartialBlockTable: requests share a partly filled block until one writes into it."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixcache import KVBlockAllocator
from prefixcache.errors import (
    BlockStateError,
    InvalidArgumentError,
    InvariantError,
    PrefixCacheError,
)
from prefixcache.serving.cow import CopyInstruction, PartialBlockTable

B = 4


def make(total_count: int = 8) -> tuple[KVBlockAllocator, PartialBlockTable]:
    allocator = KVBlockAllocator(total_count=total_count, block_size_tokens=B, device="cpu")
    return allocator, PartialBlockTable(allocator)


def active_refs(allocator: KVBlockAllocator, block_id: int) -> int:
    return int(allocator.reference_counts([block_id])[0][0])


def test_sharers_hold_one_reference_each() -> None:
    allocator, table = make()
    tail = int(allocator.allocate_memory_blocks(1)[0])
    table.track("a", tail, 2)
    assert table.share("a", "b") == tail and table.share("b", "c") == tail
    assert active_refs(allocator, tail) == 3
    assert table.holders_of(tail) == {"a", "b", "c"}
    assert table.tail_of("c") == (tail, 2)
    table.check_invariants()


def test_the_writer_of_a_shared_block_gets_a_fresh_block_and_a_copy() -> None:
    allocator, table = make()
    tail = int(allocator.allocate_memory_blocks(1)[0])
    table.track("a", tail, 2)
    table.share("a", "b")
    write = table.write("b", 1)
    assert write.copy == CopyInstruction(src=tail, dst=write.block_id, num_tokens=2)
    assert write.block_id != tail and write.offset == 2 and not write.is_full
    assert table.tail_of("b") == (write.block_id, 3) and table.tail_of("a") == (tail, 2)
    assert active_refs(allocator, tail) == 1 and active_refs(allocator, write.block_id) == 1
    assert table.num_copies == 1
    table.check_invariants()


def test_the_last_holder_writes_in_place() -> None:
    allocator, table = make()
    tail = int(allocator.allocate_memory_blocks(1)[0])
    table.track("a", tail, 1)
    table.share("a", "b")
    table.write("b", 1)
    write = table.write("a", 2)
    assert write.copy is None and write.block_id == tail and write.offset == 1
    assert table.tail_of("a") == (tail, 3)


def test_a_block_that_fills_is_no_longer_tracked_but_stays_held() -> None:
    allocator, table = make()
    tail = int(allocator.allocate_memory_blocks(1)[0])
    table.track("a", tail, 3)
    write = table.write("a", 1)
    assert write.is_full and table.tail_of("a") is None and len(table) == 0
    assert active_refs(allocator, tail) == 1


def test_sharing_an_empty_block_copies_nothing() -> None:
    allocator, table = make()
    tail = int(allocator.allocate_memory_blocks(1)[0])
    table.track("a", tail, 0)
    table.share("a", "b")
    write = table.write("a", 1)
    assert write.copy is None and write.block_id != tail and write.offset == 0


def test_a_copy_without_a_free_block_returns_none_and_changes_nothing() -> None:
    allocator, table = make(total_count=2)  # one usable block
    tail = int(allocator.allocate_memory_blocks(1)[0])
    table.track("a", tail, 2)
    table.share("a", "b")
    assert table.write("b", 1) is None
    assert table.tail_of("b") == (tail, 2) and active_refs(allocator, tail) == 2


def test_drop_returns_the_block_and_leaves_the_reference_to_the_caller() -> None:
    allocator, table = make()
    tail = int(allocator.allocate_memory_blocks(1)[0])
    table.track("a", tail, 2)
    table.share("a", "b")
    assert table.drop("a") == tail
    assert active_refs(allocator, tail) == 2  # the caller releases "a"'s reference
    allocator.release_memory_blocks([tail])
    assert table.write("b", 1).copy is None  # "b" alone now: in place


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda t, tail: t.track("a", tail, 1), InvalidArgumentError),  # tracked request
        (lambda t, tail: t.track("z", tail, 1), InvalidArgumentError),  # tracked block
        (lambda t, tail: t.track("z", 6, 4), InvalidArgumentError),  # a full block
        (lambda t, tail: t.track("z", 6, -1), InvalidArgumentError),
        (lambda t, tail: t.track("z", 7, 1), InvalidArgumentError),  # the dummy block
        (lambda t, tail: t.track("z", True, 1), InvalidArgumentError),
        (lambda t, tail: t.track(["z"], 6, 1), InvalidArgumentError),  # not hashable
        (lambda t, tail: t.share("z", "y"), InvalidArgumentError),
        (lambda t, tail: t.share("a", "a"), InvalidArgumentError),
        (lambda t, tail: t.write("a", 3), InvalidArgumentError),  # 2 + 3 > block size
        (lambda t, tail: t.write("a", 0), InvalidArgumentError),
        (lambda t, tail: t.write(["a"], 1), InvalidArgumentError),
        (lambda t, tail: t.drop("z"), InvalidArgumentError),
    ],
)
def test_bad_calls_raise_and_change_nothing(call, error) -> None:
    allocator, table = make()
    tail = int(allocator.allocate_memory_blocks(1)[0])
    table.track("a", tail, 2)

    def state() -> tuple:
        return (str(allocator), table.tail_of("a"), len(table), table.num_copies)

    before = state()
    with pytest.raises(error) as info:
        call(table, tail)
    assert isinstance(info.value, PrefixCacheError)
    assert state() == before
    table.check_invariants()


def test_sharing_a_block_nobody_holds_is_refused_by_the_allocator() -> None:
    _, table = make()
    table.track("a", 3, 1)  # the caller lied: block 3 is free
    with pytest.raises(BlockStateError):
        table.share("a", "b")
    with pytest.raises(InvariantError):
        table.check_invariants()


def test_the_table_refuses_something_that_is_not_an_allocator() -> None:
    with pytest.raises(InvalidArgumentError):
        PartialBlockTable(object())  # type: ignore[arg-type]


class CowMachine(RuleBasedStateMachine):
    """The table against a fake KV store: no request ever sees another's tokens.

    The fake store maps block -> the tokens written in it. Each request's
    model is the token list of its tail. Writes go where the table says,
    after running its copy; after every step each request's tail block must
    hold exactly its own tokens, and the allocator must count one active
    reference per request on each of its blocks (full ones included).
    """

    def __init__(self) -> None:
        super().__init__()
        self.allocator, self.table = make(total_count=10)
        self.store: dict[int, list[int]] = {}
        self.tails: dict[int, list[int]] = {}  # request -> its tail's tokens
        self.held: dict[int, list[int]] = {}  # request -> every block it holds
        self.next_request = 0
        self.next_token = 100

    @precondition(lambda self: self.allocator.is_memory_available(1) and len(self.held) < 6)
    @rule(num_tokens=st.integers(0, B - 1))
    def start(self, num_tokens: int) -> None:
        block_id = int(self.allocator.allocate_memory_blocks(1)[0])
        tokens = [self._token() for _ in range(num_tokens)]
        self.store[block_id] = list(tokens)
        request = self.next_request
        self.next_request += 1
        self.table.track(request, block_id, num_tokens)
        self.tails[request] = tokens
        self.held[request] = [block_id]

    @precondition(lambda self: self.tails and len(self.held) < 6)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tails)))
        request = self.next_request
        self.next_request += 1
        block_id = self.table.share(parent, request)
        self.tails[request] = list(self.tails[parent])
        self.held[request] = [block_id]

    @precondition(lambda self: self.tails)
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(sorted(self.tails)))
        room = B - len(self.tails[request])
        num_tokens = data.draw(st.integers(1, room))
        old_block = self.held[request][-1]
        result = self.table.write(request, num_tokens)
        if result is None:
            assert not self.allocator.is_memory_available(1)
            return
        if result.copy is not None:
            source = self.store[result.copy.src]
            self.store[result.copy.dst] = source[: result.copy.num_tokens]
        elif result.block_id != old_block:
            self.store[result.block_id] = []
        if result.block_id != old_block:
            self.held[request][-1] = result.block_id
        tokens = [self._token() for _ in range(num_tokens)]
        written = self.store[result.block_id]
        assert len(written) >= result.offset
        self.store[result.block_id] = written[: result.offset] + tokens
        self.tails[request].extend(tokens)
        if result.is_full:
            del self.tails[request]

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(sorted(self.held)))
        if request in self.tails:
            assert self.table.drop(request) == self.held[request][-1]
            del self.tails[request]
        self.allocator.release_memory_blocks(self.held.pop(request))

    @invariant()
    def nobody_sees_another_requests_tokens(self) -> None:
        self.table.check_invariants()
        self.allocator.check_invariants()
        for request, tokens in self.tails.items():
            block_id, fill = self.table.tail_of(request)
            assert block_id == self.held[request][-1] and fill == len(tokens)
            assert self.store[block_id][:fill] == tokens

    @invariant()
    def one_reference_per_holder(self) -> None:
        counts: dict[int, int] = {}
        for blocks in self.held.values():
            for block_id in blocks:
                counts[block_id] = counts.get(block_id, 0) + 1
        for block_id, count in counts.items():
            assert active_refs(self.allocator, block_id) == count
        assert self.allocator.get_active_used() == len(counts)

    def _token(self) -> int:
        self.next_token += 1
        return self.next_token


CowMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
test_cow_machine = CowMachine.TestCase


def _tracked_pair() -> PartialBlockTable:
    allocator, table = make()
    tail = int(allocator.allocate_memory_blocks(1)[0])
    table.track("a", tail, 2)
    table.share("a", "b")
    return table


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda t: t._holders[t._tail_of["a"]].add("ghost"),  # a holder that does not point back
        lambda t: t._fill.__setitem__(t._tail_of["a"], B),  # a full block still tracked
        lambda t: t._tail_of.__setitem__("ghost", t._tail_of["a"]),  # not listed as a holder
        lambda t: t._fill.__setitem__(99, 1),  # a fill without holders
    ],
)
def test_check_invariants_names_each_kind_of_corruption(corrupt) -> None:
    table = _tracked_pair()
    corrupt(table)
    with pytest.raises(InvariantError):
        table.check_invariants()


def test_a_defragmentation_renames_the_tracked_tails() -> None:
    allocator, table = make(total_count=10)
    filler = allocator.allocate_memory_blocks(6)
    tail = int(allocator.allocate_memory_blocks(1)[0])
    table.track("a", tail, 2)
    table.share("a", "b", take_reference=False)
    allocator.acquire_blocks([tail])  # b's reference, taken as a fork would
    allocator.release_memory_blocks(filler)
    plan = allocator.plan_defragment()
    assert tail in plan.sources.tolist()
    allocator.apply_defragment(plan)
    assert table.apply_moves(plan.sources, plan.destinations) == 1
    moved = plan.destinations[plan.sources.tolist().index(tail)]
    assert table.tail_of("a") == table.tail_of("b") == (moved, 2)
    assert table.holders_of(moved) == {"a", "b"} and not table.holders_of(tail)
    table.check_invariants()  # two references on the renamed block
    with pytest.raises(InvalidArgumentError):
        table.apply_moves([1, 2], [3])
    assert table.tail_of("a") == (moved, 2)
