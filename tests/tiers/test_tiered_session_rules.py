"""TieredSession's rules one at a time: demotion of what its steps hand out, promotion of a
lost context, real K/V through the copies, weight epochs, refusals, and the rule itself
(a session opened on the tier's allocator directly breaks ``TieredCache.check``)."""

from __future__ import annotations

from typing import Any

import pytest

from prefixcache import BlockStateError, CapacityError, ConfigError, InvalidArgumentError
from prefixcache.errors import InvariantError
from prefixcache.testing import state_digest
from prefixcache.testing.engine_setup import small_allocator
from prefixcache.tiers import HostTier, TieredCache
from prefixcache.tiers.transfer import DEMOTE, PROMOTE

BLOCK = 2
ENGINES = ["python", "native"]


def make_tier(engine: str, total: int = 9, slots: int = 16) -> TieredCache:
    allocator = small_allocator(engine, "lru", total, block_size_tokens=BLOCK)
    return TieredCache(allocator, HostTier(slots, block_size=BLOCK))


def tokens(seed: int, count: int) -> list[int]:
    return [seed * 1000 + i for i in range(count)]


def pushed_out(tier: TieredCache) -> None:
    """Another conversation's turn takes every block of an 8-block pool: through a session,
    so the blocks it hands out are the ones this file watches."""
    other = tier.open_session()
    other.turn(tokens(99, 15), [0])


def evicted_conversation(engine: str) -> tuple[TieredCache, Any, list[int], list[tuple]]:
    """A session's turn of 10 tokens (5 full blocks, registered through the tier), then
    another conversation's turn that takes every block: the tier, the session, its chain
    and the copies the second turn queued."""
    tier = make_tier(engine)
    session = tier.open_session()
    session.turn(tokens(1, 9), [5])
    assert tier.take_transfer().ops == ()  # nothing was cached before
    pushed_out(tier)
    return tier, session, session.chain_hashes(), list(tier.take_transfer().ops)


@pytest.mark.parametrize("engine", ENGINES)
def test_blocks_a_session_hands_out_are_demoted_first(engine: str) -> None:
    tier, _, chain, ops = evicted_conversation(engine)
    demoted = [op for op in ops if op[0] == DEMOTE]
    assert len(demoted) == len(chain) and all(h in tier.host for h in chain)
    assert tier.stats().num_demoted_blocks == len(chain)
    tier.check()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_lost_context_is_promoted_not_recomputed(engine: str) -> None:
    tier, session, chain, _ = evicted_conversation(engine)
    assert not any(tier.allocator.is_hash_registered(h) for h in chain)
    assert session.admit([7]) == len(chain)  # every context block from the host tier
    promoted = [op for op in tier.take_transfer().ops if op[0] == PROMOTE]
    assert [block for _, _, block in promoted] == session.block_ids.tolist()[: len(chain)]
    assert tier.stats().num_promoted_blocks == len(chain)
    session.release()
    tier.check()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_partly_lost_context_is_promoted_from_the_first_lost_block(engine: str) -> None:
    tier = make_tier(engine, total=13)  # 12 usable blocks
    session = tier.open_session()
    session.turn(tokens(1, 9), [5])  # 5 cached blocks
    chain = session.chain_hashes()
    assert tier.evict(2) == 2  # the chain's last two (leaves first)
    tier.take_transfer()
    kept = [tier.allocator.is_hash_registered(h) for h in chain]
    assert kept == [True, True, True, False, False]
    assert session.admit([7]) == 5
    promoted = [op for op in tier.take_transfer().ops if op[0] == PROMOTE]
    assert [block for _, _, block in promoted] == session.block_ids.tolist()[3:5]
    session.release()
    tier.check()


def test_kv_through_a_session_is_always_the_kv_of_its_hashes(make_loop) -> None:
    """A real KV cache: each step's copies run before its blocks are written, and every
    full block of a running turn holds the K/V of its chain hash (promoted or computed)."""
    loop = make_loop(9, 24)
    size = loop.allocator.block_size_tokens
    sessions = [loop.tiered.open_session() for _ in range(3)]
    computed = 0
    for turn in range(12):
        session = sessions[turn % 3]
        prompt = tokens(10 * turn + turn % 3, 3 + turn % 4)

        def step(first: int, session: Any = session) -> int:
            loop.copy()  # demotions read the handed-out blocks before they are written
            chain, row = session.chain_hashes(), session.block_ids.tolist()
            for index in range(first, len(chain)):
                loop.write(row[index], chain[index])
            caches = [*loop.kv.k_caches, *loop.kv.v_caches]
            for index, block_hash in enumerate(chain):
                held = [cache[row[index]].clone() for cache in caches]
                loop.write(row[index], block_hash)  # what it must hold: writing changes nothing
                assert all(h.equal(c[row[index]]) for h, c in zip(held, caches, strict=True))
            return len(chain) - first

        computed += step(session.admit(prompt))
        before = session.num_tokens // size
        session.append([1, 2, 3])
        computed += step(before)
        session.release()
        loop.tiered.check()
    stats = loop.tiered.stats()
    assert stats.num_promoted_blocks > 0 and stats.num_demoted_blocks > 0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_new_weight_epoch_ends_what_sessions_can_do(engine: str) -> None:
    tier = make_tier(engine)
    session = tier.open_session()
    session.admit(tokens(1, 5))
    tier.begin_weight_epoch("step-1")
    session.append([1, 2, 3])  # the running turn finishes in its own (retired) epoch
    session.release()
    with pytest.raises(ConfigError, match="weight epoch"):
        session.admit([4])
    with pytest.raises(ConfigError, match="weight epoch"):
        session.turn([4], [5])
    with pytest.raises(ConfigError, match="weight epoch"):
        tier.open_session()
    verifying = small_allocator(engine, block_size_tokens=BLOCK, verify_prefix_hits=True)
    with pytest.raises(ConfigError, match="verify_prefix_hits"):
        TieredCache(verifying, HostTier(4, block_size=BLOCK)).open_session()
    pushed_out_ids = tier.allocate(8)  # the retired blocks are handed out: never demoted
    assert pushed_out_ids is not None and tier.stats().num_demoted_blocks == 0
    tier.check()


@pytest.mark.parametrize("engine", ENGINES)
def test_refusals_change_nothing_even_where_a_promotion_was_due(engine: str) -> None:
    tier, session, _, _ = evicted_conversation(engine)
    before = (state_digest(tier.allocator), len(tier.host), tier.stats().num_promoted_blocks)
    for bad in ([], [2**31], "12"):
        with pytest.raises(InvalidArgumentError):
            session.admit(bad)
    with pytest.raises(InvalidArgumentError):
        session.admit([1], reserve=-1)
    with pytest.raises(InvalidArgumentError):
        session.turn([1], [])
    with pytest.raises(BlockStateError):
        session.append([1])
    with pytest.raises(BlockStateError):
        session.release()
    assert (
        state_digest(tier.allocator),
        len(tier.host),
        tier.stats().num_promoted_blocks,
    ) == before
    assert tier.take_transfer().ops == () and session.num_tokens == 10
    session.admit([1])
    with pytest.raises(BlockStateError):
        session.admit([2])
    with pytest.raises(BlockStateError):
        session.turn([2], [3])
    with pytest.raises(BlockStateError):
        session.end()
    session.release()
    tier.check()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_refused_turn_changes_nothing_and_end_starts_over(engine: str) -> None:
    tier = make_tier(engine)  # 8 usable blocks
    session = tier.open_session()
    before = state_digest(tier.allocator)
    with pytest.raises(CapacityError):
        session.turn(tokens(1, 5), list(range(20)))  # the prompt fits, the response does not
    assert state_digest(tier.allocator) == before and session.num_tokens == 0
    assert session.turn(tokens(1, 5), [1]) == 0
    assert session.end() == 3  # its cached blocks freed; the session starts over
    assert session.num_tokens == 0 and not session.running
    assert session.turn(tokens(1, 5), [1]) == 0  # recomputed (the tier still remembers)
    tier.check()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_session_behind_the_tiers_back_breaks_its_check(engine: str) -> None:
    """The rule the tiered session keeps: the allocator's own session hands a block the tier
    remembers out again and registers it anew without the tier, which check() catches (and
    the block's old K/V was never demoted)."""
    tier = make_tier(engine, total=5)  # 4 usable blocks
    ids = tier.allocate(4)
    assert ids is not None
    tier.register(ids, tier.allocator.hash_tokens(tokens(1, 8)))
    tier.release(ids)
    raw = tier.allocator.open_session()
    raw.turn(tokens(2, 7), [1])  # evicts and re-registers the tier's blocks
    with pytest.raises(InvariantError, match="behind the tier"):
        tier.check()
    assert tier.stats().num_demoted_blocks == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_blocks_freed_by_end_are_demoted_when_the_same_step_recomputes_them(engine: str) -> None:
    """end() frees blocks without handing them out, so the tier still remembers them; the
    next conversation's step that hands them out and registers the same hashes again
    demotes them first, as allocate-then-register through the tier does (the check reads
    the registry after the step, where those hashes are registered again)."""
    tier = make_tier(engine)
    session = tier.open_session()
    session.turn(tokens(1, 9), [5])
    chain = session.chain_hashes()
    assert session.end() == len(chain)
    tier.take_transfer()
    session.turn(tokens(1, 9), [5])  # the same conversation again, into the freed blocks
    demoted = [op for op in tier.take_transfer().ops if op[0] == DEMOTE]
    assert len(demoted) == len(chain) and all(h in tier.host for h in chain)
    tier.check()


def test_a_context_spilled_to_the_remote_tier_comes_back_from_there(make_loop, dict_client):
    """Device -> host -> (host full) remote: the session's next turn loads its context from
    the remote tier and promotes it, with the K/V it was computed with."""
    from prefixcache.tiers.remote import RemoteTier

    remote = RemoteTier(dict_client(), namespace="m")
    loop = make_loop(9, 4, remote=remote)  # 8 device blocks, 4 host slots: both spill
    size = loop.allocator.block_size_tokens
    caches = [*loop.kv.k_caches, *loop.kv.v_caches]

    def holds_its_kv(block: int, block_hash: int) -> bool:
        held = [cache[block].clone() for cache in caches]
        loop.write(block, block_hash)
        return all(h.equal(c[block]) for h, c in zip(held, caches, strict=True))

    session = loop.tiered.open_session()
    session.admit(tokens(1, 3 * size + 1))  # 3 full blocks and a partial one
    chain, row = session.chain_hashes(), session.block_ids.tolist()
    for block, block_hash in zip(row, chain, strict=False):
        loop.write(block, block_hash)  # the forward pass
    session.release()
    for seed in range(2, 5):  # other conversations push it out of both tiers
        loop.tiered.open_session().turn(tokens(seed, 7 * size), [7])
        loop.copy()
    remote.flush()
    assert not any(h in loop.host or loop.allocator.is_hash_registered(h) for h in chain)
    assert session.admit([9]) == len(chain)  # loaded from the remote tier and promoted
    loop.copy()
    row = session.block_ids.tolist()
    assert all(holds_its_kv(row[i], h) for i, h in enumerate(chain))
    assert loop.tiered.stats().num_promoted_blocks == len(chain)
    session.release()
    loop.tiered.check()
    remote.close()
