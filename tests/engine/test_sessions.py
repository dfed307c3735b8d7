"""Sessions (issue 27): a turn costs its new tokens, and changes exactly what admit_request does.

The oracle: every session turn, run on one allocator, and the same turn run on
a twin allocator as a new request with the whole conversation
(``admit_request`` on all tokens so far, decode blocks allocated and
registered as they fill, ``release_request``) leave both allocators in the
same state (:func:`state_digest`: counts, registry, clock, counters, policy
order) and give the same hits and block table rows. Programs mix sessions
with other requests, eviction under a small pool, identical conversations
(registrations refused because another block holds the hash), defragmentation
and resets, so the O(1) context check and its fallback both run; both engines,
and on the native engine both session objects: the extension's (what
``open_session`` returns on the fused path) and the Python reference
:class:`~prefixcache.engine.sessions.Session`, also compared directly, step by
step, error messages included.

Turns pin their chain's tail where the engine allows it (lru, fifo, lfu, hazard; not
ref_zero or auto): while a turn runs, its pinned ancestors are cached where the twin's
are active, the one difference :func:`~prefixcache.testing.pinned.as_full_references`
rewrites before the digests are compared (DESIGN.md, "Sessions", "The chain pin").
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixcache import (
    BlockStateError,
    CapacityError,
    ConfigError,
    InvalidArgumentError,
    KVBlockAllocator,
    ReentrantCallError,
)
from prefixcache.engine.locked import ThreadSafeAllocator
from prefixcache.engine.native_engine import native_available
from prefixcache.engine.sessions import Session
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
ENGINES = ["python", "native"] if native_available() else ["python"]
KINDS = SESSION_KINDS


def row_of(handle: Any) -> list[int]:
    return handle.row if isinstance(handle, Twin) else handle.block_ids.tolist()


tokens_st = st.lists(st.integers(0, 1), min_size=1, max_size=7)
"""Two token values and blocks of two: conversations and other requests share blocks often."""


def run_program(
    data: st.DataObject,
    ours: KVBlockAllocator,
    theirs: KVBlockAllocator,
    sessions: list[Any],
    twins: list[Any],
    messages: bool = False,
    tokens_of: st.SearchStrategy[list[int]] = tokens_st,
    num_steps: int = 40,
    steps: tuple[str, ...] = (
        "admit",
        "append",
        "release",
        "turn",
        "request",
        "replay",
        "evict",
        "defrag",
        "reset",
    ),
) -> None:
    """A random program of turns, other requests, evictions, defragmentation and resets,
    run on both allocators: the same outcomes, rows and state after every step. ``replay``
    admits a prefix of a session's conversation as another request: a chain evicted and
    recomputed into other blocks (its tail maybe on its old ID), which the session's
    per-block check must notice."""
    tokens_st = tokens_of
    conversations: list[list[int]] = [[] for _ in sessions]
    for _ in range(data.draw(st.integers(1, num_steps), label="steps")):
        step = data.draw(
            st.sampled_from(steps),
            label="step",
        )
        index = data.draw(st.integers(0, 2), label="session")
        session, twin = sessions[index], twins[index]
        if step == "admit" and not session.running:
            tokens = data.draw(tokens_st, label="tokens")
            # reserve (tokens more the capacity check covers) where the twin is a session too
            reserve = 0 if isinstance(twin, Twin) else data.draw(RESERVES, label="reserve")
            got = outcome(lambda s=session, t=tokens, r=reserve: s.admit(t, reserve=r), messages)
            want = outcome(lambda w=twin, t=tokens, r=reserve: admit_of(w, t, r), messages)
            assert got == want
            if got[0] == "ok":
                assert row_of(session) == row_of(twin)
                conversations[index] += tokens
        elif step == "append" and session.running:
            tokens = data.draw(tokens_st, label="tokens")
            got = outcome(lambda s=session, t=tokens: s.append(t), messages)
            assert got == outcome(lambda w=twin, t=tokens: w.append(t), messages)
            assert row_of(session) == row_of(twin)
            conversations[index] += tokens if got[0] == "ok" else []
        elif step == "release" and session.running:
            session.release()
            twin.release()
        elif step == "turn" and not session.running:  # admit, append, release in one call
            lead = data.draw(st.lists(st.integers(0, 1), max_size=2), label="lead")
            tokens = data.draw(tokens_st, label="tokens")
            response = data.draw(tokens_st, label="response")

            def whole(
                s: Any, lead: list[int] = lead, t: list[int] = tokens, r: list[int] = response
            ) -> int:
                # ``start`` skips tokens the call reads past (the harness's whole context)
                hits: int = s.turn(lead + t, r, len(lead)) if lead else s.turn(t, r)
                return hits

            got = outcome(lambda s=session: whole(s), messages)
            if not isinstance(twin, Twin):
                assert got == outcome(lambda w=twin: whole(w), messages)
            elif got[0] == "ok":  # refused, ours changed nothing: the twin did nothing
                assert got == ("ok", twin.admit(tokens))
                twin.append(response)
                twin.release()
            conversations[index] += tokens + response if got[0] == "ok" else []
        elif step == "replay" and conversations[index]:  # the conversation as another request
            tokens = conversations[index][: data.draw(st.integers(1, 8), label="replay")]
            for allocator in (ours, theirs):
                row = np.zeros(8, dtype=np.int32)
                if outcome(lambda a=allocator, t=tokens, r=row: a.admit_request(t, r))[0] == "ok":
                    allocator.release_request(row[: -(-len(tokens) // BLOCK)])
        elif step == "request":  # another request comes and goes
            tokens = data.draw(tokens_st, label="request")
            for allocator in (ours, theirs):
                row = np.zeros(8, dtype=np.int32)
                if outcome(lambda a=allocator, t=tokens, r=row: a.admit_request(t, r))[0] == "ok":
                    allocator.release_request(row[: -(-len(tokens) // BLOCK)])
        elif step == "shuffle":  # blocks taken and freed in another order: the free stack moves
            count = data.draw(st.integers(1, 4), label="shuffle")
            for allocator in (ours, theirs):
                taken = allocator.allocate_block_ids(count)
                if taken is not None:
                    allocator.release_request(taken)  # pushed back in reverse: top k swapped
        elif step in ("evict", "flush"):  # flush: every cached block (then replays recompute)
            count = data.draw(st.integers(0, 3), label="evict") if step == "evict" else 99
            assert ours.evict_cached_blocks(count) == theirs.evict_cached_blocks(count)
        elif step == "defrag" and not any(s.running for s in sessions):
            for allocator in (ours, theirs):
                allocator.apply_defragment(allocator.plan_defragment())
        elif step == "reset" and not any(s.running for s in sessions):
            ours.reset()
            theirs.reset()
        # Pinned chains' ancestors are cached where full references keep them active: the
        # one stated difference (prefixcache.testing.pinned), rewritten before comparing.
        assert as_full_references(state_digest(ours), ours) == as_full_references(
            state_digest(theirs), theirs
        ), step
        assert [s.num_tokens for s in sessions] == [
            len(t.tokens) if isinstance(t, Twin) else t.num_tokens for t in twins
        ]
        compare_parts(data, ours, session, twin, messages)
        ours.check_invariants()


RESERVES = st.sampled_from([0, 0, 3, 9, -1])
"""admit's reserve: none, some, more than a small pool holds, and refused (-1)."""


def admit_of(twin: Any, tokens: list[int], reserve: int) -> int:
    """The twin's admit: a Twin takes no reserve (drawn 0 for it), a session does."""
    if isinstance(twin, Twin):
        return twin.admit(tokens)
    hits: int = twin.admit(tokens, reserve=reserve)
    return hits


def compare_parts(
    data: st.DataObject, ours: KVBlockAllocator, session: Any, twin: Any, messages: bool
) -> None:
    """The partial reads a tiered session makes after each step: the chain's hashes (the
    conversation's full blocks hashed from the root) and the row from a block on, the same
    on both sides; out-of-range arguments refused alike."""
    chain = session.chain_hashes()
    if isinstance(twin, Twin):
        full = len(twin.tokens) // BLOCK * BLOCK
        assert chain == (ours.hash_tokens(twin.tokens[:full]) if full else [])
        if session.running:
            assert session.block_ids_from(0).tolist() == twin.held
        return
    first = data.draw(st.integers(-1, len(chain) + 1), label="first")
    stop = data.draw(st.one_of(st.none(), st.integers(-1, len(chain) + 1)), label="stop")
    assert outcome(lambda: session.chain_hashes(first, stop), messages) == outcome(
        lambda: twin.chain_hashes(first, stop), messages
    )
    held = len(twin.block_ids.tolist())
    at = data.draw(st.integers(-1, held + 1), label="from")
    assert outcome(lambda: session.block_ids_from(at).tolist(), messages) == outcome(
        lambda: twin.block_ids_from(at).tolist(), messages
    )


POLICIES = ["lru", "fifo", "ref_zero", "auto", "lfu", "hazard"]
"""Pins with lru, fifo, lfu and hazard (these two read the stamps and counts pins hand
down); full references with ref_zero (nothing cached) and auto (hears of every hit)."""
TOTALS = [7, 10, 14]
"""Small pools: eviction with pinned sessions, the last resort when no leaf is left."""

PROGRAMS = program_settings(60)


@pytest.mark.parametrize("kind", KINDS)
@PROGRAMS
@given(data=st.data(), policy=st.sampled_from(POLICIES), total=st.sampled_from(TOTALS))
def test_a_session_turn_equals_a_new_request_over_the_whole_conversation(
    kind: str, policy: str, total: int, data: st.DataObject
) -> None:
    engine = "python" if kind == "python" else "native"
    ours, theirs = small_allocator(engine, policy, total), small_allocator(engine, policy, total)
    sessions = [open_session(ours, kind) for _ in range(3)]
    run_program(data, ours, theirs, sessions, [Twin(theirs) for _ in range(3)])


@pytest.mark.skipif(not native_available(), reason="the native engine is not built")
@PROGRAMS
@given(data=st.data(), policy=st.sampled_from(POLICIES), total=st.sampled_from(TOTALS))
def test_the_native_session_equals_the_python_session_step_by_step(
    policy: str, total: int, data: st.DataObject
) -> None:
    """The extension's session against the reference on the same engine: the same
    outcomes (error messages included), rows, token counts and engine state."""
    ours = small_allocator("native", policy, total)
    theirs = small_allocator("native", policy, total)
    natives = [open_session(ours, "native") for _ in range(3)]
    references = [open_session(theirs, "native+python-session") for _ in range(3)]
    run_program(data, ours, theirs, natives, references, messages=True)


long_tokens_st = st.lists(st.integers(0, 40), min_size=1, max_size=6)
"""Conversations that rarely meet: long pinned chains, evicted from their ends under pressure
(the stamps and counts handed down), and the last resort when no leaf is left."""


@pytest.mark.parametrize("kind", KINDS)
@PROGRAMS
@given(data=st.data(), policy=st.sampled_from(POLICIES), total=st.sampled_from([9, 12, 16]))
def test_pinned_chains_under_eviction_pressure_equal_full_references(
    kind: str, policy: str, total: int, data: st.DataObject
) -> None:
    engine = "python" if kind == "python" else "native"
    ours, theirs = small_allocator(engine, policy, total), small_allocator(engine, policy, total)
    sessions = [open_session(ours, kind) for _ in range(3)]
    twins = [Twin(theirs) for _ in range(3)]
    turns = (
        *("admit", "admit", "append", "release", "release", "turn", "request", "evict"),
        *("defrag", "replay", "replay", "flush", "shuffle", "shuffle"),
    )
    run_program(
        data, ours, theirs, sessions, twins, tokens_of=long_tokens_st, steps=turns, num_steps=80
    )


def five_short_turns(session: Any) -> None:
    assert session.admit(list(range(41))) == 0
    session.release()
    for _ in range(5):
        assert session.admit([7, 8, 9, 10]) == session.num_tokens // BLOCK - 2
        session.release()


@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind != "native"])
def test_a_turn_hashes_only_its_new_tokens(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost follows the new tokens: only they are hashed and looked up."""
    allocator = small_allocator("python" if kind == "python" else "native", total_count=64)
    session = open_session(allocator, kind)
    assert isinstance(session, Session)
    hashed: list[int] = []
    original = session._hash  # the facade's hash_tokens, or the native engine's

    def counting(tokens: Any, parent: int | None) -> list[int]:
        hashed.append(len(tokens))
        hashes: list[int] = original(tokens, parent)
        assert hashes == allocator.hash_tokens(tokens, parent=parent)  # the same chain
        return hashes

    looked_up: list[int] = []
    lookup = allocator._engine.lookup

    def counting_lookups(hashes: list[int]) -> Any:
        looked_up.append(len(hashes))
        return lookup(hashes)

    monkeypatch.setattr(session, "_hash", counting)
    monkeypatch.setattr(allocator._engine, "lookup", counting_lookups)
    five_short_turns(session)
    assert hashed == [41] + [5] * 5  # the partial block's token, then the 4 new ones
    assert looked_up == [20] + [2] * 5  # the new full blocks only: the context is not walked


@pytest.mark.skipif(not native_available(), reason="the native engine is not built")
def test_a_native_turn_hashes_only_its_new_tokens() -> None:
    """The extension's session counts what it hashes and looks up: the same as above."""
    session: Any = open_session(small_allocator("native", total_count=64), "native")
    five_short_turns(session)
    assert session.num_hashed_tokens == 41 + 5 * 5
    assert session.num_looked_up == 20 + 2 * 5


@pytest.mark.parametrize("kind", KINDS)
def test_an_idle_session_holds_nothing_and_survives_eviction(kind: str) -> None:
    engine = "python" if kind == "python" else "native"
    allocator = small_allocator(engine, total_count=8)  # 7 usable blocks
    session = open_session(allocator, kind)
    session.admit([1, 2, 3, 4, 5, 6])
    session.release()
    assert allocator.get_active_used() == 0 and allocator.stats().num_cached == 3
    taken = allocator.allocate_block_ids(6)  # evicts two of the session's three blocks
    assert taken is not None
    allocator.release_request(taken)
    assert session.admit([7]) == 1  # the fallback found the one block left
    assert (
        session.block_ids.tolist()[:1]
        == allocator.match_prefix(allocator.hash_tokens([1, 2])).tolist()
    )
    session.release()
    allocator.check_invariants()


@pytest.mark.parametrize("kind", KINDS)
def test_refusals_change_nothing(kind: str) -> None:
    engine = "python" if kind == "python" else "native"
    allocator = small_allocator(engine, total_count=6)  # 5 usable blocks
    session = open_session(allocator, kind)
    with pytest.raises(BlockStateError, match="admit"):
        session.append([1])
    with pytest.raises(BlockStateError, match="no turn"):
        session.release()
    for bad in ([], [2**31], "12", [1.5]):
        before = state_digest(allocator)
        with pytest.raises(InvalidArgumentError):
            session.admit(bad)
        assert state_digest(allocator) == before and session.num_tokens == 0
    session.admit([1, 2, 3])
    with pytest.raises(BlockStateError, match="running"):
        session.admit([4])
    before = (state_digest(allocator), session.block_ids.tolist(), session.num_tokens)
    with pytest.raises(CapacityError):
        session.append(list(range(20)))
    assert (state_digest(allocator), session.block_ids.tolist(), session.num_tokens) == before
    session.release()
    other = open_session(allocator, kind)
    other.admit(list(range(6)))  # 3 blocks held: the session's context cannot fit beside them
    before = state_digest(allocator)
    with pytest.raises(CapacityError):
        session.admit(list(range(10, 17)))
    assert state_digest(allocator) == before and session.num_tokens == 3


@pytest.mark.parametrize("kind", KINDS)
def test_a_refused_turn_changes_nothing(kind: str) -> None:
    """turn's capacity check covers the response: the prompt alone would fit, the whole
    turn does not, and nothing changes (no admit left running, no block registered)."""
    engine = "python" if kind == "python" else "native"
    allocator = small_allocator(engine, total_count=6)  # 5 usable blocks
    session = open_session(allocator, kind)
    before = state_digest(allocator)
    with pytest.raises(CapacityError, match="the turn needs 7 blocks"):
        session.turn([1, 2, 3], list(range(10)))
    for tokens, response, start in (([1], [], 0), ([1, 2], [3], 2), ([1, 2], [3], 3)):
        with pytest.raises(InvalidArgumentError):
            session.turn(tokens, response, start)
    assert state_digest(allocator) == before
    assert (session.num_tokens, session.running) == (0, False)
    assert session.turn([9, 1, 2, 3], [4], 1) == 0  # reads tokens[1:]: the prompt [1, 2, 3]
    assert (session.num_tokens, session.running) == (4, False)
    assert session.turn([1, 2, 3, 4, 5], [6], 4) == 2  # blocks [1, 2], [3, 4] from the cache
    session.admit([7])
    with pytest.raises(BlockStateError, match="running"):
        session.turn([8], [9])
    session.release()
    allocator.check_invariants()


def test_sessions_are_refused_where_they_cannot_keep_the_rule() -> None:
    verifying = KVBlockAllocator(
        total_count=8, block_size_tokens=BLOCK, device="cpu", verify_prefix_hits=True
    )
    with pytest.raises(ConfigError, match="verify_prefix_hits"):
        verifying.open_session()
    shared = ThreadSafeAllocator(small_allocator("python", total_count=14))
    with pytest.raises(AttributeError, match="lock"):
        shared.open_session()  # a session is live state: open it on shared.allocator


@pytest.mark.parametrize("engine", ENGINES)
def test_without_prefix_caching_every_turn_starts_afresh(engine: str) -> None:
    """Nothing is registered, so nothing stays cached: the context is allocated again."""
    ours, theirs = (
        KVBlockAllocator(
            total_count=32,
            block_size_tokens=BLOCK,
            device="cpu",
            engine=engine,
            enable_prefix_caching=False,
        )
        for _ in range(2)
    )
    session, twin = ours.open_session(), Twin(theirs)
    for tokens, response in (([1, 2, 3, 4, 5], [6, 7]), ([8, 9], [10]), ([11], [12, 13, 14])):
        assert session.admit(tokens) == twin.admit(tokens) == 0
        session.append(response)
        twin.append(response)
        assert session.block_ids.tolist() == twin.held
        session.release()
        twin.release()
        assert state_digest(ours) == state_digest(theirs)
        ours.check_invariants()


@pytest.mark.skipif(not native_available(), reason="the native engine is not built")
@pytest.mark.parametrize("swallow", [False, True])
def test_a_native_step_refuses_reentry(swallow: bool) -> None:
    """Reading the tokens may run Python code (a tensor's numpy()); a call back into the
    engine from there is refused. Raised on, the step fails with it and changes nothing;
    swallowed, the step runs as if the call back never happened."""
    ours, theirs = (small_allocator("native", total_count=32) for _ in range(2))
    session, twin = open_session(ours, "native"), open_session(theirs, "native")
    refusals: list[ReentrantCallError] = []

    class CallsBack:
        def numpy(self) -> np.ndarray:
            try:
                session.release()  # into the engine while append reads these tokens
            except ReentrantCallError as error:
                refusals.append(error)
                if not swallow:
                    raise
            return np.arange(4, dtype=np.int32)

    session.admit([1, 2, 3])
    twin.admit([1, 2, 3])
    if swallow:
        session.append(CallsBack())
        twin.append(np.arange(4, dtype=np.int32))
    else:
        with pytest.raises(ReentrantCallError):
            session.append(CallsBack())
    assert len(refusals) == 1 and session.running
    assert state_digest(ours) == state_digest(theirs)
    assert (session.block_ids.tolist(), session.num_tokens) == (
        twin.block_ids.tolist(),
        twin.num_tokens,
    )
