"""Defragmentation under a TieredCache: what the tier remembers moves with the blocks, and a
layout changed behind its back costs demotions, never the wrong bytes under a hash.

A conversation that ended leaves its blocks free with their records (their bytes are still
its K/V); moving another chain's block into one of them overwrites those bytes, so the old
record must not be demoted from there."""

from __future__ import annotations

import numpy as np
import pytest

from prefixcache.engine.defragment import DefragmentPlan
from prefixcache.testing.engine_setup import small_allocator
from prefixcache.tiers import HostTier, TieredCache

BLOCK = 2
ENGINES = ["python", "native"]


def ids_of(tier: TieredCache, hashes: list[int]) -> list[int]:
    return tier.allocator.match_prefix(hashes, acquire=False).tolist()


def moved_into_an_ended_conversation(engine: str) -> tuple[TieredCache, DefragmentPlan, list]:
    """A tier whose ended conversation left three free blocks with records, a cached chain
    of two blocks, and a plan moving that chain's tail into the ended conversation's tail
    block. Returns the tier, the plan and ``(ended, moved_hash, ended_at_destination)``."""
    allocator = small_allocator(engine, "lru", 9, block_size_tokens=BLOCK)
    tier = TieredCache(allocator, HostTier(16, block_size=BLOCK))
    kept = tier.open_session()
    kept.turn([20, 21, 22], [23])
    kept_chain = kept.chain_hashes()
    kept_ids = ids_of(tier, kept_chain)
    ended = tier.open_session()
    ended.turn([10, 11, 12, 13, 14], [15])
    ended_chain = ended.chain_hashes()
    ended_ids = ids_of(tier, ended_chain)
    assert not set(kept_ids) & set(ended_ids)
    assert ended.end() == 3 and tier.allocator.get_evictable_block_count() == 2
    plan = DefragmentPlan(
        sources=np.array([kept_ids[-1]], dtype=np.int32),
        destinations=np.array([ended_ids[-1]], dtype=np.int32),
    )
    assert tier.take_transfer().ops == ()
    return tier, plan, [ended_chain, kept_chain[-1], ended_chain[-1]]


def hand_out_everything(tier: TieredCache) -> None:
    ids = tier.allocate(tier.allocator.num_usable)
    assert ids is not None
    tier.release(ids)


@pytest.mark.parametrize("engine", ENGINES)
def test_defragmenting_through_the_tier_moves_what_it_remembers(engine: str) -> None:
    tier, plan, (ended_chain, moved_hash, overwritten) = moved_into_an_ended_conversation(engine)
    assert tier.apply_defragment(plan) == 1
    tier.check()
    hand_out_everything(tier)
    assert overwritten not in tier.host  # its bytes were the moved block's
    assert moved_hash in tier.host  # demoted from where it moved to
    assert all(h in tier.host for h in ended_chain[:-1])  # untouched: still demoted
    tier.check()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_layout_changed_behind_the_tier_never_demotes_the_wrong_bytes(engine: str) -> None:
    tier, plan, (_, _, overwritten) = moved_into_an_ended_conversation(engine)
    assert tier.allocator.apply_defragment(plan) == 1
    hand_out_everything(tier)
    assert overwritten not in tier.host
    tier.check()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_refused_plan_changes_nothing_the_tier_remembers(engine: str) -> None:
    tier, plan, (ended_chain, _, overwritten) = moved_into_an_ended_conversation(engine)
    backwards = DefragmentPlan(sources=plan.destinations, destinations=plan.sources)
    with pytest.raises(Exception, match=r"free|live|cached|state"):
        tier.apply_defragment(backwards)  # the source is free: refused before any move
    hand_out_everything(tier)
    assert all(h in tier.host for h in ended_chain)  # every record still demoted
    assert overwritten in tier.host
    tier.check()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_tiered_session_checks_the_layout_before_its_turn(engine: str) -> None:
    tier, plan, (_, _, overwritten) = moved_into_an_ended_conversation(engine)
    assert tier.allocator.apply_defragment(plan) == 1
    tier.open_session().turn(list(range(100, 115)), [0])  # takes every block
    assert overwritten not in tier.host
    tier.check()
