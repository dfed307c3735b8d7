"""The chain pin (issue 27): a session turn references its chain's tail, and nothing else
observable changes but what DESIGN.md ("Sessions") states.

Each test runs a session on one allocator and its :class:`~prefixcache.testing.pinned.Twin`
(every turn a new request over the whole conversation, full references) on another, and
compares the outcomes and :func:`~prefixcache.testing.pinned.as_full_references` digests:
the capacity checks refuse and accept exactly where the twin's do, the last resort never
takes a pinned chain's ancestor, and the stamps and counts handed down to a parent when its
child is evicted give a policy that reads them (lfu, hazard) the twin's victims.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from prefixcache import (
    BlockStateError,
    CapacityError,
    InvalidArgumentError,
    InvalidBlockIdError,
    KVBlockAllocator,
    ReferenceCountError,
)
from prefixcache.testing import changed_fields, state_digest
from prefixcache.testing.engine_setup import SESSION_KINDS, open_session, small_allocator
from prefixcache.testing.pinned import Twin, as_full_references

KINDS = SESSION_KINDS


def pair(kind: str, policy: str = "lru", total: int = 16) -> tuple[Any, Any, Any, Twin]:
    """Two allocators, a session on the first and its twin on the second."""
    engine = "python" if kind == "python" else "native"
    ours, theirs = (small_allocator(engine, policy, total) for _ in range(2))
    return ours, theirs, open_session(ours, kind), Twin(theirs)


def same(ours: KVBlockAllocator, theirs: KVBlockAllocator) -> None:
    assert as_full_references(state_digest(ours), ours) == as_full_references(
        state_digest(theirs), theirs
    )
    ours.check_invariants()


def turn(session: Any, twin: Twin, tokens: list[int]) -> int:
    num_hit = session.admit(tokens)
    assert num_hit == twin.admit(tokens)
    assert session.block_ids.tolist() == twin.row
    return int(num_hit)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("policy", ["lru", "lfu", "ref_zero", "auto"])
def test_a_turn_references_only_its_chains_tail(kind: str, policy: str) -> None:
    """Pinned where the policy allows (not ref-zero: nothing stays cached; not auto: it
    hears of every hit); the ancestors stay cached, the counters are the twin's."""
    ours, theirs, session, twin = pair(kind, policy)
    turn(session, twin, list(range(10)))
    session.release()
    twin.release()
    hits = turn(session, twin, [50])
    tails = ours._engine.pinned_tails()
    if policy in ("lru", "lfu"):
        assert hits == 5 and tails == [(session.block_ids.tolist()[4], 1)]
        active, _ = ours._engine.reference_counts(np.array(session.block_ids.tolist()[:4]))
        assert active.tolist() == [0, 0, 0, 0]  # the ancestors: cached, kept by the leaf rule
        assert ours.stats().num_cached == 4 and theirs.stats().num_cached == 0
    else:
        assert tails == []
    same(ours, theirs)
    session.release()
    twin.release()
    assert ours._engine.pinned_tails() == [] and ours._engine.pin_bound == 0
    assert state_digest(ours) == state_digest(theirs)  # idle: no difference at all


@pytest.mark.parametrize("kind", KINDS)
def test_the_capacity_checks_refuse_and_accept_as_full_references(kind: str) -> None:
    """15 usable blocks: a pinned turn's 4 cached ancestors are not room, in allocate,
    is_memory_available, admit_request, append, evict_cached_blocks and evict_lru_blocks alike."""
    ours, theirs, session, twin = pair(kind)
    turn(session, twin, list(range(10)))
    session.release()
    twin.release()
    turn(session, twin, [50])  # 6 blocks held (4 of them pinned ancestors), 9 free (twin)
    for allocator in (ours, theirs):
        row = np.zeros(2, dtype=np.int32)
        allocator.admit_request([70, 71, 72, 73], row)  # two cached leaves once released
        allocator.release_request(row)
    same(ours, theirs)
    for allocator in (ours, theirs):
        assert allocator.allocate_block_ids(10) is None  # 7 free + 2 leaves
        assert not allocator.is_memory_available(10) and allocator.is_memory_available(9)
        with pytest.raises(CapacityError, match="request needs 10 blocks; 9 can be freed"):
            allocator.admit_request(list(range(100, 120)), np.zeros(10, dtype=np.int32))
        assert not allocator.evict_lru_blocks(3)
    same(ours, theirs)
    with pytest.raises(CapacityError, match="the tokens need 10 more blocks; the pool is short"):
        session.append(list(range(200, 220)))
    with pytest.raises(CapacityError):
        twin.append(list(range(200, 220)))
    same(ours, theirs)
    assert ours.evict_cached_blocks(5) == theirs.evict_cached_blocks(5) == 2
    same(ours, theirs)
    for allocator in (ours, theirs):
        taken = allocator.allocate_block_ids(9)
        assert taken is not None
        allocator.release_request(taken)
    same(ours, theirs)


@pytest.mark.parametrize("kind", KINDS)
def test_releasing_a_pinned_turn_after_a_reset_is_refused_with_nothing_changed(
    kind: str,
) -> None:
    """``reset()`` during a pinned turn drops the pin: the turn's release is refused with
    BlockStateError ("not a pinned chain's tail") where full references refuse with its
    subclass ReferenceCountError (the twin's), and nothing changes, the session included."""
    ours, theirs, session, twin = pair(kind)
    turn(session, twin, list(range(8)))
    session.release()
    twin.release()
    turn(session, twin, [50])  # pins the 4-block chain's tail
    assert ours._engine.pinned_tails() != []
    row, num_tokens = session.block_ids.tolist(), session.num_tokens
    ours.reset()
    theirs.reset()
    before, twins_before = state_digest(ours), state_digest(theirs)
    with pytest.raises(BlockStateError, match="is not a pinned chain's tail"):
        session.release()
    with pytest.raises(ReferenceCountError):
        twin.release()
    after = state_digest(ours)
    assert after == before, changed_fields(before, after)
    assert state_digest(theirs) == twins_before
    assert session.running and session.block_ids.tolist() == row
    assert session.num_tokens == num_tokens
    ours.check_invariants()


@pytest.mark.parametrize(
    ("tail", "chain_length", "error"),
    [
        (15, 2, InvalidBlockIdError),  # the dummy block
        (99, 2, InvalidBlockIdError),
        (-1, 2, InvalidArgumentError),
        (3, 1, InvalidArgumentError),  # a chain of one is a plain hit
        ("3", 2, InvalidArgumentError),
    ],
)
def test_the_native_pin_refuses_a_bad_tail_or_chain_with_nothing_changed(
    tail: Any, chain_length: int, error: type[Exception]
) -> None:
    """The binding reads only the tail (O(1) whatever the chain's length), so the tail and
    the length are what it checks, before any write."""
    allocator = small_allocator("native", "lru", 16)
    allocator.allocate_memory_blocks(3)
    before = state_digest(allocator)
    with pytest.raises(error):
        allocator._engine.core.pin_chain(tail, chain_length, 0)
    after = state_digest(allocator)
    assert after == before, changed_fields(before, after)


@pytest.mark.parametrize("kind", KINDS)
def test_the_last_resort_never_takes_a_pinned_chains_ancestor(kind: str) -> None:
    """No cached leaf left: the engine drops the deepest cached block pinned below by a
    held descendant with its subtree, but never a pinned chain's ancestor, however deep."""
    ours, theirs, session, twin = pair(kind, total=20)
    turn(session, twin, list(range(12)))
    session.release()
    twin.release()
    turn(session, twin, [50])  # ancestors at depths 0-4, cached and pinned below
    for allocator in (ours, theirs):
        row = np.zeros(3, dtype=np.int32)
        allocator.admit_request([80, 81, 82, 83, 84, 85], row)
        allocator.release_request(row[:2])  # its first two blocks cached, pinned below
        taken = allocator.allocate_block_ids(allocator.stats().num_free)
        assert taken is not None
    same(ours, theirs)
    for allocator in (ours, theirs):
        assert allocator.allocate_block_ids(1) is not None  # the last resort: depth 1 of row
        assert allocator.allocate_block_ids(1) is not None  # then its root
        assert allocator.allocate_block_ids(1) is None  # only pinned ancestors are cached
    same(ours, theirs)
    session.release()
    twin.release()
    same(ours, theirs)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("policy", ["lfu", "hazard", "lru", "s3fifo"])
def test_handed_down_stamps_and_counts_give_the_twins_victims(kind: str, policy: str) -> None:
    """Policies read a block's last access and hand-outs when it becomes a leaf: a chain
    pinned over several turns, then eaten from its end, gives the twin's victims."""
    ours, theirs, session, twin = pair(kind, policy, total=40)
    turn(session, twin, list(range(8)))
    session.release()
    twin.release()
    for step in range(4):  # each turn pins the chain and grows it by a block
        for allocator in (ours, theirs):  # a competing chain, hit between the turns
            row = np.zeros(3, dtype=np.int32)
            allocator.admit_request([90, 91, 92, 93, 94, 95 + step], row)
            allocator.release_request(row)
        turn(session, twin, [20 + 2 * step, 21 + 2 * step])
        session.append([60 + step])
        twin.append([60 + step])
        session.release()
        twin.release()
        same(ours, theirs)
    while ours.stats().num_cached:
        assert ours.evict_cached_blocks(1) == theirs.evict_cached_blocks(1) == 1
        same(ours, theirs)
    assert theirs.stats().num_cached == 0


def test_a_failed_eviction_undoes_its_hand_downs(flaky: Any, injected_fault: Any) -> None:
    """The Python planner writes a hand-down as it plans (the policy reads it at once);
    a policy that raises afterwards leaves the stamps and counts as they were."""
    policy, allocator = flaky(total_count=16)
    session = allocator.open_session()
    session.admit(list(range(8)))
    session.release()
    session.admit([50])  # pins the 4-block chain: its tail owes the ancestors a turn
    row = session.block_ids.tolist()
    tail = row[3]
    session.release()
    refs = allocator._engine.refs
    assert refs.pin_pending[tail] == 1 and refs.pin_stamp[tail] == refs.last_access[tail]
    before = state_digest(allocator)
    policy.fail_at["insert"] = 1  # the parent's insert, right after the hand-down
    with pytest.raises(injected_fault):
        allocator.evict_cached_blocks(1)
    assert state_digest(allocator) == before
    parent_stamp = int(refs.last_access[row[2]])
    policy.fail_at.clear()
    assert allocator.evict_cached_blocks(1) == 1
    parent, _, last_access, num_accesses, _ = policy.insert_args[-1]
    assert parent == row[2]
    assert last_access == int(refs.pin_stamp[tail]) > parent_stamp
    assert num_accesses == 2  # registration, then the pinned turn handed down
    assert refs.pin_pending[parent] == 1  # owed further up when the parent goes
