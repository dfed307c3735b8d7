"""TieredSession (issue 27): a session's turns keep the tier's rule, and equal turns by hand.

The oracle: a conversation run through :meth:`TieredCache.open_session` on one
tier, and the same conversation run on a twin tier through
:meth:`TieredCache.match`, :meth:`~TieredCache.allocate`,
:meth:`~TieredCache.register` and :meth:`~TieredCache.release` by hand (the
whole conversation matched each turn, decode blocks allocated and registered as
they fill), give the same hits and block table rows and queue the same copies
(demotions and promotions, block for block and slot for slot) after every step,
with other requests and trims evicting in between; ``TieredCache.check`` (the
allocator's, the host tier's and the tier's own bookkeeping) holds after every
step. Both engines (the native engine's own session object where it is built).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixcache.testing.engine_setup import program_settings, small_allocator
from prefixcache.tiers import HostTier, TieredCache

BLOCK = 2
ENGINES = ["python", "native"]


def make_tier(engine: str, total: int = 16, slots: int = 24, policy: str = "lru") -> TieredCache:
    allocator = small_allocator(engine, policy, total, block_size_tokens=BLOCK)
    return TieredCache(allocator, HostTier(slots, block_size=BLOCK))


class ByHand:
    """A conversation's turns through the tier's match / allocate / register by hand."""

    def __init__(self, tier: TieredCache) -> None:
        self.tier = tier
        self.tokens: list[int] = []
        self.held: list[int] = []

    @property
    def running(self) -> bool:
        return bool(self.held)

    def hashes(self, tokens: list[int]) -> list[int]:
        full = len(tokens) // BLOCK * BLOCK
        return self.tier.allocator.hash_tokens(tokens[:full]) if full else []

    def admit(self, new: list[int]) -> int:
        prompt = self.tokens + new
        hashes = self.hashes(prompt)
        match = self.tier.match(hashes[: (len(prompt) - 1) // BLOCK], num_tokens=len(prompt))
        hit = len(match.block_ids)
        fresh = self.tier.allocate(-(-len(prompt) // BLOCK) - hit)
        assert fresh is not None  # the programs stay within the pool
        if len(hashes) > hit:
            parent = hashes[hit - 1] if hit else None
            self.tier.register(fresh[: len(hashes) - hit], hashes[hit:], parent_hash=parent)
        self.tokens, self.held = prompt, match.block_ids.tolist() + fresh.tolist()
        return hit

    def append(self, new: list[int]) -> None:
        grown = self.tokens + new
        fresh = self.tier.allocate(-(-len(grown) // BLOCK) - len(self.held))
        assert fresh is not None
        self.held += fresh.tolist()
        before, hashes = len(self.tokens) // BLOCK, self.hashes(grown)
        parent = hashes[before - 1] if before else None
        # as the session: a parent hash gone (its registration refused, its holder evicted)
        # leaves the filled blocks unregistered
        if len(hashes) > before and (
            parent is None or self.tier.allocator.is_hash_registered(parent)
        ):
            ids = self.held[before : len(hashes)]
            self.tier.register(ids, hashes[before:], parent_hash=parent)
        self.tokens = grown

    def release(self) -> None:
        self.tier.release(self.held)
        self.held = []


def other_request(tier: TieredCache, tokens: list[int]) -> None:
    """Another request through the tier: matched, the rest allocated and registered, released."""
    hashes = tier.allocator.hash_tokens(tokens[: len(tokens) // BLOCK * BLOCK])
    match = tier.match(hashes)
    fresh = tier.allocate(-(-len(tokens) // BLOCK) - len(match.block_ids))
    if fresh is None:
        tier.release(match.block_ids)
        return
    hit = len(match.block_ids)
    if len(hashes) > hit:
        parent = hashes[hit - 1] if hit else None
        tier.register(fresh[: len(hashes) - hit], hashes[hit:], parent_hash=parent)
    tier.release(np.concatenate([match.block_ids, fresh]))


def same_state(ours: TieredCache, theirs: TieredCache, session: Any, twin: ByHand) -> None:
    assert ours.take_transfer() == theirs.take_transfer()  # the copies, in order
    assert session.num_tokens == len(twin.tokens)
    assert (session.block_ids.tolist() if session.running else []) == twin.held
    mine, yours = ours.stats(), theirs.stats()
    assert (mine.num_demoted_blocks, mine.num_promoted_blocks, len(ours.host)) == (
        yours.num_demoted_blocks,
        yours.num_promoted_blocks,
        len(theirs.host),
    )
    ours.check()
    theirs.check()


PROGRAMS = program_settings(40)


@pytest.mark.parametrize("engine", ENGINES)
@PROGRAMS
@given(
    data=st.data(),
    policy=st.sampled_from(["lru", "fifo"]),
    total=st.sampled_from([12, 16, 24]),
    slots=st.sampled_from([3, 8, 32]),
)
def test_session_turns_equal_turns_through_the_tier_by_hand(
    engine: str, policy: str, total: int, slots: int, data: st.DataObject
) -> None:
    ours, theirs = make_tier(engine, total, slots, policy), make_tier(engine, total, slots, policy)
    limit = (total - 1) // 2 * BLOCK - 4  # a conversation and its turn fit in half the pool
    sessions: list[Any] = [ours.open_session() for _ in range(2)]
    twins = [ByHand(theirs) for _ in range(2)]
    fresh_token = iter(range(10**6))  # distinct tokens: no two conversations share a block
    tokens_st = st.integers(1, 5).map(lambda n: [next(fresh_token) for _ in range(n)])
    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        step = data.draw(st.sampled_from(["turn", "turn", "request", "replay", "evict"]))
        index = data.draw(st.integers(0, 1), label="session")
        session, twin = sessions[index], twins[index]
        if step == "turn":
            if len(twin.tokens) > limit:  # start a new conversation instead
                sessions[index], twins[index] = ours.open_session(), ByHand(theirs)
                session, twin = sessions[index], twins[index]
            tokens = data.draw(tokens_st, label="prompt")
            assert session.admit(tokens) == twin.admit(tokens)
            same_state(ours, theirs, session, twin)
            for _ in range(data.draw(st.integers(0, 2), label="appends")):
                tokens = data.draw(tokens_st, label="decoded")
                session.append(tokens)
                twin.append(tokens)
                same_state(ours, theirs, session, twin)
            session.release()
            twin.release()
        elif step == "request":  # other traffic: evicts the conversations' blocks
            tokens = data.draw(st.integers(1, total).map(lambda n: list(range(-n, 0))))
            tokens = [t - 10**6 * data.draw(st.integers(1, 50), label="family") for t in tokens]
            other_request(ours, tokens)
            other_request(theirs, tokens)
        elif step == "replay" and twin.tokens:  # the conversation's prefix as another request
            tokens = twin.tokens[: data.draw(st.integers(1, len(twin.tokens)), label="replay")]
            other_request(ours, tokens)
            other_request(theirs, tokens)
        elif step == "evict":
            count = data.draw(st.integers(0, total), label="evict")
            assert ours.evict(count) == theirs.evict(count)
        same_state(ours, theirs, session, twin)
