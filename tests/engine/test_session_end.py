"""``Session.end()``: a conversation's end frees its own cached blocks, both session objects.

The oracle is :class:`~prefixcache.testing.pinned.Twin` (each turn a new request
over the whole conversation; its ``end`` looks the chain up and calls
``evict_blocks`` on the blocks after the first turn's hits): random programs of
turns, ends, other requests and evictions leave both allocators in the same
state, and the extension's session equals the Python one step by step, error
messages included. Focused: the first turn's hits (a prefix other
conversations share) stay, a block another chain hangs off stays, ``end``
during a turn is refused with nothing changed, and the session starts over.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixcache import BlockStateError
from prefixcache.engine.native_engine import native_available
from prefixcache.testing import state_digest
from prefixcache.testing.engine_setup import (
    SESSION_KINDS,
    open_session,
    outcome,
    program_settings,
    small_allocator,
)
from prefixcache.testing.pinned import Twin, as_full_references

BLOCK = 2
KINDS = SESSION_KINDS


@pytest.mark.parametrize("kind", KINDS)
def test_end_keeps_the_first_turns_hits_and_a_prefix_another_chain_hangs_off(kind: str) -> None:
    engine = "python" if kind == "python" else "native"
    allocator = small_allocator(engine, total_count=20)
    system = [7, 7, 8, 8]  # two blocks another conversation already cached
    other = open_session(allocator, kind)
    other.admit([*system, 1, 1])
    other.release()
    mine = open_session(allocator, kind)
    assert mine.admit([*system, 2, 2, 3]) == 2  # the shared prefix is hit
    mine.append([3, 4, 4])  # fills two more blocks
    mine.release()
    refused = outcome(lambda: mine.admit([5]), messages=True)
    assert refused[0] == "ok"
    before = state_digest(allocator)
    with pytest.raises(BlockStateError):
        mine.end()  # a turn is running: nothing changes
    assert state_digest(allocator) == before
    mine.release()
    cached = allocator.get_evictable_block_count()
    assert mine.end() == 3  # [2, 2], [3, 3], [4, 4]: its own blocks
    assert allocator.get_evictable_block_count() == cached - 3
    assert mine.num_tokens == 0
    assert len(allocator.match_prefix(allocator.hash_tokens([*system, 1, 1]))) == 3
    allocator.check_invariants()
    assert mine.admit(system) == 1  # a fresh conversation (the last block is not matched)
    mine.release()
    # The other conversation came first: all three of its blocks were its own, and with
    # mine ended nothing hangs off the prefix any more.
    assert other.end() == 3
    assert len(allocator.match_prefix(allocator.hash_tokens([*system, 1, 1]))) == 0
    allocator.check_invariants()


@pytest.mark.parametrize("policy", ["lfu", "hazard", "lru"])
@pytest.mark.parametrize("kind", KINDS)
def test_end_hands_the_pins_stamps_down_to_the_prefix_it_keeps(kind: str, policy: str) -> None:
    """A pinned turn's tail owes its ancestors the accesses full references write; end()
    frees the tail and must hand them to the shared prefix it keeps (as eviction does)."""
    engine = "python" if kind == "python" else "native"
    ours, theirs = small_allocator(engine, policy, 20), small_allocator(engine, policy, 20)
    for allocator in (ours, theirs):  # another conversation caches the system prompt
        other = open_session(allocator, kind)
        other.admit([7, 7, 8, 8, 9])
        other.release()
    mine, twin = open_session(ours, kind), Twin(theirs)
    for turn in ([7, 7, 8, 8, 1, 1, 1], [2, 2, 3], [4]):  # pinned chains from the second turn
        assert mine.admit(turn) == twin.admit(turn)
        mine.release()
        twin.release()
    assert mine.end() == twin.end() == 3  # [1, 1], [1, 2], [2, 3]
    assert as_full_references(state_digest(ours), ours) == as_full_references(
        state_digest(theirs), theirs
    )
    for uses, token in enumerate((5, 6, 4, 3)):  # rivals used 1-4 times, after the turns
        for allocator in (ours, theirs):
            for _ in range(uses + 1):
                row = np.zeros(2, dtype=np.int32)
                allocator.admit_request([token] * 3, row)  # its first block is matched
                allocator.release_request(row)
    while ours.get_evictable_block_count():  # the prefix's stamp and count place it alike
        assert ours.evict_cached_blocks(1) == theirs.evict_cached_blocks(1) == 1
        assert ours._engine.registered_chains() == theirs._engine.registered_chains()
    ours.check_invariants()


tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=7)
STEPS = ("admit", "append", "release", "admit", "append", "release", "end", "request", "evict")


def _program(
    data: st.DataObject,
    ours: Any,
    theirs: Any,
    sessions: list[Any],
    twins: list[Any],
    messages: bool,
) -> None:
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        step = data.draw(st.sampled_from(STEPS), label="step")
        index = data.draw(st.integers(0, 2), label="session")
        session, twin = sessions[index], twins[index]
        if step in ("admit", "append") and session.running == (step == "append"):
            tokens = data.draw(tokens_st, label="tokens")
            got = outcome(lambda s=session, t=tokens, n=step: getattr(s, n)(t), messages=True)
            want = outcome(lambda w=twin, t=tokens, n=step: getattr(w, n)(t), messages=True)
            assert got[: 2 + messages] == want[: 2 + messages]
        elif step == "release" and session.running:
            session.release()
            twin.release()
        elif step == "end" and (not session.running or index == 0):  # refused now and then
            got, want = outcome(session.end, messages=True), outcome(twin.end, messages=True)
            assert got[: 2 + messages] == want[: 2 + messages]
        elif step == "request":
            tokens = data.draw(tokens_st, label="request")
            for allocator in (ours, theirs):
                row = np.zeros(8, dtype=np.int32)
                if outcome(lambda a=allocator, t=tokens, r=row: a.admit_request(t, r))[0] == "ok":
                    allocator.release_request(row[: -(-len(tokens) // BLOCK)])
        elif step == "evict":
            count = data.draw(st.integers(0, 3), label="evict")
            assert ours.evict_cached_blocks(count) == theirs.evict_cached_blocks(count)
        assert as_full_references(state_digest(ours), ours) == as_full_references(
            state_digest(theirs), theirs
        ), step
        ours.check_invariants()


PROGRAMS = program_settings(40)


@pytest.mark.parametrize("kind", KINDS)
@PROGRAMS
@given(
    data=st.data(),
    policy=st.sampled_from(["lru", "fifo", "hazard", "auto", "ref_zero"]),
    total=st.sampled_from([10, 14, 20]),
)
def test_ending_sessions_equals_ending_their_twins(
    kind: str, policy: str, total: int, data: st.DataObject
) -> None:
    engine = "python" if kind == "python" else "native"
    ours, theirs = small_allocator(engine, policy, total), small_allocator(engine, policy, total)
    sessions = [open_session(ours, kind) for _ in range(3)]
    _program(data, ours, theirs, sessions, [Twin(theirs) for _ in range(3)], messages=False)


@pytest.mark.skipif(not native_available(), reason="the native engine is not built")
@PROGRAMS
@given(
    data=st.data(),
    policy=st.sampled_from(["lru", "fifo", "hazard", "auto", "ref_zero"]),
    total=st.sampled_from([10, 14, 20]),
)
def test_the_native_session_ends_as_the_python_session(
    policy: str, total: int, data: st.DataObject
) -> None:
    ours = small_allocator("native", policy, total)
    theirs = small_allocator("native", policy, total)
    natives = [open_session(ours, "native") for _ in range(3)]
    references = [open_session(theirs, "native+python-session") for _ in range(3)]
    _program(data, ours, theirs, natives, references, messages=True)
