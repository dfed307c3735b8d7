"""Sessions (issue 27): a turn costs its new tokens, and changes exactly what admit_request does.

The oracle: every session turn, run on one allocator, and the same turn run on
a twin allocator as a new request with the whole conversation
(``admit_request`` on all tokens so far, decode blocks allocated and
registered as they fill, ``release_request``) leave both allocators in the
same state (:func:`state_digest`: counts, registry, clock, counters, policy
order) and give the same hits and block table rows. Programs mix sessions
with other requests, eviction under a small pool, identical conversations
(registrations refused because another block holds the hash), defragmentation
and resets, so the O(1) context check and its fallback both run; both engines.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import (
    BlockStateError,
    CapacityError,
    ConfigError,
    InvalidArgumentError,
    KVBlockAllocator,
    PrefixCacheError,
)
from prefixcache.engine.locked import ThreadSafeAllocator
from prefixcache.engine.native_engine import native_available
from prefixcache.testing import state_digest

BLOCK = 2
ENGINES = ["python", "native"] if native_available() else ["python"]


def build(engine: str, policy: str = "lru", total: int = 14) -> KVBlockAllocator:
    return KVBlockAllocator(
        total_count=total,
        block_size_tokens=BLOCK,
        device="cpu",
        engine=engine,
        eviction_policy=policy,
    )


class Twin:
    """A session's turns as new requests over the whole conversation (what it must equal)."""

    def __init__(self, allocator: KVBlockAllocator) -> None:
        self.allocator = allocator
        self.tokens: list[int] = []
        self.held: list[int] = []

    def admit(self, tokens: list[int]) -> int:
        prompt = self.tokens + tokens
        row = np.zeros(-(-len(prompt) // BLOCK), dtype=np.int32)
        num_hit = self.allocator.admit_request(prompt, row)
        self.tokens, self.held = prompt, row.tolist()
        return num_hit

    def append(self, tokens: list[int]) -> None:
        grown = self.tokens + tokens
        needed = -(-len(grown) // BLOCK) - len(self.held)
        new: list[int] = []
        if needed:
            ids = self.allocator.allocate_block_ids(needed)
            if ids is None:
                raise CapacityError("short")
            new = list(ids)
        held = self.held + new
        before, after = len(self.tokens) // BLOCK, len(grown) // BLOCK
        if after > before:
            hashes = self.allocator.hash_tokens(grown)
            self.allocator.register_kv_block_hashes(
                held[before:after],
                hashes[before:after],
                parent_hash=hashes[before - 1] if before else None,
            )
        self.tokens, self.held = grown, held

    def release(self) -> None:
        self.allocator.release_request(self.held)
        self.held = []


def outcome(call: Any) -> object:
    try:
        return ("ok", call())
    except PrefixCacheError as error:
        return ("raised", type(error).__name__)


tokens_st = st.lists(st.integers(0, 1), min_size=1, max_size=7)
"""Two token values and blocks of two: conversations and other requests share blocks often."""


@pytest.mark.parametrize("engine", ENGINES)
@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data(), policy=st.sampled_from(["lru", "fifo", "ref_zero"]))
def test_a_session_turn_equals_a_new_request_over_the_whole_conversation(
    engine: str, policy: str, data: st.DataObject
) -> None:
    ours, theirs = build(engine, policy), build(engine, policy)
    sessions = [ours.open_session() for _ in range(3)]
    twins = [Twin(theirs) for _ in range(3)]
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        step = data.draw(
            st.sampled_from(["admit", "append", "release", "request", "evict", "defrag", "reset"]),
            label="step",
        )
        index = data.draw(st.integers(0, 2), label="session")
        session, twin = sessions[index], twins[index]
        if step == "admit" and not session.running:
            tokens = data.draw(tokens_st, label="tokens")
            got = outcome(lambda s=session, t=tokens: s.admit(t))
            want = outcome(lambda w=twin, t=tokens: w.admit(t))
            assert got == want
            if got[0] == "ok":
                assert session.block_ids.tolist() == twin.held
        elif step == "append" and session.running:
            tokens = data.draw(tokens_st, label="tokens")
            assert outcome(lambda s=session, t=tokens: s.append(t)) == outcome(
                lambda w=twin, t=tokens: w.append(t)
            )
            assert session.block_ids.tolist() == twin.held
        elif step == "release" and session.running:
            session.release()
            twin.release()
        elif step == "request":  # another request comes and goes
            tokens = data.draw(tokens_st, label="request")
            for allocator in (ours, theirs):
                row = np.zeros(8, dtype=np.int32)
                if outcome(lambda a=allocator, t=tokens, r=row: a.admit_request(t, r))[0] == "ok":
                    allocator.release_request(row[: -(-len(tokens) // BLOCK)])
        elif step == "evict":
            count = data.draw(st.integers(0, 3), label="evict")
            assert ours.evict_cached_blocks(count) == theirs.evict_cached_blocks(count)
        elif step == "defrag" and not any(s.running for s in sessions):
            for allocator in (ours, theirs):
                allocator.apply_defragment(allocator.plan_defragment())
        elif step == "reset" and not any(s.running for s in sessions):
            ours.reset()
            theirs.reset()
        assert state_digest(ours) == state_digest(theirs), step
        ours.check_invariants()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_turn_hashes_only_its_new_tokens(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost follows the new tokens: only they are hashed and looked up."""
    allocator = build(engine, total=64)
    session = allocator.open_session()
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
    assert session.admit(list(range(41))) == 0
    session.release()
    for _ in range(5):
        assert session.admit([7, 8, 9, 10]) == session.num_tokens // BLOCK - 2
        session.release()
    assert hashed == [41] + [5] * 5  # the partial block's token, then the 4 new ones
    assert looked_up == [20] + [2] * 5  # the new full blocks only: the context is not walked


@pytest.mark.parametrize("engine", ENGINES)
def test_an_idle_session_holds_nothing_and_survives_eviction(engine: str) -> None:
    allocator = build(engine, total=8)  # 7 usable blocks
    session = allocator.open_session()
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


@pytest.mark.parametrize("engine", ENGINES)
def test_refusals_change_nothing(engine: str) -> None:
    allocator = build(engine, total=6)  # 5 usable blocks
    session = allocator.open_session()
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
    other = allocator.open_session()
    other.admit(list(range(6)))  # 3 blocks held: the session's context cannot fit beside them
    before = state_digest(allocator)
    with pytest.raises(CapacityError):
        session.admit(list(range(10, 17)))
    assert state_digest(allocator) == before and session.num_tokens == 3


def test_sessions_are_refused_where_they_cannot_keep_the_rule() -> None:
    verifying = KVBlockAllocator(
        total_count=8, block_size_tokens=BLOCK, device="cpu", verify_prefix_hits=True
    )
    with pytest.raises(ConfigError, match="verify_prefix_hits"):
        verifying.open_session()
    shared = ThreadSafeAllocator(build("python"))
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
